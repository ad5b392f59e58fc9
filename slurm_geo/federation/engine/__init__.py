"""The federation daemon, wired: one round gathers, reconciles and applies (`core`), the
answers to training jobs (`leaseservice`), and the daemon built from the site config
(`runtime`).

Submodules are imported by their users; this package imports none of them.
"""
