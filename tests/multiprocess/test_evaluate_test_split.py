"""The test split evaluated at the end of a TP=2 torchrun training run (two real gloo processes) equals
`megatron-hpc evaluate --split test` on its checkpoint, merged to TP 1 in one process and at TP 2 under torchrun:
same samples, same loss; the zero-shot tasks give the same figures at TP 2 as at TP 1; the vocab-parallel argmax
equals torch.argmax of the gathered logits, ties included.

The TP 1 evaluations run in this process (`cli_in_process`, the CLI's main()); training and the TP 2 evaluations
are real torchrun launches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mp_workers
import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_hpc.data.indexed import IndexedDatasetWriter

pytestmark = pytest.mark.multiprocess

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
LAMBADA = ["the cat sat on the mat", "I am sure it is", "we see what they do", "It is a test of it",
           "class Stack: self.items", "return a + b"]

MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.max_position_embeddings=32", "model.vocab_size=400", "model.make_vocab_size_divisible_by=64",
         "model.init_method_std=0.2"]


def write_random_corpus(prefix: Path, *, seed: int, documents: int) -> None:
    """An indexed corpus of random token documents (ids below MODEL's vocabulary, 10 to 79 tokens each)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(prefix), dtype=np.uint16) as writer:
        for _ in range(documents):
            writer.add_document(rng.integers(0, 400, size=int(rng.integers(10, 80))))


def test_end_of_training_test_loss_equals_evaluate(tmp_path: Path, cli_in_process) -> None:
    write_random_corpus(tmp_path / "corpus", seed=3, documents=150)
    sets = [*MODEL, "data.source=indexed", f"data.path={tmp_path / 'corpus'}", "data.split=80,10,10",
            f"data.cache_path={tmp_path / 'cache'}", "parallel.tensor=2", "train.num_steps=3",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=2",
            "train.tensorboard=false", f"checkpoint.save={tmp_path / 'ckpt'}",
            f"data.vocab_file={FIXTURE / 'vocab.json'}", f"data.merge_file={FIXTURE / 'merges.txt'}"]
    # --standalone: torchrun's rendezvous store binds a port of the kernel's choosing at once (a port found free and
    # passed as --master_port stays unbound until the store binds it: another process group could take it)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "megatron_hpc", "train", "--recipe", "tiny"]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.findall(r" validation loss at iteration 3 on test set \| lm loss value: (\S+) \|", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]  # printed once, by the last rank

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    (tmp_path / "lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA))
    (tmp_path / "wiki.txt").write_text(" ".join(LAMBADA * 6) + " \n")
    split = ["--split", "test"]
    lambada = ["--task", "lambada", "--file", str(tmp_path / "lambada.jsonl")]
    wikitext = ["--task", "wikitext", "--file", str(tmp_path / "wiki.txt"), "--overlapping-eval", "8"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    reports = {}
    for name, extra in (("test", split), ("lambada", lambada), ("wikitext", wikitext)):
        reports[1, name] = cli_in_process("evaluate", str(tmp_path / "ckpt"), "--json", *extra)
    # at TP 2 the split and a task in one command (each torchrun starts three interpreters)
    for names, extra in ((("test", "lambada"), split + lambada), (("wikitext",), wikitext)):
        ev = subprocess.run([*torchrun, "-m", "megatron_hpc", "evaluate",
                             str(tmp_path / "ckpt"), "--json", *extra], capture_output=True, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
        reports.update({(2, name): ev for name in names})
    for key, ev in reports.items():
        assert ev.returncode == 0, ev.stderr[-2000:]
        reports[key] = json.loads(ev.stdout)  # rank 0 alone prints
        assert reports[key]["tensor_parallel"] == 2
    for tp in (1, 2):
        test = reports[tp, "test"]["splits"]["test"]
        assert test["samples"] == 2 * 4
        assert test["loss"] == pytest.approx(float(found[0]), rel=2e-6)
    assert reports[1, "lambada"]["tasks"] == reports[2, "lambada"]["tasks"]
    one, two = reports[1, "wikitext"]["tasks"]["wikitext"], reports[2, "wikitext"]["tasks"]["wikitext"]
    assert one["tokens"] == two["tokens"] and one["words"] == two["words"]
    assert one["token_ppl"] == pytest.approx(two["token_ppl"], rel=1e-5)


def argmax_worker(rank: int, world: int, ports: list[int], full: torch.Tensor) -> torch.Tensor:
    from megatron_hpc.evaluate.scoring import global_argmax

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    shard = full.chunk(world, dim=-1)[rank]
    out = global_argmax(shard, group=dist.group.WORLD)
    dist.destroy_process_group()
    return out


def test_vocab_parallel_argmax_equals_torch_argmax(tmp_path: Path) -> None:
    full = torch.randn(3, 5, 16)
    full[0, 0, 2] = full[0, 0, 12] = 10.0  # a tie across shards: the lower id wins
    full[1, 1, 9] = full[1, 1, 14] = 10.0  # a tie within the second shard
    for out in mp_workers.spawn(argmax_worker, world=2, out_dir=tmp_path, args=(full,)):
        assert torch.equal(out, full.argmax(dim=-1))
