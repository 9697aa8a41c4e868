"""Refit the step-time model's Calibration from measured trials and micro-benchmarks. Pure.

`megatron-hpc tune` runs the K best predicted layouts for a few steps, times all-reduce, all-gather and
send/receive of a few sizes over the job's process group, and times the matrix products of every candidate's
ranks (plan/gemm_shapes.py) on each device. This module turns those times into a Calibration that plan/steptime.py
uses like the built-in one.

The model's time of anything it predicts is linear in five scales of the calibration it was made with:
- `compute`: the GEMMs' time at their achievable peak (divides gemm_peak_fraction: a GEMM takes
  (ideal + overhead) / gemm_peak_fraction);
- `overhead`: the GEMMs' fixed cost (gemm_overhead_s), which grows with the number of GEMMs rather than their size
  (TP splits each GEMM and runs more micro-batches per rank);
- `memory`: the memory-bound kernels and the optimizer step (divides memory_bandwidth_fraction);
- `bandwidth`: the bytes part of collectives and send/receive (divides collective_bandwidth_fraction);
- `latency`: their per-message startup cost (multiplies collective_latency_factor);
- `dispatch`: the fixed cost of each operator outside the GEMMs (multiplies op_overhead_factor), which grows with
  the number of micro-batches a rank runs (plan/op_counts.py).
The parts are read off the model itself (`parts_of`: six evaluations), never re-derived here. Each residual is
relative to its measurement, so a 100 us all-reduce weighs as much as a 1 s step.

The operator micro-benchmark's samples (a chain of small operators with autograd, timed on every device at once:
all fixed cost) give `dispatch` alone, first, whichever fit follows; without them it is free in the fit of the
trials (held at 1 when they cannot tell it from the rest).

With GEMM samples the fit has two stages: the GEMMs alone give `compute` and `overhead` (their sizes tell the two
apart, which a few trials cannot: the trials of a small model that differ only in how they split the same work are
nearly proportional in both), and the trials and collectives then fit the rest with those two fixed. Without them
(a request written before the GEMM benchmark) one fit with `memory` tied to `compute`, as the model had one scale
for both. An unknown nothing constrains, one the data cannot tell from the others (one trial cannot split compute
from overhead), or one it puts at or below zero (a part too small to see) stays at 1 and is named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from megatron_hpc.config.hardware import Hardware
from megatron_hpc.errors import PlanError
from megatron_hpc.plan.calibration import Calibration

CollectiveOp = Literal["all_reduce", "all_gather", "send_recv"]
_RING_STEPS = {"all_reduce": 2, "all_gather": 1}
"""Ring passes of each collective (plan/steptime.py ring_time's steps_per_rank)."""


UNKNOWNS = ("compute", "overhead", "memory", "bandwidth", "latency", "dispatch")
"""The scales the fit solves for, in the order of Parts' fields."""
_COMPUTE, _OVERHEAD, _MEMORY, _BANDWIDTH, _LATENCY, _DISPATCH = range(len(UNKNOWNS))


@dataclass(frozen=True, kw_only=True, slots=True)
class Parts:
    """A prediction split by the scale each part follows (seconds at every scale 1); fixed_s follows none."""

    compute_s: float
    overhead_s: float = 0.0
    memory_s: float = 0.0
    bandwidth_s: float = 0.0
    latency_s: float = 0.0
    dispatch_s: float = 0.0
    fixed_s: float = 0.0

    def vector(self) -> tuple[float, ...]:
        return (self.compute_s, self.overhead_s, self.memory_s, self.bandwidth_s, self.latency_s, self.dispatch_s)

    def at(self, scales: Scales) -> float:
        return sum(p * k for p, k in zip(self.vector(), scales.vector())) + self.fixed_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Scales:
    """How much longer than the base calibration predicted each part takes (1.0: as predicted)."""

    compute: float = 1.0
    overhead: float = 1.0
    memory: float = 1.0
    bandwidth: float = 1.0
    latency: float = 1.0
    dispatch: float = 1.0

    def vector(self) -> tuple[float, ...]:
        return (self.compute, self.overhead, self.memory, self.bandwidth, self.latency, self.dispatch)


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveSample:
    """One timed collective of the micro-benchmark: the median over its repetitions."""

    op: CollectiveOp
    ranks: int
    nbytes: int
    """The buffer each rank holds (all-reduce, all-gather's output) or sends (send_recv)."""
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Observation:
    """A measured time beside the model's parts of it."""

    label: str
    parts: Parts
    measured_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Fit:
    calibration: Calibration
    scales: Scales
    observations: int
    held: tuple[str, ...]
    """Unknowns kept at 1: nothing constrained them, or the data could not tell them from the others."""


def scaled(base: Calibration, scales: Scales, *, source: str | None = None) -> Calibration:
    """`base` with each part of every prediction multiplied by its scale (the module docstring)."""
    a = scales.compute
    return dataclasses.replace(
        base, source=base.source if source is None else source,
        gemm_peak_fraction=base.gemm_peak_fraction / a,
        gemm_overhead_s=base.gemm_overhead_s * scales.overhead / a,
        memory_bandwidth_fraction=base.memory_bandwidth_fraction / scales.memory,
        collective_bandwidth_fraction=base.collective_bandwidth_fraction / scales.bandwidth,
        collective_latency_factor=base.collective_latency_factor * scales.latency,
        op_overhead_factor=base.op_overhead_factor * scales.dispatch)


def parts_of(predict: Callable[[Calibration], float], base: Calibration) -> Parts:
    """The model's own split of a prediction: evaluated at base and with each scale doubled in turn (exact for every
    term but the overlapped DP reduce's max(), which is near-linear)."""
    one = predict(base)
    doubled = [predict(scaled(base, Scales(**{name: 2.0}))) - one for name in UNKNOWNS]
    return Parts(**{f"{name}_s": part for name, part in zip(UNKNOWNS, doubled)}, fixed_s=one - sum(doubled))


def collective_parts(sample: CollectiveSample, *, hardware: Hardware, base: Calibration,
                     workers_per_node: int) -> Parts:
    """The model's time of one micro-benchmark collective over `sample.ranks` ranks (a ring, as steptime.py
    costs the DP and TP collectives; send_recv as a pipeline hand-over), on the intra-node link when the ranks
    share a node, else on the node's inter-node bandwidth shared by its workers."""
    if sample.ranks <= workers_per_node:
        link, nominal = hardware.intra_node, hardware.intra_node.bytes_per_s
    else:
        link = hardware.inter_node
        nominal = min(hardware.intra_node.bytes_per_s, hardware.inter_node.bytes_per_s / workers_per_node)
    bandwidth = nominal * base.collective_bandwidth_fraction
    latency = link.latency_s * base.collective_latency_factor
    if sample.op == "send_recv":
        return Parts(compute_s=0.0, bandwidth_s=sample.nbytes / bandwidth, latency_s=latency)
    passes = _RING_STEPS[sample.op] * (sample.ranks - 1)
    return Parts(compute_s=0.0, bandwidth_s=passes * sample.nbytes / sample.ranks / bandwidth,
                 latency_s=passes * latency)


def gemm_parts(flops: float, *, peak_flops: float, base: Calibration) -> Parts:
    """The model's time of one matrix product of `flops` on a device of `peak_flops` (plan/steptime.py's GEMM:
    (ideal + gemm_overhead_s) / gemm_peak_fraction), split into its size-proportional part and its fixed cost."""
    return Parts(compute_s=flops / peak_flops / base.gemm_peak_fraction,
                 overhead_s=base.gemm_overhead_s / base.gemm_peak_fraction)


def op_parts(ops: int, *, op_overhead_s: float) -> Parts:
    """The model's time of `ops` operators outside the GEMMs (the operator micro-benchmark's chain): all fixed cost."""
    return Parts(compute_s=0.0, dispatch_s=ops * op_overhead_s)


def fit_dispatch(ops: Sequence[Observation]) -> float | None:
    """The `dispatch` scale from the operator micro-benchmark's samples alone (relative residuals); None without."""
    rows = [r for r in _rows(ops) if r[0][_DISPATCH] > 0] if ops else []
    if not rows:
        return None
    return sum(r[0][_DISPATCH] * r[1] for r in rows) / sum(r[0][_DISPATCH] ** 2 for r in rows)


def _with_known(observations: Sequence[Observation], known: dict[int, float]) -> list[Observation]:
    """The observations with the parts of `known` scales moved into their fixed part (at those scales)."""
    out = []
    for o in observations:
        vec = o.parts.vector()
        extra = sum(vec[k] * v for k, v in known.items())
        zero = {f"{UNKNOWNS[k]}_s": 0.0 for k in known}
        out.append(dataclasses.replace(o, parts=dataclasses.replace(o.parts, fixed_s=o.parts.fixed_s + extra,
                                                                    **zero)))
    return out


def fit_scales(observations: Sequence[Observation],
               ops: Sequence[Observation] = ()) -> tuple[Scales, tuple[str, ...]]:
    """One fit of every scale, `memory` tied to `compute` (a request without GEMM samples: the module docstring):
    the scales minimising the squared relative residuals, and the unknowns held at 1 (_solve). `dispatch` comes
    from the operator samples when given (fit_dispatch). PlanError when nothing was measured or no positive fit is
    left."""
    dispatch = fit_dispatch(ops)
    if dispatch is not None:
        observations = _with_known(observations, {_DISPATCH: dispatch})
    rows = _rows(observations)
    for r in rows:  # one column for GEMM throughput and memory-bound work together
        r[0][_COMPUTE] += r[0][_MEMORY]
        r[0][_MEMORY] = 0.0
    values, free = _solve(rows, groups=((_COMPUTE, _OVERHEAD), (_BANDWIDTH, _LATENCY)))
    values[_MEMORY] = values[_COMPUTE]
    if dispatch is not None:
        values[_DISPATCH], free = dispatch, [*free, _DISPATCH]
    held = [k for k in range(len(UNKNOWNS)) if k not in free and (k != _MEMORY or _COMPUTE not in free)]
    return _checked(values), tuple(UNKNOWNS[k] for k in held)


def fit_two_stage(gemms: Sequence[Observation], others: Sequence[Observation],
                  ops: Sequence[Observation] = ()) -> tuple[Scales, tuple[str, ...]]:
    """The GEMM micro-benchmark's samples alone give `compute` and `overhead` (and the operator samples `dispatch`);
    the trials and collectives, with those fixed, give `memory`, `bandwidth` and `latency` (and `dispatch` without
    operator samples: the module docstring). The unknowns held at 1 are named."""
    dispatch = fit_dispatch(ops)
    if dispatch is not None:
        others = _with_known(others, {_DISPATCH: dispatch})
    # Weighted by time, not relative: the step is a sum of products, mostly its largest (the output layer, the MLP).
    # A CPU runs its small products nearer its peak than its large ones (caches), which the model's saturating
    # curve cannot follow; weighing each product alike fitted the many small ones and missed tiny's steps by 2-5x.
    rows = _rows(gemms, relative=False)
    gemm_values, gemm_free = _solve(rows, groups=((_COMPUTE, _OVERHEAD),))
    fixed = (_COMPUTE, _OVERHEAD)
    rest = _with_known(others, {k: gemm_values[k] for k in fixed})
    # The GEMMs may explain the trials alone (memory held); the collectives need bandwidth or latency.
    values, free = _solve(_rows(rest), groups=((_BANDWIDTH, _LATENCY),)) if rest else (gemm_values, [])
    for k in fixed:
        values[k] = gemm_values[k]
    free = [*gemm_free, *(k for k in free if k not in fixed)]
    if dispatch is not None:
        values[_DISPATCH], free = dispatch, [*free, _DISPATCH]
    return _checked(values), tuple(UNKNOWNS[k] for k in range(len(UNKNOWNS)) if k not in free)


def _rows(observations: Sequence[Observation], *, relative: bool = True) -> list[tuple[list[float], float]]:
    """Each observation as (its parts, its measurement less its fixed part), over its measurement (a relative
    residual) or over the mean measurement (a residual in time, scaled for the solver)."""
    if not observations:
        raise PlanError("nothing was measured: tune needs at least one trial step time or collective time")
    mean = sum(o.measured_s for o in observations) / len(observations)
    return [([p / d for p in o.parts.vector()], (o.measured_s - o.parts.fixed_s) / d)
            for o in observations for d in [o.measured_s if relative else mean]]


def _solve(rows: list[tuple[list[float], float]], *,
           groups: tuple[tuple[int, ...], ...]) -> tuple[list[float], list[int]]:
    """Least squares over the columns some row constrains, less those the data cannot tell apart (dropped in the
    order overhead, latency, memory, bandwidth, compute) and those it puts at or below zero (a part too small to
    see: of those, the one whose holding fits best, never every column of a group). Every value, and the free."""
    free = [k for k in range(len(UNKNOWNS)) if any(abs(r[0][k]) > 0 for r in rows)]
    values = _least_squares(rows, free)
    while values is None:
        free.remove(next(k for k in (_DISPATCH, _OVERHEAD, _LATENCY, _MEMORY, _BANDWIDTH, _COMPUTE) if k in free))
        values = _least_squares(rows, free)
    # A group's measurements must stay explained by one of its columns (trials by compute or its fixed cost,
    # collectives by bandwidth or latency).
    needed = [g for g in groups if any(k in free for k in g)]
    while any(values[k] <= 0 for k in free):
        tries = [(f, v) for f in ([j for j in free if j != k] for k in free if values[k] <= 0)
                 if all(any(k in f for k in g) for g in needed) and (v := _least_squares(rows, f)) is not None]
        if not tries:
            break
        free, values = min(tries, key=lambda fv: _residual(rows, fv[1]))
    return values, free


def _checked(values: list[float]) -> Scales:
    scales = Scales(**dict(zip(UNKNOWNS, values)))
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise PlanError(f"the measured times fit no positive speed ({_describe(scales)} of the prediction); the "
                        "trials were disturbed or too short: re-run tune with more steps (--set compile.num_steps=N) "
                        "on idle nodes")
    return scales


def _residual(rows: list[tuple[list[float], float]], values: list[float]) -> float:
    return sum((sum(x * v for x, v in zip(r[0], values)) - r[1]) ** 2 for r in rows)


def _least_squares(rows: list[tuple[list[float], float]], free: list[int]) -> list[float] | None:
    """Every scale: the `free` ones solved from the normal equations (Gaussian elimination, partial pivoting), the
    others 1; None when the equations are singular (columns the data cannot tell apart)."""
    n = len(free)
    held = [k for k in range(len(UNKNOWNS)) if k not in free]
    rhs = [r[1] - sum(r[0][k] for k in held) for r in rows]  # a held part counts at scale 1
    m = [[sum(r[0][i] * r[0][j] for r in rows) for j in free] + [sum(r[0][i] * b for r, b in zip(rows, rhs))]
         for i in free]
    scale = max((abs(m[i][i]) for i in range(n)), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    values = [1.0] * len(UNKNOWNS)
    for i, k in enumerate(free):
        values[k] = m[i][n] / m[i][i]
    return values


def _describe(scales: Scales) -> str:
    return ", ".join(f"{name} x{value:.3g}" for name, value in zip(UNKNOWNS, scales.vector()))


def refit(base: Calibration, observations: Sequence[Observation], *, source: str,
          gemms: Sequence[Observation] = (), ops: Sequence[Observation] = ()) -> Fit:
    """The Calibration that predicts the observations best, named `source` for `plan` to print: in two stages when
    the GEMM micro-benchmark's samples are given (fit_two_stage), else in one (fit_scales); `dispatch` from the
    operator micro-benchmark's samples when given."""
    scales, held = fit_two_stage(gemms, observations, ops) if gemms else fit_scales(observations, ops)
    return Fit(calibration=scaled(base, scales, source=source), scales=scales,
               observations=len(observations) + len(gemms) + len(ops), held=held)


def node_mismatch(*, hardware: str, workers_per_node: int, memory_gib: float, found_workers: int,
                  found_memory_gib: float) -> str | None:
    """Why a tune job's node is not the platform it calibrates (devices per node, or memory per device more than
    10% off), with the fix; None when it is. A calibration measured there would be kept under the wrong name."""
    if found_workers == workers_per_node and abs(found_memory_gib - memory_gib) <= 0.1 * memory_gib:
        return None
    return (f"tune runs on nodes with {found_workers} devices of {found_memory_gib:.0f} GiB, but platform {hardware} "
            f"states {workers_per_node} of {memory_gib:.0f} GiB; tune on the platform's nodes (--constraint, "
            f"--partition), or describe these with --platform-file (workers_per_node: {found_workers}, "
            f"memory_per_worker_gib: {found_memory_gib:.0f})")


def trial_time(steps_s: Sequence[float]) -> float:
    """A trial's step time from its timed steps (or blocks' time per step), each the slowest rank's (a step ends
    when its last rank is done): their median, which a few steps slowed by other work do not move. The fastest step
    was tried as well, on ten tunes of a shared machine under load: no better (benchmarks/RESULTS.md "Issue 29:
    tune's accuracy")."""
    if not steps_s:
        raise PlanError("a tune trial timed no step after its warm-up; re-run tune with more steps "
                        "(--set compile.num_steps=12)")
    return median(steps_s)


DISTURBED_SHARE = 0.10
"""Other processes' share of a node's CPU time during a trial above which tune warns: layouts slow down unequally
under such load (one that keeps every core busy loses more than a pipeline whose idle stage yields its core), so
the fit reads the load as the layouts' cost (benchmarks/RESULTS.md "Issue 29: tune's accuracy")."""


def other_work_share(*, busy_s: float, own_s: float, wall_s: float, cores: int) -> float:
    """The share of a node's CPU time that processes other than the trial's workers used over wall_s: the node's
    busy CPU seconds less the workers' own, over wall_s x cores (0 when the workers account for all of it)."""
    if wall_s <= 0 or cores < 1:
        return 0.0
    return max(0.0, busy_s - own_s) / (wall_s * cores)


def disturbance_line(labels: Sequence[str], shares: Sequence[float | None]) -> str | None:
    """One warning line when other work took more than DISTURBED_SHARE of a node's CPU during some trial; else None."""
    seen = [(label, s) for label, s in zip(labels, shares) if s is not None]
    if not seen or max(s for _, s in seen) <= DISTURBED_SHARE:
        return None
    each = ", ".join(f"{label} {s:.0%}" for label, s in seen)
    return (f"tune: warning: other processes used up to {max(s for _, s in seen):.0%} of a node's CPU during the "
            f"trials ({each}); layouts slow down unequally under such load, so these times and the calibration "
            "may mislead: re-run tune on idle nodes (an exclusive allocation, nothing else running)")


def relative_error(predicted_s: float, measured_s: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted_s - measured_s) / measured_s


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
