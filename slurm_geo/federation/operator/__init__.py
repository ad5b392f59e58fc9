"""What people ask of the federation beside its daemon: operator commands on logical jobs
(`operations`, `runowners`, `replication`), what `slurm-geo status` shows (`views`,
`output`, `worldstatus`), and a user's requests about her own jobs (`ownerverbs` on the
daemon's side, `ownerclient` on hers).

Submodules are imported by their users; this package imports none of them.
"""
