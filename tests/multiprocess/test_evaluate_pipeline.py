"""`megatron-hpc evaluate` of a checkpoint trained at PP=2, at its own size under torchrun (two real gloo processes,
one pipeline stage each, the activations passed stage to stage by torch.distributed.pipelining): the valid and test
split losses and the WikiText zero-shot figures equal the merged TP 1 evaluation's, and the test loss the one the
training run printed at its end. Too many processes are refused in one line naming the right count."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mp_workers
import pytest
import torch
import torch.distributed as dist
from test_evaluate_test_split import FIXTURE, LAMBADA, MODEL, write_random_corpus

pytestmark = pytest.mark.multiprocess


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _torchrun(nproc: int) -> list[str]:
    # --standalone: torchrun's rendezvous store binds a port of the kernel's choosing at once (a port found free and
    # passed as --master_port stays unbound until the store binds it: another process group could take it)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "megatron_hpc"]


def test_pp2_evaluation_equals_the_merged_one(tmp_path: Path, cli_in_process) -> None:
    write_random_corpus(tmp_path / "corpus", seed=5, documents=120)
    sets = [*MODEL, "data.source=indexed", f"data.path={tmp_path / 'corpus'}", "data.split=80,10,10",
            f"data.cache_path={tmp_path / 'cache'}", "parallel.pipeline=2", "train.num_steps=2",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=1", "train.eval_interval=1",
            "train.tensorboard=false", f"checkpoint.save={tmp_path / 'ckpt'}",
            f"data.vocab_file={FIXTURE / 'vocab.json'}", f"data.merge_file={FIXTURE / 'merges.txt'}"]
    args = [*_torchrun(2), "train", "--recipe", "tiny"]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.findall(r" validation loss at iteration 2 on test set \| lm loss value: (\S+) \|", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]

    (tmp_path / "wiki.txt").write_text(" ".join(LAMBADA * 6) + " \n")
    evaluate = ["evaluate", str(tmp_path / "ckpt"), "--json", "--split", "both", "--task", "wikitext", "--file",
                str(tmp_path / "wiki.txt"), "--overlapping-eval", "8"]
    merged = cli_in_process(*evaluate)  # merged to TP 1, in this process (the CLI's main())
    staged = subprocess.run([*_torchrun(2), *evaluate], capture_output=True, text=True, env=_env())
    for ev in (merged, staged):
        assert ev.returncode == 0, ev.stderr[-3000:]
    merged, staged = (json.loads(ev.stdout) for ev in (merged, staged))  # rank 0 alone prints
    for report in (merged, staged):
        assert (report["tensor_parallel"], report["pipeline_parallel"]) == (1, 2)
    assert staged["splits"]["test"]["loss"] == pytest.approx(float(found[0]), rel=2e-6)
    for split in ("valid", "test"):
        assert staged["splits"][split]["samples"] == merged["splits"][split]["samples"] == 4
        assert staged["splits"][split]["loss"] == pytest.approx(merged["splits"][split]["loss"], rel=1e-6)
    assert merged["splits"]["valid"]["loss"] != pytest.approx(merged["splits"]["test"]["loss"], rel=1e-6)
    one, two = merged["tasks"]["wikitext"], staged["tasks"]["wikitext"]
    assert (one["tokens"], one["words"], one["stride"]) == (two["tokens"], two["words"], two["stride"])
    assert one["tokens"] > 32  # several windows, the last one shorter than the fixed shape the stages run
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["word_ppl"] == pytest.approx(one["word_ppl"], rel=1e-5)

    # the count is checked before the process group is joined: no torchrun needed to see the refusal
    from megatron_hpc.errors import CheckpointError
    from megatron_hpc.evaluate.sharded import ShardRank, load_shard

    with pytest.raises(CheckpointError, match=r"saved at tp 1 x pp 2 and this evaluate has 3 processes; run it "
                                              r"with torchrun --nproc_per_node=2, or without torchrun"):
        load_shard(tmp_path / "ckpt", ShardRank(rank=0, world_size=3))


ROWS = [list(range(3, 20)), [7, 8, 9], list(range(100, 133)), [1, 2, 3, 4, 5]]  # widths 17, 3, 33 (full), 5


def score_at_pp(rank: int, world: int, ports: list[int], virtual: int) -> list[torch.Tensor]:
    """Per-target losses and argmax ids of ROWS (a batch of 3, then of 1): a whole model alone, else through this
    pipeline rank's stages; every rank returns the figures."""
    from megatron_hpc.config.schema import ModelConfig
    from megatron_hpc.evaluate.pipelined import PipelinedScorer
    from megatron_hpc.evaluate.scoring import global_argmax, token_losses
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.stages import rank_stages, stage_layouts

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=1,
                                     pipeline_parallel=world), rank=rank)
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=32, vocab_size=500, init_method_std=0.2)
    stages = None if world == 1 else rank_stages(stage_layouts(4, pipeline=world, virtual=virtual), ctx.pp_rank)
    model = GPT(cfg, ctx=ctx, padded_vocab=512, seed=3, stages=stages).eval()  # the init is PP-invariant
    scorer = model if world == 1 else PipelinedScorer(model, ctx, batch_size=3, seq_length=32)
    out = []
    for batch in (ROWS[:3], ROWS[3:]):
        out.append(token_losses(scorer, batch))
        width = max(len(r) for r in batch)
        inputs = torch.tensor([r + [0] * (width - len(r)) for r in batch])[:, :-1]  # (B, W - 1), as scored
        if world == 1:
            with torch.no_grad():
                out.append(model(inputs).argmax(dim=-1))
        else:
            out.append(scorer.apply(inputs, lambda logits: global_argmax(logits, group=model.group),
                                    dtype=torch.long))
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipelined_scorer_equals_the_whole_model(tmp_path: Path, virtual: int) -> None:
    """Two pipeline ranks (two virtual stages each with virtual=2: ScheduleLoopedBFS) give the whole model's
    losses and argmax ids, for a short batch padded to the fixed shape and a full-width row alike."""
    whole = mp_workers.spawn(score_at_pp, world=1, out_dir=tmp_path / "pp1", args=(virtual,))[0]
    staged = mp_workers.spawn(score_at_pp, world=2, out_dir=tmp_path / "pp2", args=(virtual,))
    for got in staged:  # every rank has the last stage's figures
        for a, b in zip(whole, got):
            assert a.shape == b.shape
            if a.is_floating_point():
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(a, b)
    assert len(set(whole[1].flatten().tolist())) > 3  # the argmax is not one constant id
