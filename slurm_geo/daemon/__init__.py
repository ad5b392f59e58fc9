"""Plumbing both daemons (checkpoint-sync and the federation daemon) share: `events` (one
logfmt line per event, journald-friendly), `notify` (systemd's sd_notify) and `process`
(a signal queue and wakeup for the main loop, CPU and I/O priority).

Submodules are imported by their users; this package imports none of them, and none of
them imports anything of slurm_geo outside this package.
"""
