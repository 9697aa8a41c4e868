"""Environment that points a job's compilers at the compile cache, and how that cache is laid out. Pure.

Neuron resolves its cache root from `--cache_dir` in NEURON_CC_FLAGS first, then
NEURON_COMPILE_CACHE_URL, then /var/tmp/neuron-compile-cache (shared/reference/neuron-xla.md
2.1). We set NEURON_COMPILE_CACHE_URL and leave NEURON_CC_FLAGS to the platform, so both phases
see identical compiler flags (the flags are part of the cache key). Off Trainium the same folder
holds TorchInductor's and Triton's caches.

A launcher cache root (the shared one, and each node-local one) holds one folder per compiler:
`neuron/` in Neuron's layout (entries shared by store.py), `inductor/`, a plain tree of files
(shared by tree.py), and `triton/`, which stays on the node. Triton's group files
(`__grp__*.json`) name their kernel files by absolute path, so a copy under another node-local
root is found but useless, and it would stop Inductor from re-emitting the kernels it bundles into
its FX graph cache entries (torch 2.13 `TritonBundler.read_and_emit` skips a non-empty kernel
folder). Triton kernels travel inside Inductor's entries instead. The shared root also holds
`megatron-hpc/fingerprints/`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

CACHE_DIR_ENV = "MEGATRON_HPC_CACHE_DIR"
LOCAL_CACHE_DIR_ENV = "MEGATRON_HPC_LOCAL_CACHE_DIR"
"""A node-local cache root kept between jobs; by default each phase uses a fresh one under $TMPDIR."""
NEURON_DEFAULT_ROOT = "/var/tmp/neuron-compile-cache"

Layout = Literal["neuron", "tree", "launcher"]
LAUNCHER_LAYOUT: dict[str, Layout] = {"neuron": "neuron", "inductor": "tree"}
"""The folders of a launcher cache root that are published and synced, and the layout of each."""


def cache_env(*, backend: str, root: str) -> dict[str, str]:
    """Variables that make every compiler of `backend` use the cache at `root`."""
    if backend == "xla":
        return {"NEURON_COMPILE_CACHE_URL": f"{root}/neuron"}
    return {
        "TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor",
        "TRITON_CACHE_DIR": f"{root}/triton",
    }


def warm_start_env(*, backend: str, torch_compile: bool) -> dict[str, str]:
    """Switches that make torch.compile save and reuse its work across processes (not on XLA).

    Inductor's FX graph cache holds the generated code of each graph (its C++ kernels are built into
    `.so` files beside it); the AOTAutograd cache holds the forward/backward split, without which every
    start traces the joint graph again. AOTAutograd bypasses its cache for graphs holding a custom
    autograd.Function ("Unsupported call_function target autograd_function_apply", torch 2.13), which
    our tensor-parallel mappings are (parallel/mappings.py). Dynamo traces their forward and backward
    into subgraphs of the graph, so the cache key covers their code; we allow them. On GPUs the FX
    graph cache entries carry the Triton kernels (torch's default, made explicit: the module
    docstring says why Triton's own cache stays on the node).

    No precompiled header for the C++ kernels: Inductor keeps it (150 MB) outside its cache folder,
    in $TMPDIR/torchinductor_<user>, and looks for it before loading any cached kernel, so every
    warm start on a fresh node compiled it again, and every warm start at all ran the preprocessor
    over it to hash it. Without it the compile phase compiles its kernels more slowly, once, and the
    runs start about twice as fast (benchmarks/RESULTS.md, issue 7).
    """
    if backend == "xla" or not torch_compile:
        return {}
    return {
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD": "1",
        "TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
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
