"""Shared compile cache: where Neuron's and torch.compile's caches live and how jobs find them.

Installed as `megatron_hpc.compile_cache`. Imports no torch.
"""
