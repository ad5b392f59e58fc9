"""Checkpoints of runs in a store: the repository (`repository`, `writer`, `reader`,
`sharded`), the keys it holds (`keyholder`, `runkey`), push locks (`locks`) and fences
(`fence`).

Submodules are imported by their users; this package imports none of them.
"""
