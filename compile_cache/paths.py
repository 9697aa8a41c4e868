"""Environment that points a job's compilers at the compile cache. Pure.

Neuron resolves its cache root from `--cache_dir` in NEURON_CC_FLAGS first, then
NEURON_COMPILE_CACHE_URL, then /var/tmp/neuron-compile-cache (shared/reference/neuron-xla.md
2.1). We set NEURON_COMPILE_CACHE_URL and leave NEURON_CC_FLAGS to the platform, so both phases
see identical compiler flags (the flags are part of the cache key). Off Trainium the same folder
holds TorchInductor's and Triton's caches.
"""

from __future__ import annotations

NEURON_DEFAULT_ROOT = "/var/tmp/neuron-compile-cache"


def cache_env(*, backend: str, root: str) -> dict[str, str]:
    """Variables that make every compiler of `backend` use the cache at `root`."""
    if backend == "xla":
        return {"NEURON_COMPILE_CACHE_URL": f"{root}/neuron"}
    return {
        "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",
        "TRITON_CACHE_DIR": f"{root}/triton",
    }
