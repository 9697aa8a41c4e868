"""Recipes shipped with megatron-hpc (YAML package data; see megatron_hpc.config.loader)."""
