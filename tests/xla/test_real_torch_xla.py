"""The trainer on real torch-xla (XLA:CPU, one process): marker `xla`, never counted as passed elsewhere.

torch-xla 2.9 needs its own torch 2.9, so this tier runs in its own environment, which `bash tests/run.sh` (the
README's test command, and CI's) builds, caches and runs after the main suite. By hand:

    bash tests/xla/run.sh            # builds or reuses the environment (tests/xla/env.sh), then runs this tier

XLA:CPU has no multi-process collectives (shared/reference/neuron-xla.md 5), so this is one worker through the
real `xla://` init, MpDeviceLoader, torch_xla.sync and step closures, against the CPU path of the same environment;
tests/unit/test_train_xla_path.py checks the call order in CI with a stand-in.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.xla

TRAIN = r"""
import json, sys, warnings
# torch-xla 2.9's deprecated calls (xm.mark_step, xm.xla_device: "Use torch_xla.sync instead") fail the run.
warnings.filterwarnings("error", message="Use torch_xla", category=DeprecationWarning, module="megatron_hpc")
from pathlib import Path
from megatron_hpc.config.schema import (CheckpointConfig, CompilePhaseConfig, DataConfig, LaunchConfig,
                                         ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig)
from megatron_hpc.errors import TrainingError
from megatron_hpc.train.entry import plan_for_torchrun, run_training
platform, run_dir, steps, opts = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
if opts.get("poison_after_step"):  # every loss from that step on is NaN, as a poisoned batch would make it
    import megatron_hpc.train.step as step_module
    real, calls = step_module.vocab_parallel_cross_entropy, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) > 2 * opts["poison_after_step"] else loss  # 2 micro-batches

    step_module.vocab_parallel_cross_entropy = poisoned
dropout = opts.get("dropout", 0.0)
cfg = RunConfig(
    name="tiny",
    model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                      max_position_embeddings=32, vocab_size=500, hidden_dropout=dropout, attention_dropout=dropout),
    train=TrainConfig(num_steps=steps, micro_batch_size=2, global_batch_size=4, log_interval=2,
                      precision=opts.get("precision", "fp32"), max_skipped_steps=opts.get("max_skipped_steps", 5)),
    optim=OptimConfig(lr=opts.get("lr", 3e-3), lr_warmup_iters=0, lr_decay_style="constant"),
    parallel=ParallelConfig(distributed_optimizer=opts.get("distributed_optimizer", False)),
    compile=CompilePhaseConfig(num_steps=2),
    launch=LaunchConfig(platform=platform),
    data=DataConfig(source="synthetic"),
    checkpoint=CheckpointConfig(save_interval=opts.get("save_interval", 4)),
)
try:
    assert run_training(plan_for_torchrun(cfg), run_dir=run_dir) == 0
    error = None
except TrainingError as exc:
    error = str(exc)
rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
print(json.dumps({"losses": [[r["iteration"], r["lm_loss"]] for r in rows], "error": error}))
"""

def _train(env: dict[str, str], platform: str, run_dir: Path, steps: int, **opts: Any) -> dict[str, Any]:
    """Train in a fresh process; its losses (logged every 2 steps), TrainingError message, stdout and stderr."""
    proc = subprocess.run([sys.executable, "-c", TRAIN, platform, str(run_dir), str(steps), json.dumps(opts)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stdout": proc.stdout, "stderr": proc.stderr}


def _read(run_dir: Path, iteration: int) -> dict[str, Any]:
    """A checkpoint's precision record, XLA RNG state and tensors (model and optimizer), as plain values."""
    import torch

    from megatron_hpc.checkpoint import paths
    from megatron_hpc.checkpoint.xser import iter_tensors, read_xser

    state = read_xser(paths.main_file(paths.iteration_dir(run_dir / "checkpoints", iteration), 0))
    out: dict[str, Any] = {"precision": state.get("precision"), "xla_rng_state": state.get("xla_rng_state"),
                           "tensors": {}}
    for name, t in iter_tensors({"model": state["model"], "optimizer": state["optimizer"]}):
        dtype, t = str(t.dtype).removeprefix("torch."), t.float()
        out["tensors"][name] = {"values": t.flatten().tolist(), "finite": bool(torch.isfinite(t).all()),
                                "bf16_exact": bool(torch.equal(t, t.bfloat16().float())), "dtype": dtype,
                                "ndim": t.dim()}
    return out


