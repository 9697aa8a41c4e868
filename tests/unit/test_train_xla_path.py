"""The trainer's XLA branches, driven for real against a stand-in torch_xla (tests/fixtures/xla_standin).

The stand-in only records what the trainer asks of torch_xla and when; the model, the step and the collectives
are the real ones (gloo on CPU tensors). Real torch-xla cannot be installed next to this torch (tests/xla runs it
in its own environment), so this is what the main suite checks of the XLA path: the reference's order of calls
(neuron-xla.md 3.3, 4.5), and losses equal to the CPU path's (the XLA branches change when values are computed
and read, never what they are).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import iter_tensors, paths, read_xser

STANDIN = Path(__file__).resolve().parents[1] / "fixtures" / "xla_standin"

# One process trains the runs of argv[1] (a JSON list) one after the other, each with its own settings, and prints a
# line for each (RESULT and JSON): the XLA runs and their CPU references share the process's start-up (torch, the
# trainer), and every run starts from the same state (its seed, a fresh EVENTS list, the patches' counters at zero;
# only a run with poison_after_step gets NaN losses).
SCRIPT = r"""
import json, sys
from pathlib import Path
import torch.distributed as dist
from megatron_hpc.config.schema import (CheckpointConfig, CompilePhaseConfig, ModelConfig, OptimConfig, RunConfig,
                                         TrainConfig)
from megatron_hpc.errors import TrainingError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.plan.mesh import Mesh
from megatron_hpc.train.entry import plan_for_torchrun
from megatron_hpc.train.loop import train
import torch

runs, calls, ce_calls = json.loads(sys.argv[1]), [], []
# break_data: the data breaks at the 4th micro-batch (step 2), as a damaged .bin would
if any(opts.get("break_data") for opts in runs):
    from megatron_hpc.data import synthetic
    from megatron_hpc.errors import DataError
    real = synthetic.SyntheticTokens.batch

    def broken(self, indices):
        calls.append(1)
        if len(calls) == 4:
            raise DataError("sample 7 cannot be read (test)")
        return real(self, indices)

    synthetic.SyntheticTokens.batch = broken
# poison_after_step: every loss from that step on is NaN, as a poisoned batch would make it
if any(opts.get("poison_after_step") for opts in runs):
    import megatron_hpc.train.step as step_module
    real_ce = step_module.vocab_parallel_cross_entropy

    def poisoned(*args, **kwargs):
        ce_calls.append(1)
        loss = real_ce(*args, **kwargs)
        poisoned_now = poison_after_step and len(ce_calls) > 2 * poison_after_step  # 2 micro-batches a step
        return loss * float("nan") if poisoned_now else loss

    step_module.vocab_parallel_cross_entropy = poisoned
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)
for opts in runs:
    kind, dropout, poison_after_step = opts["kind"], opts.get("dropout", 0.0), opts.get("poison_after_step", 0)
    calls.clear(), ce_calls.clear()
    cfg = RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                          max_position_embeddings=32, vocab_size=500, hidden_dropout=dropout,
                          attention_dropout=dropout),
        train=TrainConfig(num_steps=opts.get("num_steps", 6), micro_batch_size=2, global_batch_size=4,
                          log_interval=2, tensorboard=False, max_skipped_steps=opts.get("max_skipped_steps", 5)),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2),
        compile=CompilePhaseConfig(num_steps=2),
        checkpoint=CheckpointConfig(save_interval=opts.get("save_interval", 0)),
    )
    run_dir = Path(opts["run_dir"]) if opts.get("run_dir") else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)  # as run_training does
    device = DeviceInfo(kind=kind, device=torch.device("cpu"), backend="gloo")
    if kind == "xla":
        from torch_xla import EVENTS
        EVENTS.clear()
    error, records = None, []
    try:
        records = train(plan_for_torchrun(cfg, environ={}), ctx, device=device, phase="run", run_dir=run_dir,
                        out=sys.stderr).records
    except TrainingError as exc:
        error = str(exc)
    events = list(EVENTS) if kind == "xla" else []
    print("RESULT", json.dumps({"losses": [r.lm_loss for r in records], "norms": [r.grad_norm for r in records],
                                "iterations": [r.iteration for r in records], "error": error, "events": events}),
          flush=True)
dist.destroy_process_group()
import os
os._exit(0)  # as a finished trainer worker ends (cli/train_cmd.py): torch's C++ teardown may abort under load
"""


def _run(*runs: dict) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")])}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "XLA_USE_BF16"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(runs)], capture_output=True, text=True, env=env,
                          timeout=300)


def _train(*runs: dict) -> list[dict]:
    """Each run's summary, in order; a run is {"kind": "xla" or "cpu", **options}."""
    proc = _run(*runs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line.removeprefix("RESULT ") for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(runs), proc.stdout[-3000:]
    return [json.loads(line) for line in results]


NON_FINITE = {"poison_after_step": 2, "max_skipped_steps": 3, "save_interval": 2, "num_steps": 8}
RNG = {"num_steps": 4, "save_interval": 4, "dropout": 0.1}


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], Path]:
    """The runs of three tests below, trained in one process (one start-up of torch and the trainer instead of
    three), each test's pair in its own order: ({name: summary}, the folder of their run folders). The poisoned XLA
    run goes last: it stops with a step closure still pending, which the next run's first cut would run."""
    root = tmp_path_factory.mktemp("xla-path")
    runs = {"xla": {"kind": "xla"}, "cpu": {"kind": "cpu"},
            "rng_xla": {"kind": "xla", "run_dir": str(root / "rng"), **RNG},
            "rng_cpu": {"kind": "cpu", "run_dir": str(root / "rng" / "cpu"), "num_steps": 2, "save_interval": 2},
            "nan_cpu": {"kind": "cpu", "run_dir": str(root / "nan" / "cpu"), **NON_FINITE},
            "nan_xla": {"kind": "xla", "run_dir": str(root / "nan" / "xla"), **NON_FINITE}}
    return dict(zip(runs, _train(*runs.values()))), root


