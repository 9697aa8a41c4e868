"""The trainer on real torch-xla (XLA:CPU, one process): marker `xla`, deselected in CI, never counted as passed.

torch-xla 2.9 needs its own torch 2.9, so it lives in a separate environment, not beside this project's torch:

    python3 -m venv /tmp/xla-venv
    /tmp/xla-venv/bin/pip install torch==2.9.0 torch-xla==2.9.0 pytest numpy pyyaml submitit filelock \
        tensorboard matplotlib tokenizers
    PYTHONPATH=$PWD PJRT_DEVICE=CPU /tmp/xla-venv/bin/python -m pytest -m xla tests/xla -p no:cacheprovider

XLA:CPU has no multi-process collectives (shared/reference/neuron-xla.md 5), so this is one worker through the
real `xla://` init, MpDeviceLoader, mark_step and step closures, against the CPU path of the same environment;
tests/unit/test_train_xla_path.py checks the call order in CI with a stand-in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xla

TRAIN = r"""
import json, sys
from pathlib import Path
from megatron_hpc.config.schema import (CheckpointConfig, CompilePhaseConfig, LaunchConfig, ModelConfig,
                                         OptimConfig, RunConfig, TrainConfig)
from megatron_hpc.train.entry import plan_for_torchrun, run_training
platform, run_dir, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
cfg = RunConfig(
    name="tiny",
    model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=32, vocab_size=500),
    train=TrainConfig(num_steps=steps, micro_batch_size=2, global_batch_size=4, log_interval=2),
    optim=OptimConfig(lr=3e-3, lr_warmup_iters=0, lr_decay_style="constant"),
    compile=CompilePhaseConfig(num_steps=2),
    launch=LaunchConfig(platform=platform),
    checkpoint=CheckpointConfig(save_interval=4),
)
assert run_training(plan_for_torchrun(cfg), run_dir=run_dir) == 0
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
print(json.dumps([[r["iteration"], r["lm_loss"]] for r in rows]))
"""


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        pytest.fail("the xla tests need a real torch-xla; run them in its own environment (see this module)")
    out = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "XLA_USE_BF16")}
    out["PJRT_DEVICE"] = "CPU"
    out["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), out.get("PYTHONPATH", "")])
    return out


def _train(env: dict[str, str], platform: str, run_dir: Path, steps: int) -> list[list[float]]:
    proc = subprocess.run([sys.executable, "-c", TRAIN, platform, str(run_dir), str(steps)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_xla_trains_the_cpu_model_and_resumes_exactly(env: dict[str, str], tmp_path: Path) -> None:
    cpu = _train(env, "cpu", tmp_path / "cpu", 8)
    xla = _train(env, "trn1", tmp_path / "xla", 8)  # trn1's backend is xla
    assert [i for i, _ in xla] == [i for i, _ in cpu] == [2, 4, 6, 8]
    assert [loss for _, loss in xla] == pytest.approx([loss for _, loss in cpu], rel=1e-5)
    resumed = _train(env, "trn1", tmp_path / "xla", 12)  # loads iter_0000008, trains 9..12
    straight = _train(env, "trn1", tmp_path / "straight", 12)
    assert resumed[-2:] == straight[-2:]


def test_real_xser_reads_ours_and_we_read_real_xser(env: dict[str, str], tmp_path: Path) -> None:
    _train(env, "trn1", tmp_path / "run", 4)
    check = r"""
import sys, torch
from pathlib import Path
import torch_xla.core.xla_model as xm
import torch_xla.utils.serialization as xser
from megatron_hpc.checkpoint.xser import iter_tensors, read_xser
ours = Path(sys.argv[1]) / "run/checkpoints/iter_0000004/mp_rank_00/model_optim_rng.pt"
real, mine = dict(iter_tensors(xser.load(str(ours)))), dict(iter_tensors(read_xser(ours)))
assert real.keys() == mine.keys() and all(torch.equal(real[k].cpu(), mine[k]) for k in real)
dev = xm.xla_device()
state = {"model": {"w": torch.arange(6.0, device=dev).view(2, 3)}, "rng": torch.get_rng_state(),
         "pair": (torch.zeros(2, device=dev), 7), "iteration": 3}
theirs = Path(sys.argv[1]) / "theirs.pt"
xser.save(state, str(theirs), master_only=False)
back = read_xser(theirs)
assert torch.equal(back["model"]["w"], torch.arange(6.0).view(2, 3))
assert torch.equal(back["pair"][0], torch.zeros(2)) and back["pair"][1] == 7
assert torch.equal(back["rng"], state["rng"]) and back["iteration"] == 3
print(len(real))
"""
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) > 50  # weights, Adam moments, RNG states
