"""`megatron-hpc tune`'s job: what it runs (written before it is queued) and what it leaves (written at its end).

Before: the K best predicted layouts of the recipe (plan/layout_choice.py rank_layouts), each planned as its own
RunSpec with TP and PP pinned, with the step-time model's parts of its prediction (plan/calibration_fit.py), and
the collective micro-benchmark's sizes with the model's parts of each, go into the run folder's
tune-candidates.json. The run folder's config.json and plan.json are the first candidate's, so the launcher's
node script, sbatch file and local executor run the job as any other (one `tune` phase).

After (rank 0 of the job, train/tune_trials.py): the fit, tune.json, the winner's overlay and the calibration kept
in the shared cache (compile_cache/calibrations.py). Where the run would get a compile phase (Trainium: the node
script's first pass under neuron_parallel_compile compiled every candidate's graphs), every candidate's compile
fingerprint is recorded too, so the run `submit --tune` plans with the winner skips its compile phase. Never
imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.compile_cache import fingerprint
from megatron_hpc.compile_cache.calibrations import (
    StoredCalibration,
    calibration_from_json,
    calibration_to_json,
    keep,
    software_versions,
)

from megatron_hpc.config.hardware import Hardware
from megatron_hpc.config.loader import config_to_dict, load_recipe
from megatron_hpc.config.platforms import Platform
from megatron_hpc.errors import ConfigError, LaunchError, PlanError
from megatron_hpc.plan.calibration import Calibration
from megatron_hpc.plan.calibration_fit import (
    CollectiveSample,
    Fit,
    Observation,
    Parts,
    Scales,
    collective_parts,
    disturbance_line,
    gemm_parts,
    median,
    op_parts,
    parts_of,
    refit,
    relative_error,
    trial_time,
)
from megatron_hpc.plan.gemm_shapes import RankGemms, benchmark_shapes, rank_gemms
from megatron_hpc.plan.jobs import compile_left_out
from megatron_hpc.plan.layout_choice import predict, rank_layouts
from megatron_hpc.plan.node_shape import SINFO_FORMAT, node_shape_mismatch, partition_nodes
from megatron_hpc.plan.planner import Plan, hardware_of, make_plan
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.run_folder import (
    TUNE_CANDIDATES_FILE,
    TUNE_FILE,
    TUNE_MEASURED_FILE,
    TUNE_OVERLAY_FILE,
    FingerprintRecord,
    read_json,
    write_json,
)

WARMUP_STEPS = 2
"""The trainer's untimed first steps (train/metrics.py WARMUP_STEPS, which a test holds equal): a trial's times
are those of its later steps."""

TRIAL_STEPS = WARMUP_STEPS + 4
"""A trial's steps where the recipe's compile.num_steps leaves fewer than two to time and --set does not say."""

BENCH_OPS = ("all_reduce", "all_gather", "send_recv")
BENCH_SIZES = (0.25, 1.0, 4.0)
"""Micro-benchmark sizes as multiples of one micro-batch's activations (b * s * h at the recipe's precision): the
messages TP and PP exchange, and a quarter and four times that around them."""
MIN_BENCH_BYTES = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    label: str
    overlay: tuple[str, ...]
    """The --set arguments that pin this layout on the recipe."""
    spec: RunSpec
    predicted_s: float
    parts: Parts
    gemms: RankGemms
    """The matrix products of one micro-batch on one of its ranks: what the GEMM micro-benchmark times."""


def plan_candidates(recipe: str, overrides: list[str], *, plan: Plan, platform: Platform, top: int,
                    calibration: Calibration) -> list[Candidate]:
    """The `top` best predicted layouts of the recipe planned as `plan` is, each with TP and PP pinned."""
    if top < 1:
        raise ConfigError(f"--top {top}: tune runs the K best predicted layouts, K at least 1; use --top 3 (the "
                          "default), or --top 1 to calibrate on the chosen layout alone")
    cfg = load_recipe(recipe, overrides)
    if cfg.compile.num_steps <= WARMUP_STEPS + 1:
        if any(o.partition("=")[0].strip() == "compile.num_steps" for o in overrides):
            raise ConfigError(f"compile.num_steps={cfg.compile.num_steps} leaves fewer than 2 timed steps per trial "
                              f"after the {WARMUP_STEPS} warm-up steps; use --set compile.num_steps={TRIAL_STEPS}")
        # The recipe's own compile phase is too short to time (tiny's 3 steps): the trials run TRIAL_STEPS.
        overrides = [*overrides, f"compile.num_steps={TRIAL_STEPS}"]
        cfg = load_recipe(recipe, overrides)
    hardware = hardware_of(platform)
    ranked = rank_layouts(cfg, platform, num_nodes=plan.num_nodes, per_node=plan.workers_per_node,
                          hardware=hardware, calibration=calibration)[:top]
    found = []
    for r in ranked:
        mesh = r.sizes.mesh
        overlay = (f"parallel.tensor={mesh.tensor_parallel}", f"parallel.pipeline={mesh.pipeline_parallel}")
        interval = trial_log_interval(cfg.compile.num_steps, backend=platform.backend)
        trial_cfg = load_recipe(recipe, [*overrides, *overlay, f"train.log_interval={interval}"])
        trial_plan = make_plan(trial_cfg, num_nodes=plan.num_nodes, platform=platform, calibration=calibration)
        parts = parts_of(lambda cal, s=r.sizes: predict(cfg, s, hardware=hardware, calibration=cal).step_time_s,
                         calibration)
        gemms = rank_gemms(cfg.model, micro_batch=cfg.train.micro_batch_size, tensor_parallel=mesh.tensor_parallel,
                           padded_vocab=trial_plan.padded_vocab_size)
        found.append(Candidate(label=r.label, overlay=overlay, spec=RunSpec(config=trial_cfg, plan=trial_plan),
                               predicted_s=r.time.step_time_s, parts=parts, gemms=gemms))
    return found


def trial_log_interval(num_steps: int, *, backend: str) -> int:
    """Steps between a trial's logged intervals, which are what the trial times (train/metrics.py: each log
    records its interval's time per step; the intervals that start in the first WARMUP_STEPS are warm-up).

    On CPU (gloo) a step has finished when its call returns, so every step is logged and timed: per-step times
    for free. On CUDA and XLA a step is queued, and logging it reads its loss on the host, which waits for the
    device (a host sync) and, on XLA, makes each logged step a graph of its own. There the trial times blocks of
    steps, one sync at each end, as a run's own log interval does: the first block (at least the warm-up) is
    untimed, then at least two blocks when the steps allow (the longest such blocks), whose time per step counts
    (their median: plan/calibration_fit.py trial_time). No block is a single step: the trainer also logs the
    last step, so a remainder of one is avoided."""
    if backend == "gloo":
        return 1
    fits = [n for n in range(WARMUP_STEPS, num_steps) if num_steps % n != 1]
    if not fits:  # compile.num_steps below WARMUP_STEPS + 2, which plan_candidates refuses
        return WARMUP_STEPS
    two = [n for n in fits if -(-(num_steps - n) // n) >= 2]
    return max(two) if two else min(fits)


def check_partition_nodes(partition: str | None, *, platform: Platform, constraint: str | None = None) -> None:
    """LaunchError, before anything is queued, when sinfo reports the partition's nodes unlike the platform the
    tune job would calibrate (plan/node_shape.py). Silent when sinfo cannot say: the job checks its node itself."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", SINFO_FORMAT], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return
    if proc.returncode != 0:
        return
    nodes, name = partition_nodes(proc.stdout, partition, constraint=constraint)
    hardware = hardware_of(platform)
    problem = node_shape_mismatch(nodes, partition=name, platform=platform, hardware=hardware.name,
                                  workers_per_node=hardware.workers_per_node)
    if problem:
        raise LaunchError(problem)


