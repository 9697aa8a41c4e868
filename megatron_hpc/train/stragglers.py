"""Stragglers named: the ranks' compute and wait times (train/pulse.py) are gathered in one small all-reduce at log
steps, and a node whose compute time per step stays above launch.straggler_threshold x the median node's for
WINDOW consecutive gathers is named in the log, in TensorBoard and in <run>/stragglers.json.

A node's compute time is its slowest rank's (one slow device sets the pace of its node); its wait time is its
ranks' mean. The gather runs at log steps only, never per step: a (world, 4) tensor, each rank filling its row,
summed over the world (all-reduce works on every backend; XLA has no all-gather of this shape cheaper than it).
It is also spaced so that it costs at most 1/GATHER_COST_BOUND of the step time it covers, whatever
train.log_interval is: each rank proposes the steps to wait before the next gather (GATHER_COST_BOUND x its
last gather's cost over its mean step), the proposals travel in the gather itself, and every rank takes the
largest, so all of them skip the same log steps (a decision from each rank's own clock would differ between
ranks and leave some waiting in the all-reduce). Skipped steps keep accumulating in the pulse, so a gather's
times cover every timed step since the one before: the window counts gathers, each one at least a log interval.
The last rank, which holds the metrics, decides and writes. Node names are the host names in the heartbeats.
stragglers.json is rewritten while a node is named, when the named set changes, and at the first timed gather.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from megatron_hpc.heartbeat import read_beat
from megatron_hpc.parallel.device import DeviceInfo, when_step_done
from megatron_hpc.run_folder import STRAGGLERS_FILE, write_json
from megatron_hpc.train.pulse import Pulse, SlowdownForTests
from megatron_hpc.train.tensorboard import TensorBoardWriter

GATHER_COST_BOUND = 200.0
"""The steps between two gathers take at least this many times the last gather's cost (its share under 0.5%)."""
WINDOW = 3
"""Consecutive gathers (each at least one log interval) a node must stay above the threshold to be named (one
slow interval is noise: a checkpoint write, a page-cache flush)."""
TEST_SLOW_RANK_ENV = "MEGATRON_HPC_TEST_ONLY_SLOW_RANK"
"""Test only: "R:SECONDS" makes rank R sleep SECONDS in every step's compute."""
TEST_NODE_PER_RANK_ENV = "MEGATRON_HPC_TEST_ONLY_NODE_PER_RANK"
"""Test only: "1" makes every rank a node of its own, named <host>-rank<R> (one machine stands for several)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KnobsForTests:
    slowdown: SlowdownForTests | None = None
    node_per_rank: bool = False


def knobs_for_tests(environ: Mapping[str, str] | None = None) -> KnobsForTests:
    """The test-only knobs, read here and nowhere else; a malformed value is an error, never ignored."""
    env = os.environ if environ is None else environ
    slowdown = None
    if env.get(TEST_SLOW_RANK_ENV):
        rank, _, seconds = env[TEST_SLOW_RANK_ENV].partition(":")
        try:
            slowdown = SlowdownForTests(rank=int(rank), seconds=float(seconds))
        except ValueError:
            raise ValueError(f"{TEST_SLOW_RANK_ENV}={env[TEST_SLOW_RANK_ENV]!r} is not RANK:SECONDS (e.g. 1:0.05); "
                             "unset it outside tests") from None
    return KnobsForTests(slowdown=slowdown, node_per_rank=env.get(TEST_NODE_PER_RANK_ENV) == "1")


# ------------------------------------------------------------------------------------------ pure decisions


@dataclass(frozen=True, kw_only=True, slots=True)
class RankNodes:
    """Which node each rank is on, seen from `rank`."""

    rank: int
    node_of: tuple[int, ...]
    """By rank: rank // workers per node, or the rank itself (per_rank)."""
    per_rank: bool = False
    """Every rank a node of its own (TEST_NODE_PER_RANK_ENV)."""

    @classmethod
    def of(cls, *, rank: int, world_size: int, workers_per_node: int, knobs: KnobsForTests) -> RankNodes:
        per_rank = knobs.node_per_rank
        return cls(rank=rank, per_rank=per_rank,
                   node_of=tuple(r if per_rank else r // workers_per_node for r in range(world_size)))


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeTime:
    node: int
    """Index: rank // workers per node (or the rank itself, TEST_NODE_PER_RANK_ENV)."""
    ranks: tuple[int, ...]
    compute_s: float
    """Per step, the node's slowest rank's."""
    wait_s: float
    """Per step, the mean of the node's ranks'."""


def node_times(per_rank: list[tuple[float, float]], *, node_of: tuple[int, ...], steps: int) -> list[NodeTime]:
    """Each node's compute and wait per step, from the ranks' interval sums."""
    ranks: dict[int, list[int]] = {}
    for rank, node in enumerate(node_of):
        ranks.setdefault(node, []).append(rank)
    return [NodeTime(node=node, ranks=tuple(members), compute_s=max(per_rank[r][0] for r in members) / steps,
                     wait_s=statistics.fmean(per_rank[r][1] for r in members) / steps)
            for node, members in sorted(ranks.items())]


def ratios(nodes: list[NodeTime]) -> tuple[float, dict[int, float]]:
    """The median node's compute per step, and each node's compute over it."""
    median = statistics.median(n.compute_s for n in nodes)
    return median, {n.node: (n.compute_s / median if median > 0 else 1.0) for n in nodes}


@dataclass(kw_only=True, slots=True)
class StragglerWindow:
    """How many logs in a row each node was above the threshold; named once the streak reaches the window."""

    threshold: float
    window: int = WINDOW
    streaks: dict[int, int] = field(default_factory=dict)

    def update(self, node_ratios: dict[int, float]) -> list[int]:
        for node, ratio in node_ratios.items():
            self.streaks[node] = self.streaks.get(node, 0) + 1 if ratio > self.threshold else 0
        return sorted(n for n, streak in self.streaks.items() if streak >= self.window)


def gather_every(*, cost_s: float, step_s: float, bound: float = GATHER_COST_BOUND) -> int:
    """The steps to wait before the next gather, so that one costing cost_s is at most 1/bound of the steps'
    time; 1 (the next log step) before a gather or a step was timed."""
    if cost_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(bound * cost_s / step_s))


# ------------------------------------------------------------------------------------------------- I/O


class Stragglers:
    """At each log step, on every rank: the gather; on the last rank, the naming, the line, the scalars, the file."""

    def __init__(self, pulse: Pulse, nodes: RankNodes, *, device: DeviceInfo, threshold: float, run_dir: Path | None,
                 enabled: bool, out: TextIO | None = None):
        self.pulse, self.nodes, self.device = pulse, nodes, device
        self.window = StragglerWindow(threshold=threshold)
        self.run_dir, self.enabled, self.out = run_dir, enabled, out
        self.tensorboard: TensorBoardWriter | None = None
        """Set by the loop on the last rank with train.tensorboard."""
        self.named: list[int] = []
        self.written = False
        self.every_steps = 1
        """Agreed by every rank at the last gather (the largest proposal): steps until the next one."""
        self.last_gather: int | None = None
        self.costs_s: tuple[float, ...] = ()
        """This rank's last two gathers, on its host clock: the all-reduce and, on the last rank, the decision."""
        self._gather_s = 0.0
        self._last_start = 0.0
        """perf_counter() when the last gather began: the wall time of the steps since then is what it covers."""

    def log_begins(self, iteration: int) -> None:
        """The heartbeat says log: the log step's collectives follow."""
        self.pulse.beat("log", iteration)

    def due(self, iteration: int) -> bool:
        """Whether the log step at `iteration` gathers: the same answer on every rank (every_steps is agreed)."""
        return self.last_gather is None or iteration - self.last_gather >= self.every_steps

    def at_log(self, iteration: int) -> None:
        """The one collective of the interval (every rank calls it at the same log steps) when it is due."""
        if not self.due(iteration):
            return  # the pulse keeps summing the steps until the next gather
        start = time.perf_counter()
        compute, wait, steps = self.pulse.interval()
        # The steps' whole wall time per step (eval, logging and waits outside the timed sections included); the
        # pulse's sections miss the waits a fast rank spends outside them.
        since = None if self.last_gather is None else max(1, iteration - self.last_gather)
        step_s = (start - self._last_start) / since if since else 0.0
        self._last_start = start
        # The cost is timed from here: on CUDA interval() waits for this rank's step to finish on the device, which
        # the step costs anyway, not the gather.
        cost_from = time.perf_counter()
        # The smaller of the last two costs (none before two gathers): a one-off (the first TensorBoard write, a
        # cold page cache) does not space the gathers out, a lasting change does within two gathers.
        cost_s = min(self.costs_s) if len(self.costs_s) == 2 else 0.0
        proposal = gather_every(cost_s=cost_s, step_s=step_s)
        table = torch.zeros(len(self.nodes.node_of), 4, device=self.device.device)
        table[self.nodes.rank] = torch.tensor([compute, wait, float(steps), float(proposal)], device=self.device.device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=dist.group.WORLD)  # the world group, on purpose
        self._gather_s = time.perf_counter() - cost_from
        # Host read after this step's graph ran (a step closure on XLA); on every rank, for the agreed spacing.
        when_step_done(self.device, self._after_gather, iteration, table)

    def _after_gather(self, iteration: int, table: torch.Tensor) -> None:
        start = time.perf_counter()
        rows = table.tolist()  # host sync, at gathers only
        self.every_steps = max(1, int(max(row[3] for row in rows)))
        self.last_gather = iteration
        if self.enabled:
            self._decide(iteration, rows)
        self.costs_s = (*self.costs_s[-1:], self._gather_s + time.perf_counter() - start)

    def _decide(self, iteration: int, rows: list[list[float]]) -> None:
        steps = int(min(row[2] for row in rows))
        if steps <= 0:  # the interval held only warm-up steps
            return
        nodes = node_times([(row[0], row[1]) for row in rows], node_of=self.nodes.node_of, steps=steps)
        median, node_ratios = ratios(nodes)
        named = self.window.update(node_ratios)
        by_node = {n.node: n for n in nodes}
        entries = [{"node": self.node_name(n), "ranks": list(by_node[n].ranks), "compute_s": by_node[n].compute_s,
                    "wait_s": by_node[n].wait_s, "ratio": node_ratios[n]} for n in named]
        if entries or self.named:
            print(self.line(entries, median=median), file=self.out or sys.stdout, flush=True)
        # The file says who is named now: rewritten while someone is, when that changes, and once at the start;
        # not at every log of a run without stragglers (a file create and rename, up to ms on a busy disk).
        rewrite = bool(entries) or named != self.named or not self.written
        self.named = named
        if self.tensorboard is not None:
            self.tensorboard.stragglers(iteration, max_ratio=max(node_ratios.values()), count=len(named))
        if self.run_dir is not None and rewrite:
            self.written = True
            write_json(self.run_dir / STRAGGLERS_FILE, {
                "updated_at": time.time(), "iteration": iteration, "threshold": self.window.threshold,
                "window": self.window.window, "median_compute_s": median, "nodes": entries})

    def node_name(self, node: int) -> str:
        """The host of the node's first rank, from its heartbeat; node<K> without one."""
        first = self.nodes.node_of.index(node)
        beat = read_beat(self.run_dir, first) if self.run_dir is not None else None
        host = beat.host if beat is not None else f"node{node}"
        return f"{host}-rank{first}" if self.nodes.per_rank else host

    def line(self, entries: list[dict], *, median: float) -> str:
        if not entries:
            return " stragglers: none (the nodes named before are back within the threshold)"
        named = "; ".join(f"{e['node']} (ranks {','.join(map(str, e['ranks']))}) computes {e['compute_s'] * 1e3:.1f} "
                          f"ms/step, {e['ratio']:.2f}x" for e in entries)
        return (f" stragglers: {named} the median node's {median * 1e3:.1f} ms/step, above "
                f"{self.window.threshold:g}x for {self.window.window} logs in a row (launch.straggler_threshold)")
