"""Operations over whole stores: check, gc, prune, replicate (and its verification records,
`verified`), key rotation and resealing (`rotate`, `reseal`), and usage (`usage`).

Submodules are imported by their users; this package imports none of them.
"""