def benchmark_samples(plan: Plan, *, hidden_size: int, precision_bytes: int) -> list[tuple[str, int]]:
    """(op, bytes) of each micro-benchmark collective over the job's world (none for a world of one)."""
    if plan.world_size < 2:
        return []
    activation = plan.micro_batch_size * plan.seq_length * hidden_size * precision_bytes
    sizes = sorted({max(MIN_BENCH_BYTES, int(activation * f) // 4 * 4) for f in BENCH_SIZES})
    return [(op, n) for op in BENCH_OPS for n in sizes]


def write_request(run_dir: Path, candidates: list[Candidate], *, platform: Platform, calibration: Calibration,
                  cache_root: Path, cluster: str) -> dict[str, Any]:
    """tune-candidates.json: what the job runs and what it needs to fit and keep the result."""
    first = candidates[0].spec.plan
    hardware = hardware_of(platform)
    precision = 4 if candidates[0].spec.config.train.precision == "fp32" else 2
    bench = benchmark_samples(first, hidden_size=candidates[0].spec.config.model.hidden_size,
                              precision_bytes=precision)
    shapes = benchmark_shapes([c.gemms for c in candidates])
    peak = hardware.peak_flops(candidates[0].spec.config.train.precision)
    request = {
        "recipe": candidates[0].spec.config.name, "cluster": cluster, "cache_root": str(cache_root),
        "hardware": {"name": hardware.name, "runtime": first.platform, "workers_per_node": first.workers_per_node,
                     "platform_workers_per_node": hardware.workers_per_node,
                     "memory_per_worker_gib": hardware.memory_per_worker_gib},
        "versions": software_versions(), "base_calibration": calibration_to_json(calibration),
        "trial_steps": candidates[0].spec.config.compile.num_steps,
        # The job compiles what a compile phase of each candidate would (plan/jobs.py make_tune_phase).
        "compiles": compile_left_out(candidates[0].spec.config, platform) is None,
        "candidates": [{"label": c.label, "overlay": list(c.overlay), "predicted_s": c.predicted_s,
                        "parts": dataclasses.asdict(c.parts), "config": config_to_dict(c.spec.config),
                        "plan": c.spec.plan.to_json()} for c in candidates],
        "benchmark": [list(b) for b in bench],
        "benchmark_parts": [dataclasses.asdict(_bench_parts(op, n, ranks=first.world_size, hardware=hardware,
                                                            base=calibration, per_node=first.workers_per_node))
                            for op, n in bench],
        # Every distinct product of the candidates' ranks, forward and backward, timed on each device in the
        # trials' precision (train/tune_trials.py): the fit's GEMM curve (plan/calibration_fit.py fit_two_stage).
        "gemm_precision": candidates[0].spec.config.train.precision,
        "gemm_benchmark": [[g.batch, g.m, g.k, g.n] for g in shapes],
        "gemm_parts": [dataclasses.asdict(gemm_parts(g.flops, peak_flops=peak, base=calibration)) for g in shapes],
        # A chain of small operators with autograd on each device (train/tune_trials.py _op_bench): the fixed cost
        # of one operator outside the GEMMs, the fit's `dispatch` scale (plan/calibration_fit.py fit_dispatch).
        "op_benchmark": True,
        "op_parts": dataclasses.asdict(op_parts(1, op_overhead_s=calibration.op_overhead_s(platform.backend))),
    }
    write_json(run_dir / TUNE_CANDIDATES_FILE, request)
    return request


def _bench_parts(op: str, nbytes: int, *, ranks: int, hardware: Hardware, base: Calibration,
                 per_node: int) -> Parts:
    sample = CollectiveSample(op=op, ranks=2 if op == "send_recv" else ranks, nbytes=nbytes, seconds=0.0)  # type: ignore[arg-type]
    return collective_parts(sample, hardware=hardware, base=base, workers_per_node=per_node)


def finish_tune(run_dir: Path, request: dict[str, Any], *, steps_s: list[list[float]], bench_s: list[float],
                finished_at_s: float, other_cpu_share: list[float | None] | None = None,
                gemm_s: list[float] | None = None, op_s: list[float] | None = None) -> dict[str, Any]:
    """Fit the calibration to what the job measured (each candidate's timed steps, plan/calibration_fit.py
    trial_time; the GEMM micro-benchmark's times, where the request asked for them); write tune.json and the
    overlay, keep the calibration."""
    base = calibration_from_json(request["base_calibration"])
    cands = request["candidates"]
    measured_s = [trial_time(steps) for steps in steps_s]
    others = list(other_cpu_share or [None] * len(cands))
    trials = [Observation(label=c["label"], parts=Parts(**c["parts"]), measured_s=m) for c, m in zip(cands, measured_s)]
    bench = [Observation(label=f"{op} {n} B", parts=Parts(**p), measured_s=m)
             for (op, n), p, m in zip(request["benchmark"], request["benchmark_parts"], bench_s)]
    gemms = [Observation(label="x".join(map(str, shape)), parts=Parts(**p), measured_s=m)
             for shape, p, m in zip(request.get("gemm_benchmark", []), request.get("gemm_parts", []), gemm_s or [])]
    # op_s: [seconds per operator, operators per chain] (train/tune_trials.py _op_bench); the parts are one operator's.
    ops = [Observation(label="operator", parts=Parts(**request["op_parts"]), measured_s=op_s[0])] \
        if op_s and request.get("op_parts") else []
    hw = request["hardware"]
    source = f"measured by tune on {hw['name']} ({request['cluster']}), run {run_dir}"
    fit, held_out, method, scores = _chosen_fit(base, trials, bench, gemms, ops, source=source)
    after = [o.parts.at(fit.scales) for o in trials]
    winner = min(range(len(trials)), key=lambda i: measured_s[i])
    rows = [{"label": c["label"], "overlay": c["overlay"], "predicted_before_s": c["predicted_s"],
             "predicted_after_s": a, "measured_s": m, "error_before": relative_error(c["predicted_s"], m),
             "error_after": relative_error(a, m), "error_left_out": e, "measured_steps_s": steps,
             "other_cpu_share": o}
            for c, a, m, e, steps, o in zip(cands, after, measured_s, held_out, steps_s, others)]
    stored = StoredCalibration(calibration=fit.calibration, hardware=hw["name"], runtime=hw["runtime"],
                               workers_per_node=hw["workers_per_node"], measured_at_s=finished_at_s,
                               versions=request["versions"], run_dir=str(run_dir))
    path = keep(Path(request["cache_root"]), stored)
    result = {
        "recipe": request["recipe"], "hardware": hw, "trial_steps": request["trial_steps"],
        "fit": {"scales": dataclasses.asdict(fit.scales), "held": list(fit.held), "observations": fit.observations,
                "calibration": calibration_to_json(fit.calibration), "method": method,
                "rms_error_left_out_by_method": scores},
        "candidates": rows,
        "benchmark": [{"label": o.label, "measured_s": o.measured_s,
                       "predicted_before_s": o.parts.at(Scales()), "predicted_after_s": o.parts.at(fit.scales)}
                      for o in bench],
        "gemm_benchmark": [{"shape": o.label, "measured_s": o.measured_s, "predicted_before_s": o.parts.at(Scales()),
                            "predicted_after_s": o.parts.at(fit.scales)} for o in gemms],
        "op_benchmark": [{"label": o.label, "measured_per_op_s": o.measured_s, "ops_per_chain": op_s[1],
                          "predicted_before_s": o.parts.at(Scales()), "predicted_after_s": o.parts.at(fit.scales)}
                         for o in ops],
        "median_abs_error_after": median([abs(r["error_after"]) for r in rows]),
        "median_abs_error_left_out": median([abs(e) for e in held_out if e is not None] or [math.nan]),
        "winner": {"label": rows[winner]["label"], "overlay": rows[winner]["overlay"]},
        "disturbed": disturbance_line([r["label"] for r in rows], others),
        "calibration_path": str(path),
    }
    write_json(run_dir / TUNE_FILE, result)
    (run_dir / TUNE_OVERLAY_FILE).write_text(overlay_line(rows[winner]["overlay"]) + "\n", encoding="ascii")
    return result


def tune_compiles(run_dir: Path) -> bool:
    """Whether this tune job compiled its candidates' graphs as their compile phases would (the request's
    "compiles"): then, once every node published, launch/requeue.py records their fingerprints."""
    return bool(read_json(run_dir / TUNE_CANDIDATES_FILE).get("compiles"))


def record_candidate_fingerprints(run_dir: Path, *, first: Path) -> list[Path]:
    """Every candidate's compile fingerprint in the shared cache, after `first`, the run folder's own (the first
    candidate's), which launch/requeue.py record_fingerprint recorded once every node had published. The markers."""
    request = read_json(run_dir / TUNE_CANDIDATES_FILE)
    # The others differ from the first only in their mesh, hashed with the same environment and compiler as
    # `submit` will for the winner's run.
    recorded = FingerprintRecord.read(run_dir)
    job_id = read_json(first).get("job_id")
    paths = [first]
    for c in request["candidates"]:
        fp = fingerprint.compute(c["config"], c["plan"], env=recorded.inputs["env"],
                                 compiler=recorded.inputs["compiler"])
        if fp.sha256 != recorded.sha256:
            paths.append(fingerprint.record(Path(recorded.cache_root), dataclasses.asdict(fp), run_dir=str(run_dir),
                                            job_id=job_id))
    print(f"megatron-hpc: recorded the compile fingerprints of the {len(paths)} layouts tune compiled; a run of "
          "any of them skips its compile phase", flush=True)
    return paths


def finish_tune_run(run_dir: Path) -> str:
    """After a tune job succeeded (launch/requeue.py, node 0): fit what the trainer measured; the winner line."""
    measured = read_json(run_dir / TUNE_MEASURED_FILE)
    result = finish_tune(run_dir, read_json(run_dir / TUNE_CANDIDATES_FILE), steps_s=measured["steps_s"],
                         bench_s=measured["bench_s"], finished_at_s=measured["finished_at_s"],
                         other_cpu_share=measured.get("other_cpu_share"), gemm_s=measured.get("gemm_s"),
                         op_s=measured.get("op_s"))
    return "\n".join(line for line in (result["disturbed"], winner_line(result)) if line)


def winner_line(result: dict[str, Any]) -> str:
    win = result["winner"]
    return (f"tune: fastest measured {win['label']}; median prediction error after calibration "
            f"{result['median_abs_error_after']:.1%} (each layout left out of the fit: "
            f"{result['median_abs_error_left_out']:.1%}); run it with {overlay_line(win['overlay'])}")


def _chosen_fit(base: Calibration, trials: list[Observation], bench: list[Observation], gemms: list[Observation],
                ops: list[Observation], *, source: str) -> tuple[Fit, list[float | None], str, dict[str, float | None]]:
    """The fit in two stages (the GEMM curve from the timed products) or in one (the trials' own scales), whichever
    predicts the trials better when each is left out (root mean square of the relative errors, the measure the fit
    itself minimises: one layout mispredicted by half weighs more than in a median of three; a fit that fails, or
    that no trial can be left out of, counts as worst; the two-stage one on a tie). Its left-out errors, its name
    and both scores.

    Why both: the products fix the GEMM curve that a few trials cannot (benchmarks/RESULTS.md "Issue 29: tune's
    accuracy"), but where the step's cost outside the products is what differs between layouts (tiny on CPU: a TP
    layout's per-micro-batch work), the one-stage fit's free fixed cost can stand in for it better."""
    tried: dict[str, tuple[Fit, list[float | None]]] = {}
    for name, products in (("two stages", gemms), ("one stage", [])):
        if name == "two stages" and not gemms:
            continue
        try:
            tried[name] = (refit(base, trials + bench, source=source, gemms=products, ops=ops),
                           _left_out_errors(base, trials, bench, products, ops))
        except PlanError:
            if name == "one stage" and not tried:
                raise
    scores = {name: math.sqrt(sum(e * e for e in seen) / len(seen)) if (seen := [e for e in errors if e is not None])
              else None for name, (_, errors) in tried.items()}
    best = min(tried, key=lambda name: (math.inf if scores[name] is None else scores[name], name != "two stages"))
    return *tried[best], best, scores


def _left_out_errors(base: Calibration, trials: list[Observation], bench: list[Observation],
                     gemms: list[Observation], ops: list[Observation]) -> list[float | None]:
    """Each trial predicted by a calibration fitted without it: how well the fit predicts a layout it did not see
    (the in-sample error says little when the trials are as few as the unknowns). The GEMM samples stay in: they
    are the micro-benchmark's, a second of matrix products, not the trial (the operator chain's likewise). None
    where the rest fit nothing."""
    errors: list[float | None] = []
    for i, trial in enumerate(trials):
        try:
            fit = refit(base, trials[:i] + trials[i + 1:] + bench, source="left out", gemms=gemms, ops=ops)
        except PlanError:
            errors.append(None)
            continue
        errors.append(relative_error(trial.parts.at(fit.scales), trial.measured_s))
    return errors


def overlay_line(overlay: list[str] | tuple[str, ...]) -> str:
    return " ".join(f"--set {shlex.quote(item)}" for item in overlay)


def read_result(run_dir: Path) -> dict[str, Any]:
    return read_json(run_dir / TUNE_FILE)
