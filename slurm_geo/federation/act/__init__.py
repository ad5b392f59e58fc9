"""The federation daemon's actions on clusters and stores: moving a job (`mover`,
`resubmit`, `credentials`, `resumepoint`, `highwater`), fencing (`fencing`), measuring
(`probes`), registering home jobs (`registration`) and granting a job's world (`worldgrants`).

Submodules are imported by their users; this package imports none of them.
"""
