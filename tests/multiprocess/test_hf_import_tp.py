"""A GPT2LMHeadModel of the real `transformers` imported at TP 2 (`ckpt convert HF_DIR --to xser --tp 2`): our GPT,
loaded shard by shard in two gloo processes, gives transformers' logits on the real vocabulary (float32, 1e-4)."""

from __future__ import annotations

import sys
from pathlib import Path

import mp_workers
import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from hf_models import TOKENS, VOCAB, hf_logits, hf_model, save

from megatron_hpc.cli.main import main

pytestmark = pytest.mark.multiprocess


def tp_logits(rank: int, world: int, ports: list[int], ckpt: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits of our GPT loaded from this rank's shard of `ckpt` at TP=world, gathered to the full vocabulary on
    rank 0; the model config is the checkpoint's resolved one."""
    from megatron_hpc.checkpoint.loader import read_shard
    from megatron_hpc.checkpoint.whole import locate
    from megatron_hpc.config.loader import from_dict
    from megatron_hpc.config.schema import ModelConfig
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    state = read_shard(locate(Path(ckpt)), tp_rank=rank)
    cfg = from_dict(ModelConfig, state["resolved_config"]["model"], where="model")
    model = GPT(cfg, ctx=ctx, padded_vocab=state["padded_vocab_size"], seed=1)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        local = model.eval()(tokens)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    dist.destroy_process_group()
    return torch.cat(parts, dim=-1)[..., :VOCAB] if rank == 0 else None


def test_gpt2_imported_at_tp2_gives_transformers_logits(tmp_path: Path) -> None:
    theirs = hf_model()
    folder = save(theirs, tmp_path / "hf", "shards")
    assert main(["ckpt", "convert", str(folder), "--to", "xser", "--tp", "2", "--out", str(tmp_path / "tp2")]) == 0
    got = mp_workers.spawn(tp_logits, world=2, out_dir=tmp_path / "logits", args=(str(tmp_path / "tp2"), TOKENS))[0]
    torch.testing.assert_close(got, hf_logits(theirs), rtol=0, atol=1e-4)
