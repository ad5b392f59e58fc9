"""Moving training jobs between Slurm clusters: health, bandwidth, placement, requeue,
fencing and the audit log.

Submodules are imported by their users; this package imports none of them.
"""
