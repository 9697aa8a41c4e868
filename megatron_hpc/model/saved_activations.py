"""What autograd keeps for backward while a micro-batch runs forward: the bytes the memory estimate's activation
figures stand for (plan/memory.py), measured with saved-tensor hooks."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_hpc.model.gpt import GPT


def saved_activation_bytes(model: GPT, inputs: Sequence[torch.Tensor]) -> int:
    """Bytes saved for backward while inputs[k] goes through model.stages[k] (one micro-batch through every stage
    of this rank: token ids on the first stage, hidden states on the others). Each storage is counted once (views
    of one tensor share it); the parameters and buffers, which the weights already count, are left out. The
    outputs are dropped before returning, so the memory is freed."""
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = [model.stage_forward(x, stage) for x, stage in zip(inputs, model.stages)]
    del outputs
    return sum(seen.values())