def _checkpoint(run_dir: Path, iteration: int) -> dict:
    main = paths.main_file(paths.iteration_dir(run_dir / "checkpoints", iteration), 0)
    return read_xser(main)


def test_xla_branches_follow_the_reference_and_train_the_same_model(shared_runs: tuple[dict[str, dict], Path]) -> None:
    xla, cpu = shared_runs[0]["xla"], shared_runs[0]["cpu"]
    assert xla["iterations"] == cpu["iterations"] == [2, 4, 6]
    assert xla["losses"] == cpu["losses"] and xla["norms"] == cpu["norms"]
    # Only torch-xla 2.9's current API: torch_xla.sync, not the deprecated xm.mark_step (the stand-in has none).
    # Seeded with train.seed (torch.manual_seed does not reach torch_xla's generator). Per step: the batch
    # arrives through MpDeviceLoader, a graph cut after backward and one at the step end; from the second step
    # on, a step closure reads the previous step's finite flag (the skip check, one step late, after the cut);
    # on log steps the host reads the interval's sums and the ranks' step timing (train/stragglers.py) in step
    # closures too. Nothing else reaches torch_xla (no mid-step syncs through it).
    first = ["device_batch", "sync", "sync"]
    step = ["device_batch", "sync", "add_step_closure", "sync", "closure"]
    logged = ["device_batch", "sync", *["add_step_closure"] * 3, "sync", *["closure"] * 3]
    assert xla["events"] == ["set_rng_state 1234", *first, *logged, *(step + logged) * 2]


def test_a_data_error_in_the_loader_thread_fails_the_run() -> None:
    """torch_xla's loader thread prints an exception and ends the iteration; the run must not look finished."""
    proc = _run({"kind": "xla", "break_data": True})
    assert proc.returncode != 0
    assert "DataError: sample 7 cannot be read (test)" in proc.stderr
    assert not proc.stdout.strip()  # train() never returned a summary


def test_non_finite_steps_change_nothing_and_stop_the_run_as_on_cpu(shared_runs: tuple[dict[str, dict], Path]) -> None:
    """Every loss from step 3 on is NaN. On XLA the update runs in the graph and a select keeps the old values,
    and the host counts the skip one step late: same checkpoints, same count of applied steps, same error."""
    (cpu, xla), tmp_path = (shared_runs[0][name] for name in ("nan_cpu", "nan_xla")), shared_runs[1] / "nan"
    assert cpu["error"] is not None and "not finite for 3 steps in a row (iterations 3-5," in cpu["error"]
    assert xla["error"] == cpu["error"]
    # Stopped when step 5's flag was read: in the closure after step 6's last cut, before step 6's log closure.
    assert xla["events"][-4:] == ["add_step_closure", "add_step_closure", "sync", "closure"]
    for run in ("cpu", "xla"):
        before, after = _checkpoint(tmp_path / run, 2), _checkpoint(tmp_path / run, 4)
        assert after["lr_scheduler"]["successful_steps"] == 2
        tensors = dict(iter_tensors({"model": after["model"], "optimizer": after["optimizer"]}))
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values())
        old = dict(iter_tensors({"model": before["model"], "optimizer": before["optimizer"]}))
        # Weights, Adam moments and Adam's step count as after step 2: steps 3 and 4 were no-ops.
        assert old.keys() == tensors.keys()
        assert [k for k in old if not torch.equal(old[k], tensors[k])] == [], run


def test_the_xla_rng_state_is_saved_and_restored(shared_runs: tuple[dict[str, dict], Path]) -> None:
    """torch_xla's generator draws the dropout masks on XLA: its state goes into the checkpoint
    (xla_rng_state, beside Megatron's cuda_rng_state) and comes back on resume."""
    first, tmp_path = shared_runs[0]["rng_xla"], shared_runs[1] / "rng"
    saved = _checkpoint(tmp_path, 4)
    seed = saved["xla_rng_state"]
    assert first["events"].count("get_rng_state") == 1  # read once, for the one save
    assert isinstance(seed, list) and len(seed) == 1 and seed[0] != 1234  # the running seed at iteration 4
    assert saved["rng_state"][0]["xla_rng_state"] == seed
    # A fresh process: restored from the checkpoint, not carried over from the run that saved it.
    (resumed,) = _train({"kind": "xla", "run_dir": str(tmp_path), **RNG, "num_steps": 6})
    assert resumed["events"][:2] == ["set_rng_state 1234", f"set_rng_state {seed[0]}"]  # seeded, then restored
    assert _checkpoint(tmp_path / "cpu", 2)["xla_rng_state"] is None
