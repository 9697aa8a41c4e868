"""The single-tensor reduce-scatter and all-gather under the names of the running torch: torch 2.13 calls them
reduce_scatter_single / all_gather_single and warns on every call of the old names (reduce_scatter_tensor,
all_gather_into_tensor), which the torch 2.9 of the XLA path still needs. Same arguments, same semantics."""

from __future__ import annotations

import torch.distributed as dist

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
