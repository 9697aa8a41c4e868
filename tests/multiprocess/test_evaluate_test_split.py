"""The test split evaluated at the end of a TP=2 torchrun training run (two real gloo processes) equals
`megatron-hpc evaluate --split test` on its checkpoint, merged to TP 1 in one process: same samples, same loss."""

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

from megatron_hpc.data.indexed import IndexedDatasetWriter

pytestmark = pytest.mark.multiprocess

MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.max_position_embeddings=32", "model.vocab_size=400", "model.make_vocab_size_divisible_by=64",
         "model.init_method_std=0.2"]


def test_end_of_training_test_loss_equals_evaluate(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    with IndexedDatasetWriter(str(tmp_path / "corpus"), dtype=np.uint16) as writer:
        for _ in range(150):
            writer.add_document(rng.integers(0, 400, size=int(rng.integers(10, 80))))
    sets = [*MODEL, "data.source=indexed", f"data.path={tmp_path / 'corpus'}", "data.split=80,10,10",
            f"data.cache_path={tmp_path / 'cache'}", "parallel.tensor=2", "train.num_steps=3",
            "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_iters=2",
            "train.tensorboard=false", f"checkpoint.save={tmp_path / 'ckpt'}"]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
            str(mp_workers.free_ports(1)[0]), "-m", "megatron_hpc", "train", "--recipe", "tiny"]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    found = re.findall(r" validation loss at iteration 3 on test set \| lm loss value: (\S+) \|", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]  # printed once, by the last rank

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    ev = subprocess.run([sys.executable, "-m", "megatron_hpc", "evaluate", str(tmp_path / "ckpt"), "--split",
                         "test", "--json"], capture_output=True, text=True, env=env)
    assert ev.returncode == 0, ev.stderr
    report = json.loads(ev.stdout)
    assert report["tensor_parallel"] == 2 and report["splits"]["test"]["samples"] == 2 * 4
    assert report["splits"]["test"]["loss"] == pytest.approx(float(found[0]), rel=2e-6)
