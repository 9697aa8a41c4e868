"""A GPT2LMHeadModel and GPTNeoXForCausalLMs (parallel residual or not) of the real `transformers` imported at TP 2
(`ckpt convert HF_DIR --to xser --tp 2`): our GPT, loaded shard by shard in two gloo processes, gives transformers'
logits on the real vocabulary (float32, 1e-4). One spawn serves every model."""

from __future__ import annotations

import sys
from pathlib import Path

import mp_workers
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from hf_models import TOKENS, hf_logits, hf_model, hf_neox_model, save

from megatron_hpc.cli.main import main

pytestmark = pytest.mark.multiprocess


def tp_logits(rank: int, world: int, ports: list[int], ckpts: list[str],
              tokens: torch.Tensor) -> list[torch.Tensor] | None:
    """Logits of our GPT loaded shard by shard from each of `ckpts` at TP=world, gathered to the full vocabulary on
    rank 0."""
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    out = [mp_workers.gathered_tp_logits(ctx, ckpt, tokens) for ckpt in ckpts]
    dist.destroy_process_group()
    return out if rank == 0 else None


def test_gpt2_and_neox_imported_at_tp2_give_transformers_logits(tmp_path: Path) -> None:
    models = {"gpt2": (hf_model(), "shards"), "neox": (hf_neox_model(), "safetensors"),
              "neox_sequential": (hf_neox_model(seed=1, parallel_residual=False, rotary_pct=1.0), "bin")}
    ckpts = []
    for name, (theirs, how) in models.items():
        folder = save(theirs, tmp_path / f"hf_{name}", how)
        ckpts.append(str(tmp_path / f"tp2_{name}"))
        assert main(["ckpt", "convert", str(folder), "--to", "xser", "--tp", "2", "--out", ckpts[-1]]) == 0
    got = mp_workers.spawn(tp_logits, world=2, out_dir=tmp_path / "logits", args=(ckpts, TOKENS))[0]
    for (name, (theirs, _)), logits in zip(models.items(), got, strict=True):
        torch.testing.assert_close(logits, hf_logits(theirs), rtol=0, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