def _banner(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("> megatron-hpc run:"))


def test_fp32_on_xla_trains_the_cpu_model_even_with_xla_use_bf16_set(env: dict[str, str], tmp_path: Path) -> None:
    """train.precision fp32 is the truth: XLA_USE_BF16=1 left in the environment is cleared, with a warning."""
    cpu = _train(env, "cpu", tmp_path / "cpu", 8)
    xla = _train({**env, "XLA_USE_BF16": "1"}, "trn1", tmp_path / "xla", 8)  # trn1's backend is xla
    assert [i for i, _ in xla["losses"]] == [i for i, _ in cpu["losses"]] == [2, 4, 6, 8]
    # In bf16 the losses would differ from the CPU's in the third digit.
    assert [loss for _, loss in xla["losses"]] == pytest.approx([loss for _, loss in cpu["losses"]], rel=1e-5)
    assert "| xla fp32 |" in _banner(xla["stdout"])
    assert "megatron-hpc: warning: XLA_USE_BF16=1 ignored: train.precision is fp32" in xla["stderr"]
    saved = _read(tmp_path / "xla", 8)
    assert saved["precision"] == {"train_precision": "fp32", "weights_hold": "float32"}
    weights = [v for k, v in saved["tensors"].items() if k.startswith("model.") and k.endswith("weight")]
    assert not all(w["bf16_exact"] for w in weights)  # fp32 values, not bf16 ones stored as float32


@pytest.fixture(scope="module")
def bf16_dropout_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """8 uninterrupted steps in bf16 with dropout, saved at 4 and 8 (at the LR of MASTERS, which compares with it)."""
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, _train(env, "trn1", run_dir, 8, precision="bf16", dropout=0.1, lr=MASTERS["lr"])


def test_bf16_with_dropout_resumes_exactly(env: dict[str, str], tmp_path: Path,
                                           bf16_dropout_run: tuple[Path, dict[str, Any]]) -> None:
    """torch_xla's RNG draws the dropout masks: the checkpoint keeps it (xla_rng_state) and a resume restores it."""
    from megatron_hpc.checkpoint import paths

    straight_dir, straight = bf16_dropout_run
    # The run as if it had stopped after its save at iteration 4.
    shutil.copytree(straight_dir / "checkpoints", tmp_path / "checkpoints")
    shutil.rmtree(paths.iteration_dir(tmp_path / "checkpoints", 8))
    paths.tracker_file(tmp_path / "checkpoints").write_text("4")
    resumed = _train(env, "trn1", tmp_path, 8, precision="bf16", dropout=0.1, lr=MASTERS["lr"])  # iter 4, runs 5..8
    assert "loaded checkpoint" in resumed["stdout"] and "at iteration 4" in resumed["stdout"]
    assert [i for i, _ in resumed["losses"]] == [6, 8]
    assert resumed["losses"] == straight["losses"][-2:]  # exactly
    # bf16 losses hide small differences: the weights and Adam state after step 8 must be the same bits too.
    theirs, ours = _read(straight_dir, 8)["tensors"], _read(tmp_path, 8)["tensors"]
    assert theirs.keys() == ours.keys()
    assert [k for k in theirs if theirs[k]["values"] != ours[k]["values"]] == []
    # The setting decides, with nothing in the environment: pure bf16 (XLA_USE_BF16 set by the trainer).
    assert "| xla bf16 (pure:" in _banner(straight["stdout"])
    saved = _read(straight_dir, 8)
    assert saved["precision"] == {"train_precision": "bf16", "weights_hold": "bfloat16"}
    assert all(t["bf16_exact"] for k, t in saved["tensors"].items() if k.startswith("model."))
    assert isinstance(saved["xla_rng_state"], list) and len(saved["xla_rng_state"]) == 1


