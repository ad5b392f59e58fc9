"""The federation daemon's decisions, pure: what a logical job does next (`reconcile`), where
it runs (`planner`, `bandwidth`, `pending`, `worldstaged`, `worldwait`), who trains
(`leases`), who ended it (`cancels`), what its owner's directives allow (`owners`).

Submodules are imported by their users; this package imports none of them.
"""
