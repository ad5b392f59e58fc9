"""Tensor files without torch: push and pull (`pushpull`), `torch.save` archives
(`torchfile`, `torchpickle`, `ziparchive`), safetensors (`safetensors`), files mapped a
tensor at a time (`tensorfile`) and training-state skeletons (`skeleton`).

Submodules are imported by their users; this package imports none of them.
"""