def test_non_finite_steps_are_not_applied_and_stop_the_run_as_on_cpu(env: dict[str, str], tmp_path: Path) -> None:
    """Every loss from step 3 on is NaN: steps 3.. change nothing, and the third in a row ends the run."""
    opts = {"poison_after_step": 2, "max_skipped_steps": 3, "save_interval": 2}
    cpu = _train(env, "cpu", tmp_path / "cpu", 8, **opts)
    xla = _train(env, "trn1", tmp_path / "xla", 8, **opts)
    assert cpu["error"] is not None and "not finite for 3 steps in a row (iterations 3-5" in cpu["error"]
    assert xla["error"] == cpu["error"]
    assert [i for i, _ in xla["losses"]] == [2, 4] and xla["losses"][0][1] == pytest.approx(cpu["losses"][0][1])
    before, after = _read(tmp_path / "xla", 2), _read(tmp_path / "xla", 4)
    assert all(t["finite"] for t in after["tensors"].values())
    # Weights, Adam moments and Adam's step count all as they were after step 2: steps 3 and 4 were no-ops.
    assert after["tensors"].keys() == before["tensors"].keys()
    changed = [k for k in before["tensors"] if after["tensors"][k]["values"] != before["tensors"][k]["values"]]
    assert changed == []


def test_real_xser_reads_ours_and_we_read_real_xser(env: dict[str, str], tmp_path: Path,
                                                     bf16_dropout_run: tuple[Path, dict[str, Any]]) -> None:
    check = r"""
import sys, torch
import torch_xla
from pathlib import Path
import torch_xla.utils.serialization as xser
from megatron_hpc.checkpoint.xser import iter_tensors, read_xser
ours = Path(sys.argv[1]) / "checkpoints/iter_0000004/mp_rank_00/model_optim_rng.pt"
real, mine = dict(iter_tensors(xser.load(str(ours)))), dict(iter_tensors(read_xser(ours)))
assert real.keys() == mine.keys() and all(torch.equal(real[k].cpu(), mine[k]) for k in real)
dev = torch_xla.device()
state = {"model": {"w": torch.arange(6.0, device=dev).view(2, 3)}, "rng": torch.get_rng_state(),
         "pair": (torch.zeros(2, device=dev), 7), "iteration": 3}
theirs = Path(sys.argv[2]) / "theirs.pt"
xser.save(state, str(theirs), master_only=False)
back = read_xser(theirs)
assert torch.equal(back["model"]["w"], torch.arange(6.0).view(2, 3))
assert torch.equal(back["pair"][0], torch.zeros(2)) and back["pair"][1] == 7
assert torch.equal(back["rng"], state["rng"]) and back["iteration"] == 3
print(len(real))
"""
    proc = subprocess.run([sys.executable, "-c", check, str(bf16_dropout_run[0]), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) > 50  # weights, Adam moments, RNG states


# fp32 master weights (parallel.distributed_optimizer on XLA: torch_xla's ZeRO-1, train/xla_zero.py). At lr 5e-4 an
# Adam step moves a LayerNorm weight (1.0) by about 5e-4, under half of bf16's spacing there (2**-8 below 1.0): pure
# bf16 rounds every such update away, fp32 masters keep them. Dropout as in bf16_dropout_run, the pure bf16 run it is
# compared with.
MASTERS = {"precision": "bf16", "distributed_optimizer": True, "lr": 5e-4, "save_interval": 2, "dropout": 0.1}


@pytest.fixture(scope="module")
def masters_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """4 uninterrupted steps with bf16 weights and fp32 masters, saved at 2 and 4."""
    run_dir = tmp_path_factory.mktemp("masters")
    return run_dir, _train(env, "trn1", run_dir, 4, **MASTERS)


def _layernorm_weights(tensors: dict[str, Any]) -> list[str]:
    return [k for k in tensors if k.startswith("model.") and ".ln_" in k and k.endswith(".weight")]


def test_bf16_weights_with_fp32_masters_keep_updates_pure_bf16_loses(
        masters_run: tuple[Path, dict[str, Any]], bf16_dropout_run: tuple[Path, dict[str, Any]]) -> None:
    import torch

    run_dir, run = masters_run
    assert "| xla bf16 (bf16 weights, fp32 master weights and Adam state) |" in _banner(run["stdout"])
    losses = [loss for _, loss in run["losses"]]
    assert len(losses) == 2 and losses[-1] < losses[0]  # it trains
    saved = _read(run_dir, 4)
    assert saved["precision"] == {"train_precision": "bf16", "weights_hold": "bfloat16"}
    tensors = saved["tensors"]
    model = {k: t for k, t in tensors.items() if k.startswith("model.")}
    assert {t["dtype"] for t in model.values()} == {"bfloat16"}  # the weights on the device, as saved
    # The optimizer's state is in its own order (matrices, then 1-D tensors), the plain AdamW layout plus masters.
    order = [k for k in model if model[k]["ndim"] >= 2] + [k for k in model if model[k]["ndim"] < 2]
    state = [{key: tensors[f"optimizer.state.{i}.{key}"] for key in ("main_param", "exp_avg", "exp_avg_sq")}
             for i in range(len(order))]
    assert {t["dtype"] for entry in state for t in entry.values()} == {"float32"}
    for name, entry in zip(order, state):
        master = entry["main_param"]
        # The weight is its master rounded to bf16; the master holds what bf16 cannot.
        assert torch.tensor(master["values"]).bfloat16().float().tolist() == model[name]["values"], name
        assert not master["bf16_exact"], name
    # The LayerNorm weights start at 1.0. After 4 steps with masters every one has left 1.0 in its master, and some
    # have moved in bf16 too (updates below bf16's resolution, accumulated); pure bf16 leaves every one at 1.0.
    norms = [(name, entry["main_param"]) for name, entry in zip(order, state) if name in _layernorm_weights(model)]
    assert len(norms) == 5 and all(v != 1.0 for _, m in norms for v in m["values"])
    assert any(v != 1.0 for name, _ in norms for v in model[name]["values"])
    pure = _read(bf16_dropout_run[0], 4)["tensors"]
    assert len(_layernorm_weights(pure)) == 5
    assert all(v == 1.0 for name in _layernorm_weights(pure) for v in pure[name]["values"])


def test_fp32_masters_resume_exactly(env: dict[str, str], tmp_path: Path,
                                     masters_run: tuple[Path, dict[str, Any]]) -> None:
    """The checkpoint keeps the masters (main_param) beside the moments: a resume from iteration 2 is the same run."""
    from megatron_hpc.checkpoint import paths

    straight_dir, straight = masters_run
    shutil.copytree(straight_dir / "checkpoints", tmp_path / "checkpoints")
    shutil.rmtree(paths.iteration_dir(tmp_path / "checkpoints", 4))
    paths.tracker_file(tmp_path / "checkpoints").write_text("2")
    resumed = _train(env, "trn1", tmp_path, 4, **MASTERS)
    assert "at iteration 2" in resumed["stdout"]
    assert resumed["losses"] == straight["losses"][-1:]  # exactly
    theirs, ours = _read(straight_dir, 4)["tensors"], _read(tmp_path, 4)["tensors"]
    assert theirs.keys() == ours.keys() and any(k.endswith(".main_param") for k in ours)
    assert [k for k in theirs if theirs[k]["values"] != ours[k]["values"]] == []
