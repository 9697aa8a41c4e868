"""Hugging Face Llama and Qwen2 folders imported at TP 2 and at PP 2 (`ckpt convert HF_DIR --to xser --tp 2` /
`--pp 2`) run in two real gloo processes: each TP rank loads its own shard (one key/value group of two) and the
gathered logits are transformers'; the two pipeline stages, passing activations as the trainer's do
(evaluate/pipelined.py), give transformers' per-token losses. One spawn serves both."""

from __future__ import annotations

import sys
from pathlib import Path

import mp_workers
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from hf_models import LLAMA3_ROPE, LLAMA_TOKENS, hf_llama_model, save_llama

from megatron_hpc.cli.main import main

pytestmark = pytest.mark.multiprocess


def _forwards(rank: int, world: int, ports: list[int], tp_ckpts: list[str], pp_ckpts: list[str],
              tokens: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank 0's (TP 2 logits per checkpoint, gathered to the full vocabulary; PP 2 per-token losses per checkpoint)."""
    from megatron_hpc.evaluate.pipelined import PipelinedScorer
    from megatron_hpc.evaluate.scoring import token_losses
    from megatron_hpc.evaluate.sharded import ShardRank, load_shard
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    logits = [mp_workers.gathered_tp_logits(ctx, ckpt, tokens) for ckpt in tp_ckpts]
    losses = []
    for ckpt in pp_ckpts:
        shard = load_shard(Path(ckpt), ShardRank(rank=rank, world_size=world))
        scorer = PipelinedScorer(shard.loaded.model, shard.ctx, batch_size=tokens.shape[0],
                                 seq_length=tokens.shape[1] - 1)
        losses.append(token_losses(scorer, tokens.tolist()))
    dist.destroy_process_group()
    return logits, losses


def test_llama_and_qwen2_at_tp2_and_pp2_give_transformers_outputs(tmp_path: Path) -> None:
    models = {"llama": hf_llama_model(rope=LLAMA3_ROPE), "qwen2": hf_llama_model("Qwen2ForCausalLM", seed=1)}
    tp_ckpts, pp_ckpts = [], []
    for name, theirs in models.items():
        folder = save_llama(theirs, tmp_path / f"hf_{name}", tokenizer=False)
        for flag, ckpts in (("--tp", tp_ckpts), ("--pp", pp_ckpts)):
            ckpts.append(str(tmp_path / f"{flag[2:]}2_{name}"))
            assert main(["ckpt", "convert", str(folder), "--to", "xser", flag, "2", "--out", ckpts[-1]]) == 0
    logits, losses = mp_workers.spawn(_forwards, world=2, out_dir=tmp_path / "out",
                                      args=(tp_ckpts, pp_ckpts, LLAMA_TOKENS))[0]
    for (name, theirs), got_logits, got_losses in zip(models.items(), logits, losses, strict=True):
        with torch.no_grad():
            want = theirs(LLAMA_TOKENS).logits
        torch.testing.assert_close(got_logits, want, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n} tp2: {m}")
        want_losses = F.cross_entropy(want[:, :-1].flatten(0, 1), LLAMA_TOKENS[:, 1:].flatten(),
                                      reduction="none").view(got_losses.shape)
        torch.testing.assert_close(got_losses, want_losses, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n} pp2: {m}")
