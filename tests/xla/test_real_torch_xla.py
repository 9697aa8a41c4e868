"""The trainer on real torch-xla (XLA:CPU, one process): marker `xla`, never counted as passed elsewhere.

torch-xla 2.9 needs its own torch 2.9, so this tier runs in its own environment, which `bash tests/run.sh` (the
README's test command, and CI's) builds, caches and runs after the main suite. By hand:

    bash tests/xla/run.sh            # builds or reuses the environment (tests/xla/env.sh), then runs this tier

XLA:CPU has no multi-process collectives (shared/reference/neuron-xla.md 5), so this is one worker through the
real `xla://` init, MpDeviceLoader, torch_xla.sync and step closures, against the CPU path of the same environment;
tests/unit/test_train_xla_path.py checks the call order in CI with a stand-in.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.xla

# Trains the runs of argv[1] (a JSON list of {"platform", "run_dir", "steps", **options}) one after the other in one
# process and prints a line for each (RESULT and JSON). Most tests train one run per process; an XLA run and its CPU
# reference share one (XLA's first: a CPU backward before the XLA device exists leaves autograd's engine without a
# queue for it), which saves the CPU run's start-up (torch, the trainer): about 8 CPU seconds each.
TRAIN = r"""
import dataclasses, json, sys, warnings
# torch-xla 2.9's deprecated calls (xm.mark_step, xm.xla_device: "Use torch_xla.sync instead") fail the run.
warnings.filterwarnings("error", message="Use torch_xla", category=DeprecationWarning, module="megatron_hpc")
from pathlib import Path
from megatron_hpc.config.schema import (CheckpointConfig, CompilePhaseConfig, DataConfig, LaunchConfig,
                                         ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig)
from megatron_hpc.errors import TrainingError
from megatron_hpc.train.entry import plan_for_torchrun, run_training
runs, calls = json.loads(sys.argv[1]), []
# llama: a tiny Qwen-style Llama (RMSNorm, SwiGLU, 4 heads sharing 2 key/value groups, QKV bias and no other, untied,
# Llama 3.1 RoPE scaling), the model of tests/multiprocess/mp_workers.py's llama(qkv_bias=True)
LLAMA = dict(normalization="rmsnorm", swiglu=True, num_query_groups=2, add_bias_linear=False, add_qkv_bias=True,
             tie_embeddings=False, position_embedding="rope", rope_scaling="llama3", ffn_hidden_size=128)
# poison_after_step: every loss from that step on is NaN, as a poisoned batch would make it (the run's own opts)
if any(opts.get("poison_after_step") for opts in runs):
    import megatron_hpc.train.step as step_module
    real = step_module.vocab_parallel_cross_entropy

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) > 2 * opts["poison_after_step"] else loss  # 2 micro-batches

    step_module.vocab_parallel_cross_entropy = poisoned
for opts in runs:
    calls.clear()
    dropout, run_dir = opts.get("dropout", 0.0), Path(opts["run_dir"])
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                        max_position_embeddings=32, vocab_size=500, hidden_dropout=dropout, attention_dropout=dropout)
    cfg = RunConfig(
        name="tiny",
        model=dataclasses.replace(model, **LLAMA) if opts.get("llama") else model,
        train=TrainConfig(num_steps=opts["steps"], micro_batch_size=2, global_batch_size=4, log_interval=2,
                          precision=opts.get("precision", "fp32"),
                          max_skipped_steps=opts.get("max_skipped_steps", 5)),
        optim=OptimConfig(lr=opts.get("lr", 3e-3), lr_warmup_iters=0, lr_decay_style="constant"),
        parallel=ParallelConfig(distributed_optimizer=opts.get("distributed_optimizer", False)),
        compile=CompilePhaseConfig(num_steps=2),
        launch=LaunchConfig(platform=opts["platform"]),
        data=DataConfig(source="synthetic"),
        checkpoint=CheckpointConfig(save_interval=opts.get("save_interval", 4), load=opts.get("load")),
    )
    try:
        assert run_training(plan_for_torchrun(cfg), run_dir=run_dir) == 0
        error = None
    except TrainingError as exc:
        error = str(exc)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print("RESULT", json.dumps({"losses": [[r["iteration"], r["lm_loss"]] for r in rows], "error": error}),
          flush=True)
