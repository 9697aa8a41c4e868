"""Stragglers named: every log interval the ranks' compute and wait times (train/pulse.py) are gathered in one
small all-reduce, and a node whose compute time per step stays above launch.straggler_threshold x the median
node's for WINDOW consecutive logs is named in the log, in TensorBoard and in <run>/stragglers.json.

A node's compute time is its slowest rank's (one slow device sets the pace of its node); its wait time is its
ranks' mean. The gather runs at log steps only, never per step: a (world, 2) tensor, each rank filling its row,
summed over the world (all-reduce works on every backend; XLA has no all-gather of this shape cheaper than it).
The last rank, which holds the metrics, decides and writes. Node names are the host names in the heartbeats.
stragglers.json is rewritten while a node is named, when the named set changes, and at the first timed log.
"""

from __future__ import annotations

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

WINDOW = 3
"""Consecutive log intervals a node must stay above the threshold to be named (one slow interval is noise: a
checkpoint write, a page-cache flush)."""
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

    def log_begins(self, iteration: int) -> None:
        """The heartbeat says log: the log step's collectives follow."""
        self.pulse.beat("log", iteration)

    def at_log(self, iteration: int) -> None:
        """The one collective of the interval (every rank calls it at the same log step)."""
        compute, wait, steps = self.pulse.interval()
        table = torch.zeros(len(self.nodes.node_of), 3, device=self.device.device)
        table[self.nodes.rank] = torch.tensor([compute, wait, float(steps)], device=self.device.device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=dist.group.WORLD)  # the world group, on purpose
        if self.enabled:  # host read after this step's graph ran (a step closure on XLA)
            when_step_done(self.device, self._decide, iteration, table)

    def _decide(self, iteration: int, table: torch.Tensor) -> None:
        rows = table.tolist()  # host sync, at log steps only
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
