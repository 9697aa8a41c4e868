"""The Megatron layout on disk: paths, manifest, xser files, save, load, async save."""
