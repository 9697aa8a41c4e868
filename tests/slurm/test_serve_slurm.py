"""slurm/serve.sh on the real local SLURM cluster: the job serves Megatron's `PUT /api` from a checkpoint, its log
names the URL, and `scancel` stops the server cleanly."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.error import URLError

import pytest

from megatron_hpc.generate.client import put_api
from megatron_hpc.plan.jobs import MASTER_PORT_BASE

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "preprocess"
TOKENIZER = ["--vocab-file", str(FIXTURE / "vocab.json"), "--merge-file", str(FIXTURE / "merges.txt")]
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.max_position_embeddings=32", "model.vocab_size=400", "model.make_vocab_size_divisible_by=64",
         "data.source=synthetic", "train.num_steps=1", "train.micro_batch_size=2", "train.global_batch_size=2",
         "train.tensorboard=false"]


SERVE_PORTS = range(MASTER_PORT_BASE - 2000, MASTER_PORT_BASE)
"""Where the serve port is drawn. serve.sh binds it a queue wait and an import later (tens of seconds on a loaded
machine), so the port must be one nothing else on the machine draws meanwhile: not the kernel's ephemeral range (the
suite's gloo listeners, torchrun --standalone stores), not the master ports node.sh derives from a job id or a pid
([MASTER_PORT_BASE, + MASTER_PORT_SPAN): the SLURM jobs, every tier's local runs), not the ports the multiprocess
tier's spawns draw at random (mp_workers.free_ports: the 12000 below the ephemeral range, which reach down into the
derived ones), and above the local cluster's slurmd ports (17001-17099) and the store port torch_xla takes
without MASTER_PORT (12355: the xla tier's xla:// runs)."""


def _free_port() -> int:
    """A port of SERVE_PORTS free now."""
    rng = random.Random()
    while True:
        port = rng.randrange(SERVE_PORTS.start, SERVE_PORTS.stop)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


def test_serve_template_serves_and_stops_on_scancel(slurm_cluster, sacct_job, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "megatron_hpc", "train", "--recipe", "tiny"]
    for item in [*MODEL, f"checkpoint.save={ckpt}"]:
        args += ["--set", item]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    trained = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert trained.returncode == 0, trained.stderr[-2000:]
    port = _free_port()
    log = tmp_path / "serve.out"
    sub = subprocess.run(["sbatch", "--parsable", "--partition", slurm_cluster.partition, "--output", str(log),
                          str(REPO / "slurm" / "serve.sh"), str(ckpt), str(port), "--host", "127.0.0.1", *TOKENIZER],
                         capture_output=True, text=True, env={**env, "PYTHON": sys.executable}, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while True:
        try:
            status, out = put_api(f"http://127.0.0.1:{port}/api",
                                  {"prompts": ["fox"], "tokens_to_generate": 3, "top_k": 1})
            break
        except URLError:
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no job log"
            time.sleep(1)
    assert status == 200, out
    assert out["text"][0].startswith("fox") and len(out["tokens"][0]) == len(out["segments"][0])
    first = log.read_text().splitlines()[0]
    assert re.search(rf"job {job} on \S+, PUT http://\S+:{port}/api \(TP 1\)", first), first
    subprocess.run(["scancel", job], check=True, timeout=30)
    record = sacct_job(job, timeout=60, final=True)
    assert record["State"].startswith("CANCELLED"), record
    deadline = time.monotonic() + 30
    while "megatron-hpc serve: stopping" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)

