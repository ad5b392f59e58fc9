"""checkpoint-sync: replicate committed checkpoints off-site, verify them, never lose track.

`state` (the SQLite lifecycle), `scanner` (committed checkpoints under a root), `planner`
(pure decisions), `jobdirs` (pure: which registered jobs' checkpoint directories are
replicated) and `sources` (reading the registry, looking at those directories), `worker`
(one copy-and-verify attempt), `daemon` (the systemd main loop) and `entry` (its command
line). docs/checkpoint-sync.md is the admin's guide.
"""
