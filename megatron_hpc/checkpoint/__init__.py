"""Checkpoints in the Megatron layout with xser files: paths, xser I/O, manifest, save, load."""
