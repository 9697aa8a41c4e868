"""Environment that points a job's compilers at the compile cache. Pure.

Neuron resolves its cache root from `--cache_dir` in NEURON_CC_FLAGS first, then
NEURON_COMPILE_CACHE_URL, then /var/tmp/neuron-compile-cache (shared/reference/neuron-xla.md
2.1). We set NEURON_COMPILE_CACHE_URL and leave NEURON_CC_FLAGS to the platform, so both phases
see identical compiler flags (the flags are part of the cache key). Off Trainium the same folder
holds TorchInductor's and Triton's caches.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "MEGATRON_HPC_CACHE_DIR"
NEURON_DEFAULT_ROOT = "/var/tmp/neuron-compile-cache"


def cache_env(*, backend: str, root: str) -> dict[str, str]:
    """Variables that make every compiler of `backend` use the cache at `root`."""
    if backend == "xla":
        return {"NEURON_COMPILE_CACHE_URL": f"{root}/neuron"}
    return {
        "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",
        "TRITON_CACHE_DIR": f"{root}/triton",
    }


def default_cache_root() -> Path:
    """$MEGATRON_HPC_CACHE_DIR, else ~/.cache/megatron-hpc/compile-cache.

    Home folders are usually on the cluster's shared filesystem, which is where the Neuron
    launchers keep their cache too (neuron-xla.md 2.3: NEURON_COMPILE_CACHE_URL=$HOME/neuron_cache).
    """
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    return Path.home() / ".cache" / "megatron-hpc" / "compile-cache"
