"""The checkpoint byte format (docs/format.md), pure over bytes: chunk cuts (`chunking`),
encoded blobs (`codec`), packs (`pack`), sealed objects (`seal`), key material (`keys`),
manifests (`manifest`), multi-rank layouts (`layout`), object names (`names`) and the
rollback rule (`rollback`).

Submodules are imported by their users; this package imports none of them.
"""
