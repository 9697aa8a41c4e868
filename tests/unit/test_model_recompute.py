"""Recomputation really recomputes, keeps less for backward, and changes no number (dropout masks replayed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.errors import PlanError
from megatron_hpc.model.gpt import GPT, AttentionCore, Block
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_hpc.plan.stages import StageLayout

CFG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16, max_position_embeddings=32,
                  vocab_size=500)

SETTINGS = {
    "plain": {},
    "selective": {"recompute_granularity": "selective"},
    "uniform1": {"recompute": True},
    "uniform2": {"recompute_granularity": "full", "recompute_num_layers": 2},
    "block1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


def _model(ctx: ParallelContext, setting: str, **extra: float) -> GPT:
    return GPT(dataclasses.replace(CFG, **SETTINGS[setting], **extra), ctx=ctx, padded_vocab=512, seed=1)


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))


def _step(model: GPT, ctx: ParallelContext, *, seed: int = 0) -> tuple[float, list[torch.Tensor]]:
    ids = _ids()
    torch.manual_seed(seed)
    loss = vocab_parallel_cross_entropy(model(ids[:, :-1]), ids[:, 1:], group=ctx.tp_group).mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _count_forwards(model: GPT, kind: type) -> list[int]:
    calls = [0]
    for module in model.modules():
        if isinstance(module, kind):
            module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("setting, blocks, cores", [
    ("plain", 4, 4),
    ("selective", 4, 8),  # each attention core once more in backward, the rest of the layer not
    ("uniform1", 8, 8),  # every layer twice
    ("uniform2", 8, 8),
    ("block1", 5, 5),  # only the first layer of the stage twice
])
def test_forward_calls_in_one_step(ctx: ParallelContext, setting: str, blocks: int, cores: int) -> None:
    model = _model(ctx, setting)
    block_calls, core_calls = _count_forwards(model, Block), _count_forwards(model, AttentionCore)
    _step(model, ctx)
    assert (block_calls[0], core_calls[0]) == (blocks, cores)


def test_eval_recomputes_nothing(ctx: ParallelContext) -> None:
    model = _model(ctx, "uniform1").eval()
    block_calls = _count_forwards(model, Block)
    with torch.no_grad():
        model(_ids()[:, :-1])
    assert block_calls[0] == 4


def _saved_bytes(model: GPT) -> int:
    """Bytes autograd saves for backward during one forward, seen from outside any checkpoint."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    ids = _ids()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids[:, :-1])
    return total[0]


def test_recomputation_saves_fewer_bytes(ctx: ParallelContext) -> None:
    saved = {name: _saved_bytes(_model(ctx, name)) for name in SETTINGS}
    assert saved["plain"] > saved["selective"], saved
    assert saved["plain"] > saved["block1"] > saved["uniform1"], saved


@pytest.mark.parametrize("setting", ["selective", "uniform1", "uniform2", "block1"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_same_loss_and_grads_as_plain(ctx: ParallelContext, setting: str, dropout: float) -> None:
    # With dropout the recomputed forward must draw the same masks (torch's checkpoint restores the RNG state).
    extra = {"attention_dropout": dropout, "hidden_dropout": dropout}
    loss_a, grads_a = _step(_model(ctx, "plain", **extra), ctx, seed=5)
    loss_b, grads_b = _step(_model(ctx, setting, **extra), ctx, seed=5)
    assert loss_a == loss_b
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)


def test_dropout_masks_differ_between_seeds(ctx: ParallelContext) -> None:
    # Guards the test above: were dropout inactive, equal losses would prove nothing about replayed masks.
    extra = {"attention_dropout": 0.1, "hidden_dropout": 0.1}
    assert _step(_model(ctx, "plain", **extra), ctx, seed=5)[0] != _step(_model(ctx, "plain", **extra), ctx, seed=6)[0]


def test_groups_follow_the_stage(ctx: ParallelContext) -> None:
    # A pipeline stage holding layers 2..3: block counts from the stage's first layer, not the model's.
    cfg = dataclasses.replace(CFG, **SETTINGS["block1"])
    stage = StageLayout(index=1, pp_rank=1, chunk=0, layers=range(2, 4), first=False, last=True)
    model = GPT(cfg, ctx=ctx, padded_vocab=512, seed=1, stages=[stage])
    calls = {i: [0] for i in (2, 3)}
    for i in (2, 3):
        model.h[str(i)].register_forward_pre_hook(lambda *_, c=calls[i]: c.__setitem__(0, c[0] + 1))
    out = model.stage_forward(torch.randn(2, 16, 64, requires_grad=True), stage)
    out.float().sum().backward()
    assert (calls[2][0], calls[3][0]) == (2, 1)


def test_model_refuses_a_group_that_does_not_fit_its_stage(ctx: ParallelContext) -> None:
    cfg = dataclasses.replace(CFG, recompute_granularity="full", recompute_num_layers=3)
    with pytest.raises(PlanError, match="recompute_num_layers=3 must divide"):
        GPT(cfg, ctx=ctx, padded_vocab=512, seed=1)