"""


def _train_all(env: dict[str, str], *runs: dict[str, Any]) -> list[dict[str, Any]]:
    """Train `runs` in order in one fresh process: each one's losses (logged every 2 steps) and TrainingError
    message, with the process's stdout and stderr."""
    proc = subprocess.run([sys.executable, "-c", TRAIN, json.dumps(runs)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [line.removeprefix("RESULT ") for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(runs), proc.stdout[-3000:]
    return [{**json.loads(line), "stdout": proc.stdout, "stderr": proc.stderr} for line in results]


def _train(env: dict[str, str], platform: str, run_dir: Path, steps: int, **opts: Any) -> dict[str, Any]:
    """Train in a fresh process (see _train_all)."""
    (run,) = _train_all(env, {"platform": platform, "run_dir": str(run_dir), "steps": steps, **opts})
    return run


def _xla_then_cpu(env: dict[str, str], tmp_path: Path, steps: int, **opts: Any) -> tuple[dict, dict]:
    """The same run on XLA (trn1, in tmp_path/xla) and as its CPU reference (tmp_path/cpu), in one fresh process."""
    return tuple(_train_all(env, *({"platform": platform, "run_dir": str(tmp_path / name), "steps": steps, **opts}
                                   for platform, name in (("trn1", "xla"), ("cpu", "cpu")))))


def _read(run_dir: Path, iteration: int) -> dict[str, Any]:
    """A checkpoint's precision record, XLA RNG state and tensors (model and optimizer), as plain values."""
    import torch

    from megatron_hpc.checkpoint.store import iter_tensors, paths, read_xser

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


LLAMA = {"llama": True, "lr": 2e-3}
"""The Llama runs' options (the LR of tests/multiprocess/mp_workers.py's Llama runs)."""


@pytest.fixture(scope="module")
def fp32_runs(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """In one process with XLA_USE_BF16=1 left in the environment: fp32 runs of 8 steps (saved at 4 and 8) of GPT and
    the Llama on XLA (trn1's backend), the Llama again stopped after 4 steps and resumed from there to 8 in a run of
    its own, then (after every XLA run) GPT and the Llama on the CPU."""
    tmp = tmp_path_factory.mktemp("fp32")
    runs = {"xla": ("trn1", 8, {}), "xla_llama": ("trn1", 8, LLAMA), "xla_llama_part1": ("trn1", 4, LLAMA),
            "xla_llama_part2": ("trn1", 8, {**LLAMA, "load": str(tmp / "xla_llama_part1" / "checkpoints")}),
            "cpu": ("cpu", 8, {}), "cpu_llama": ("cpu", 8, LLAMA)}
    results = _train_all({**env, "XLA_USE_BF16": "1"}, *({"platform": platform, "run_dir": str(tmp / name),
                                                          "steps": steps, **opts}
                                                         for name, (platform, steps, opts) in runs.items()))
    return {"dir": tmp, **dict(zip(runs, results))}


def test_fp32_on_xla_trains_the_cpu_model_even_with_xla_use_bf16_set(fp32_runs: dict[str, Any]) -> None:
    """train.precision fp32 is the truth: XLA_USE_BF16=1 left in the environment is cleared, with a warning."""
    # trn1's backend is xla; XLA_USE_BF16 is read by nothing on the CPU path, which runs after the XLA runs
    xla, cpu, tmp_path = fp32_runs["xla"], fp32_runs["cpu"], fp32_runs["dir"]
    assert [i for i, _ in xla["losses"]] == [i for i, _ in cpu["losses"]] == [2, 4, 6, 8]
    # In bf16 the losses would differ from the CPU's in the third digit.
    assert [loss for _, loss in xla["losses"]] == pytest.approx([loss for _, loss in cpu["losses"]], rel=1e-5)
    assert "| xla fp32 |" in _banner(xla["stdout"])
    assert "megatron-hpc: warning: XLA_USE_BF16=1 ignored: train.precision is fp32" in xla["stderr"]
    saved = _read(tmp_path / "xla", 8)
    assert saved["precision"] == {"train_precision": "fp32", "weights_hold": "float32"}
    weights = [v for k, v in saved["tensors"].items() if k.startswith("model.") and k.endswith("weight")]
    assert not all(w["bf16_exact"] for w in weights)  # fp32 values, not bf16 ones stored as float32


def test_llama_on_xla_trains_the_cpu_model_and_resumes_exactly(fp32_runs: dict[str, Any]) -> None:
    """Grouped-query attention on XLA repeats each key/value group for its queries (model/gpt.py expand_groups) where
    the CPU lets scaled_dot_product_attention share them: the same losses; and a resume is the same run, bit for
    bit."""
    xla, cpu, tmp = fp32_runs["xla_llama"], fp32_runs["cpu_llama"], fp32_runs["dir"]
    assert [i for i, _ in xla["losses"]] == [i for i, _ in cpu["losses"]] == [2, 4, 6, 8]
    assert [loss for _, loss in xla["losses"]] == pytest.approx([loss for _, loss in cpu["losses"]], rel=1e-5)
    assert xla["losses"][-1][1] < xla["losses"][0][1] - 0.3  # it trains
    assert xla["losses"] != fp32_runs["xla"]["losses"]  # another model than GPT, really
    saved = _read(tmp / "xla_llama", 8)["tensors"]
    assert "model.h.0.mlp.gate.weight" in saved and "model.h.0.attn.qkv.bias" in saved
    assert "model.h.0.ln_1.bias" not in saved and "model.h.0.attn.proj.bias" not in saved
    assert len(saved["model.h.0.attn.qkv.weight"]["values"]) == (4 + 2 * 2) * 16 * 64  # 4 queries, 2 keys, 2 values
    part2 = fp32_runs["xla_llama_part2"]
    assert "at iteration 4" in part2["stdout"]
    assert [i for i, _ in part2["losses"]] == [6, 8]
    assert part2["losses"] == xla["losses"][-2:]  # exactly
    theirs, ours = saved, _read(tmp / "xla_llama_part2", 8)["tensors"]
    assert theirs.keys() == ours.keys() and any(k.startswith("optimizer.") for k in ours)
    assert [k for k in theirs if theirs[k]["values"] != ours[k]["values"]] == []


@pytest.fixture(scope="module")
def bf16_dropout_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """8 uninterrupted steps in bf16 with dropout, saved at 4 and 8 (at the LR of MASTERS, which compares with it)."""
    run_dir = tmp_path_factory.mktemp("straight")
    return run_dir, _train(env, "trn1", run_dir, 8, precision="bf16", dropout=0.1, lr=MASTERS["lr"])


def test_bf16_with_dropout_resumes_exactly(env: dict[str, str], tmp_path: Path,
                                           bf16_dropout_run: tuple[Path, dict[str, Any]]) -> None:
    """torch_xla's RNG draws the dropout masks: the checkpoint keeps it (xla_rng_state) and a resume restores it."""
    from megatron_hpc.checkpoint.store import paths

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
    xla, cpu = _xla_then_cpu(env, tmp_path, 8, **opts)
    assert cpu["error"] is not None and "not finite for 3 steps in a row (iterations 3-5" in cpu["error"]
    assert xla["error"] == cpu["error"]
    assert [i for i, _ in xla["losses"]] == [2, 4] and xla["losses"][0][1] == pytest.approx(cpu["losses"][0][1])
    before, after = _read(tmp_path / "xla", 2), _read(tmp_path / "xla", 4)
    assert all(t["finite"] for t in after["tensors"].values())
    # Weights, Adam moments and Adam's step count all as they were after step 2: steps 3 and 4 were no-ops.
    assert after["tensors"].keys() == before["tensors"].keys()
    changed = [k for k in before["tensors"] if after["tensors"][k]["values"] != before["tensors"][k]["values"]]
    assert changed == []


CHECK_XSER = r"""
import sys, torch
import torch_xla
from pathlib import Path
import torch_xla.utils.serialization as xser
from megatron_hpc.checkpoint.store.xser import iter_tensors, read_xser
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

# Runs the scripts of argv[1] (a JSON list of [code, [args...]]) one after the other, each with its own sys.argv.
EACH = r"""
import json, sys
for code, args in json.loads(sys.argv[1]):
    sys.argv = ["-c", *args]
    exec(compile(code, "<script>", "exec"), {"__name__": "__main__"})
"""


@pytest.fixture(scope="module")
def real_xser(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
              bf16_dropout_run: tuple[Path, dict[str, Any]]) -> dict[str, Any]:
    """torch_xla's own xser, both ways, in one process for two tests (importing torch_xla costs about 10 CPU
    seconds): CHECK_XSER on bf16_dropout_run's checkpoint, then AS_REFERENCE from a CPU run of 6 steps (in `a`)."""
    tmp = tmp_path_factory.mktemp("real-xser")
    first = _train(env, "cpu", tmp / "a", 6)
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    scripts = [[CHECK_XSER, [str(bf16_dropout_run[0]), str(tmp)]],
               [AS_REFERENCE, [str(tmp / "a" / "checkpoints"), str(tmp / "reference"), str(fixtures)]]]
    proc = subprocess.run([sys.executable, "-c", EACH, json.dumps(scripts)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read_back, reference_files = (int(line) for line in proc.stdout.strip().splitlines()[-2:])
    return {"dir": tmp, "first": first, "read_back": read_back, "reference_files": reference_files}


def test_real_xser_reads_ours_and_we_read_real_xser(real_xser: dict[str, Any]) -> None:
    assert real_xser["read_back"] > 50  # weights, Adam moments, RNG states


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
    from megatron_hpc.checkpoint.store import paths

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


def test_fp32_weights_without_masters_resume_as_the_masters(env: dict[str, str], tmp_path: Path,
                                                           masters_run: tuple[Path, dict[str, Any]]) -> None:
    """What `ckpt convert` writes from a bf16 run that kept fp32 masters: the masters as the weights, no main_param.
    Loaded through checkpoint.load, the masters start from those fp32 weights, not from the bf16 rounding the
    model's parameters hold, so the run continues as the original one did."""
    import torch

    from megatron_hpc.checkpoint.conversion import read_whole, stream
    from megatron_hpc.checkpoint.conversion.optim_layout import by_name, indexed
    from megatron_hpc.checkpoint.store import paths

    straight_dir, straight = masters_run
    whole = read_whole(straight_dir / "checkpoints", iteration=2)
    state = whole.first
    moments = by_name(state["model"], state["optimizer"])
    assert {w.dtype for w in state["model"].values()} == {torch.bfloat16}
    state["model"] = {n: moments[n].pop("main_param") for n in state["model"]}  # fp32, in the model's order
    state["optimizer"] = indexed(moments, model=state["model"], groups=state["optimizer"]["param_groups"])
    stream.reshard(stream.in_memory(whole), tp=1, out=tmp_path / "converted")
    assert paths.tracker_file(tmp_path / "converted").read_text().strip() == "2"
    resumed = _train(env, "trn1", tmp_path / "run", 4, load=str(tmp_path / "converted"), **MASTERS)
    assert "at iteration 2" in resumed["stdout"]
    assert resumed["losses"] == straight["losses"][-1:]  # exactly
    theirs, ours = _read(straight_dir, 4)["tensors"], _read(tmp_path / "run", 4)["tensors"]
    assert theirs.keys() == ours.keys()
    assert [k for k in theirs if theirs[k]["values"] != ours[k]["values"]] == []


# A checkpoint as the Neuron reference Megatron saves it with --save-xser on Trainium, written by the real
# torch_xla.utils.serialization.save: the bf16 model and the optimizer on the XLA device (each tensor its own file,
# a TensorReference in the main file), the RNG states on the CPU inline, numpy's state as a numpy array, flat args,
# Float16OptimizerWithFloat16Params' fp32 masters. Its values are our CPU run's, so converted it must continue
# exactly as that run resumed does.
AS_REFERENCE = r"""
import sys
from pathlib import Path
import numpy as np
import torch
import torch_xla
import torch_xla.utils.serialization as xser
sys.path.insert(0, sys.argv[3])
import megatron_writers as mw
from megatron_hpc.checkpoint.store.contents import read_progress
from megatron_hpc.checkpoint.conversion.optim_layout import by_name
from megatron_hpc.checkpoint.conversion.whole import read_whole
ours, out = Path(sys.argv[1]), Path(sys.argv[2])
state = read_whole(ours).first
model, progress = state["model"], read_progress(state, where=ours)
cfg = state["resolved_config"]["model"]
moments = by_name(model, state["optimizer"])
heads, layers = cfg["num_attention_heads"], list(range(cfg["num_layers"]))
masters, m1, m2 = [mw.flat(mw.legacy_model(d, layers=layers, first=True, last=True, version=3.0, heads=heads))
                   for d in (model, {n: m["exp_avg"] for n, m in moments.items()},
                             {n: m["exp_avg_sq"] for n, m in moments.items()})]
group = state["optimizer"]["param_groups"][0]
optimizer = mw.optimizer_state(list(masters.items()), list(m1.values()), list(m2.values()),
                               step=float(progress.lr_steps), lr=group["lr"], weight_decay=group["weight_decay"],
                               betas=tuple(group["betas"]), masters=True)
dev = torch_xla.device()
on_device = lambda tree: {k: on_device(v) for k, v in tree.items()} if isinstance(tree, dict) else (
    [on_device(v) for v in tree] if isinstance(tree, list) else tree.to(dev) if torch.is_tensor(tree) else tree)
bf16 = mw.legacy_model({n: w.to(torch.bfloat16) for n, w in model.items()}, layers=layers, first=True, last=True,
                       version=3.0, heads=heads)
name, keys, pos, has_gauss, cached = state["np_rng_state"]
reference = {"num_layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"], "num_attention_heads": heads,
             "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
             "consumed_train_samples": progress.consumed_samples, "consumed_valid_samples": 0,
             "max_position_embeddings": cfg["max_position_embeddings"],
             "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"],
             "padded_vocab_size": model["wte.weight"].shape[0], "tokenizer_type": "GPT2BPETokenizer",
             "checkpoint_version": 3.0, "iteration": progress.iteration, "bf16": True,
             "model": on_device(bf16), "optimizer": on_device(optimizer),
             "lr_scheduler": {"max_lr": group["lr"], "warmup_steps": 0, "num_steps": progress.lr_steps * 4,
                              "decay_style": "constant", "min_lr": group["lr"]},
             "random_rng_state": state["random_rng_state"],
             "np_rng_state": [name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached],
             "torch_rng_state": state["torch_rng_state"], "rng_tracker_states": {}}
main = out / f"iter_{progress.iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
main.parent.mkdir(parents=True)
xser.save(reference, str(main), master_only=False)
mw.write_tracker(out, progress.iteration)
print(len(list(main.with_name(main.name + ".tensors").iterdir())))
"""


def test_a_reference_checkpoint_saved_by_real_xser_converts_and_continues(env: dict[str, str], tmp_path: Path,
                                                                         real_xser: dict[str, Any]) -> None:
    first, ran = real_xser["first"], real_xser["dir"]  # the CPU run in `a`, and the reference AS_REFERENCE made of it
    assert real_xser["reference_files"] > 40  # bf16 weights, fp32 masters, moments: one file each

    def cli(*args: str) -> dict[str, Any]:
        # In this process: reading the reference's files needs no torch_xla, and a fresh one would import torch again
        from megatron_hpc.cli.main import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["ckpt", *args, "--json"]) == 0
        return json.loads(out.getvalue())

    seen = cli("inspect", str(ran / "reference"))
    assert (seen["family"], seen["iteration"], seen["format"]) == ("neuron-reference", 6, "xser")
    report = cli("convert", str(ran / "reference"), "--to", "xser", "--out", str(tmp_path / "conv"))
    assert (report["optimizer"], report["weights_dtype"]) == ("resharded", "float32")  # the masters, not bf16
    # The run's own resume from its iteration-6 checkpoint (its metrics file gains iteration 8), and the converted
    # reference continued, both on the CPU, in one process.
    own_resume, continued = _train_all(env, {"platform": "cpu", "run_dir": str(ran / "a"), "steps": 8},
                                       {"platform": "cpu", "run_dir": str(tmp_path / "c"), "steps": 8,
                                        "load": str(tmp_path / "conv")})
    resumed = dict(own_resume["losses"])
    assert [i for i, _ in continued["losses"]] == [8]
    assert continued["losses"][0][1] == pytest.approx(resumed[8], rel=1e-5)
    assert continued["losses"][0][1] < first["losses"][0][1] - 0.1  # where the model was, not a fresh start
