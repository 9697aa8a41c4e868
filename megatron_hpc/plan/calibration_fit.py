"""Refit the step-time model's Calibration from measured trials and a collective micro-benchmark. Pure.

`megatron-hpc tune` runs the K best predicted layouts for a few steps and times all-reduce, all-gather and
send/receive of a few sizes over the job's process group. This module turns those times into a Calibration that
plan/steptime.py uses like the built-in one.

The model's time of anything it predicts is linear in four scales of the calibration it was made with, so the fit
is a small linear least squares:
- `compute`: the GEMMs' time at their achievable peak, the memory-bound kernels and the optimizer step (divides
  gemm_peak_fraction and memory_bandwidth_fraction: a GEMM takes (ideal + overhead) / gemm_peak_fraction);
- `overhead`: the GEMMs' fixed cost (gemm_overhead_s), which grows with the number of GEMMs rather than their size
  (TP splits each GEMM and runs more micro-batches per rank);
- `bandwidth`: the bytes part of collectives and send/receive (divides collective_bandwidth_fraction);
- `latency`: their per-message startup cost (multiplies collective_latency_factor).
A trial's step time constrains all four, a collective's only the last two (its sizes tell them apart). The parts
are read off the model itself (`parts_of`: five evaluations), never re-derived here. Each residual is relative
to its measurement, so a 100 us all-reduce weighs as much as a 1 s step. An unknown nothing constrains, one the
data cannot tell from the others (one trial cannot split compute from overhead), or one it puts at or below zero
(a part too small to see) stays at 1 and is named.
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


UNKNOWNS = ("compute", "overhead", "bandwidth", "latency")
"""The scales the fit solves for, in the order of Parts' fields."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Parts:
    """A prediction split by the scale each part follows (seconds at every scale 1); fixed_s follows none."""

    compute_s: float
    overhead_s: float = 0.0
    bandwidth_s: float = 0.0
    latency_s: float = 0.0
    fixed_s: float = 0.0

    def vector(self) -> tuple[float, float, float, float]:
        return (self.compute_s, self.overhead_s, self.bandwidth_s, self.latency_s)

    def at(self, scales: Scales) -> float:
        return sum(p * k for p, k in zip(self.vector(), scales.vector())) + self.fixed_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Scales:
    """How much longer than the base calibration predicted each part takes (1.0: as predicted)."""

    compute: float = 1.0
    overhead: float = 1.0
    bandwidth: float = 1.0
    latency: float = 1.0

    def vector(self) -> tuple[float, float, float, float]:
        return (self.compute, self.overhead, self.bandwidth, self.latency)


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
        memory_bandwidth_fraction=base.memory_bandwidth_fraction / a,
        collective_bandwidth_fraction=base.collective_bandwidth_fraction / scales.bandwidth,
        collective_latency_factor=base.collective_latency_factor * scales.latency)


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


def fit_scales(observations: Sequence[Observation]) -> tuple[Scales, tuple[str, ...]]:
    """The scales minimising the squared relative residuals, and the unknowns held at 1: those nothing constrains,
    those the data cannot tell apart (dropped in the order overhead, latency, bandwidth), and those it puts at or
    below zero (a part too small to see: of those, the one whose holding fits best, never both of compute and
    overhead, nor of bandwidth and latency). PlanError when nothing was measured or no positive fit is left."""
    if not observations:
        raise PlanError("nothing was measured: tune needs at least one trial step time or collective time")
    rows = [([p / o.measured_s for p in o.parts.vector()], 1.0 - o.parts.fixed_s / o.measured_s)
            for o in observations]
    free = [k for k in range(len(UNKNOWNS)) if any(abs(r[0][k]) > 0 for r in rows)]
    values = _least_squares(rows, free)
    while values is None:
        free.remove(next(k for k in (1, 3, 2, 0) if k in free))
        values = _least_squares(rows, free)
    # The trials' time must stay explained by compute or its fixed cost, the collectives' by bandwidth or latency.
    needed = [pair for pair in ((0, 1), (2, 3)) if any(k in free for k in pair)]
    while any(values[k] <= 0 for k in free):
        tries = [(f, v) for f in ([j for j in free if j != k] for k in free if values[k] <= 0)
                 if all(any(k in f for k in pair) for pair in needed) and (v := _least_squares(rows, f)) is not None]
        if not tries:
            break
        free, values = min(tries, key=lambda fv: _residual(rows, fv[1]))
    scales = Scales(**dict(zip(UNKNOWNS, values)))
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise PlanError(f"the measured times fit no positive speed ({_describe(scales)} of the prediction); the "
                        "trials were disturbed or too short: re-run tune with more steps (--set compile.num_steps=N) "
                        "on idle nodes")
    return scales, tuple(UNKNOWNS[k] for k in range(len(UNKNOWNS)) if k not in free)


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


def refit(base: Calibration, observations: Sequence[Observation], *, source: str) -> Fit:
    """The Calibration that predicts the observations best (fit_scales), named `source` for `plan` to print."""
    scales, held = fit_scales(observations)
    return Fit(calibration=scaled(base, scales, source=source), scales=scales, observations=len(observations),
               held=held)


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
