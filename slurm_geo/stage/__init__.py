"""Staged trees (issue 31; docs/format.md §11): a job's inputs and software environment
(a dataset, a project directory, a virtualenv, a container image file) as immutable,
versioned, encrypted snapshots in a checkpoint store, next to the checkpoints and in the
same format: content-defined chunks, AES-GCM packs, sealed manifests.

`trees.Trees` stages, reads, verifies and materialises; `walk` reads a tree only through
a caller's opener, never following a link; `keys` holds the per-domain key rings;
`manifest` is the tree manifest; `names` the objects' names; `cdc` the vectorised cuts.
At the destination, `present` materialises a job's world into a private `workspace` and
shows it at its home paths (`nsexec`: an unprivileged user and mount namespace), as
`node` allows. Not wired yet: checkpoint-sync does not stage what `--geo-inputs`/`--geo-env`
name, the daemon hands no tree key to a job, and no job's preamble calls `present`
(format.md §11.7).
"""
