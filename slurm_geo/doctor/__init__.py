"""`slurm-geo doctor`: is this host's part of a deployment right? (issue 33, item 4)

facts.py: what is gathered; gather.py: gathering it from the host (files, munge, Slurm's
commands through slurm_geo.slurm, etcd, stores, the daemon); checks.py: the pure
judgements, one Finding per piece; examine.py: which pieces each role of host has.
"""

ROLES = ("login", "compute", "controller", "daemon")
