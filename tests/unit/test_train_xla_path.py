"""The trainer's XLA branches, driven for real against a stand-in torch_xla (tests/fixtures/xla_standin).

The stand-in only records what the trainer asks of torch_xla and when; the model, the step and the collectives
are the real ones (gloo on CPU tensors). Real torch-xla cannot be installed next to this torch, so this is what
CI can check of the XLA path: the reference's order of calls (neuron-xla.md 3.3, 4.5), and losses equal to the
CPU path's (the XLA branches change when values are computed and read, never what they are).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

STANDIN = Path(__file__).resolve().parents[1] / "fixtures" / "xla_standin"

SCRIPT = r"""
import json, sys
import torch.distributed as dist
from megatron_hpc.config.schema import CompilePhaseConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.entry import plan_for_torchrun
from megatron_hpc.train.loop import train
import torch

kind = sys.argv[1]
if len(sys.argv) > 2:  # the data breaks at the 4th micro-batch (step 2), as a damaged .bin would
    from megatron_hpc.data import synthetic
    from megatron_hpc.errors import DataError
    real, calls = synthetic.SyntheticTokens.batch, []

    def broken(self, indices):
        calls.append(1)
        if len(calls) == 4:
            raise DataError("sample 7 cannot be read (test)")
        return real(self, indices)

    synthetic.SyntheticTokens.batch = broken
cfg = RunConfig(
    name="tiny",
    model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=32, vocab_size=500),
    train=TrainConfig(num_steps=6, micro_batch_size=2, global_batch_size=4, log_interval=2, tensorboard=False),
    optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2),
    compile=CompilePhaseConfig(num_steps=2),
)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)
device = DeviceInfo(kind=kind, device=torch.device("cpu"), backend="gloo")
summary = train(plan_for_torchrun(cfg, environ={}), ctx, device=device, phase="run", run_dir=None, out=sys.stderr)
events = []
if kind == "xla":
    from torch_xla import EVENTS
    events = EVENTS
print(json.dumps({"losses": [r.lm_loss for r in summary.records], "norms": [r.grad_norm for r in summary.records],
                  "iterations": [r.iteration for r in summary.records], "events": events}))
"""


def _run(kind: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")])}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "XLA_USE_BF16"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-c", SCRIPT, kind, *extra], capture_output=True, text=True, env=env,
                          timeout=300)


def _train(kind: str) -> dict:
    proc = _run(kind)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_xla_branches_follow_the_reference_and_train_the_same_model() -> None:
    xla, cpu = _train("xla"), _train("cpu")
    assert xla["iterations"] == cpu["iterations"] == [2, 4, 6]
    assert xla["losses"] == cpu["losses"] and xla["norms"] == cpu["norms"]
    events = xla["events"]
    # Per step: the batch arrives through MpDeviceLoader, a graph cut after backward and one at the step end;
    # on log steps the host reads happen in a step closure, after the step's last cut. Nothing else reaches
    # torch_xla (no mid-step syncs through it).
    step = ["device_batch", "mark_step", "mark_step"]
    logged = ["device_batch", "mark_step", "add_step_closure", "mark_step", "closure"]
    assert events == (step + logged) * 3


def test_a_data_error_in_the_loader_thread_fails_the_run() -> None:
    """torch_xla's loader thread prints an exception and ends the iteration; the run must not look finished."""
    proc = _run("xla", "break-data")
    assert proc.returncode != 0
    assert "DataError: sample 7 cannot be read (test)" in proc.stderr
    assert not proc.stdout.strip()  # train() never returned a summary
