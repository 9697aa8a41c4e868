"""This rank's pulse: its heartbeat (megatron_hpc/heartbeat.py, for the node watchdog) and the timing of each
step's compute and of the rest of it, mostly waiting in collectives (train/stragglers.py names slow nodes from it).

A step is split where forward and backward of every micro-batch have run (`timed` wraps the forward-backward):
before it the rank computes (with tensor or pipeline parallelism, also waiting on its peers inside the node);
after it come the gradient reduce, the clip and the update, where a fast rank waits for the slowest. Times are
the host's wall clock (time.perf_counter). On CPU and gloo that is the work itself. On CUDA the sections are
timed with device events (torch.Event), read at log time, where the host waits for the device anyway. On XLA
the host traces the graph and blocks only at syncs, so the split says where the host waited, not the device's
work: a slow device shows as a longer step on every rank rather than as more compute on its own.

Cost per step: three pwrites of one short line and a few clock reads (benchmarks/heartbeat_overhead.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hpc.errors import ConfigError
from megatron_hpc.heartbeat import HeartbeatWriter, hang_timeout_problem
from megatron_hpc.train.metrics import WARMUP_STEPS
from megatron_hpc.train.step import ForwardBackward


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowdownForTests:
    """Test only (train/stragglers.py knobs_for_tests): rank `rank` sleeps `seconds` in every step's compute section."""

    rank: int
    seconds: float


class _HostMarks:
    """Section boundaries on the host's clock."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return end - start


class _EventMarks:
    """Section boundaries as device events on the current stream (CUDA): the host never waits to record them."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        end.synchronize()  # at log time only: the step's work is done or nearly so
        return start.elapsed_time(end) / 1000.0


class Pulse:
    """Beats at each phase change and times each step's sections; `interval()` hands the sums since the last gather."""

    def __init__(self, writer: HeartbeatWriter | None, *, rank: int, device: torch.device,
                 hang_timeout_s: float | None, slowdown: SlowdownForTests | None = None,
                 world_max: Callable[[float], float] | None = None):
        self.writer, self.rank, self.hang_timeout_s = writer, rank, hang_timeout_s
        self.world_max = world_max
        """The largest of every rank's value (one collective), for the hang-timeout check; None with one rank."""
        self.marks: _HostMarks | _EventMarks = _EventMarks(device) if device.type == "cuda" else _HostMarks()
        self.slow_s = slowdown.seconds if slowdown is not None and slowdown.rank == rank else 0.0
        self.first_timed = WARMUP_STEPS + 1
        """The first iteration past the warm-up: steps from here on are timed."""
        self.iteration = 0
        self.step_s = 0.0
        self._checked = False
        self._step_start = 0.0
        self._sections: list[tuple[Any, Any, Any]] = []
        self._open: tuple[Any, Any] | None = None
        self.beat("init", 0)

    def beat(self, phase: str, iteration: int) -> None:
        if self.writer is not None:
            self.writer.beat(phase, iteration, step_s=self.step_s)

    def starts_at(self, step: int) -> None:
        """The process resumes at `step`: its first WARMUP_STEPS steps are not timed."""
        self.first_timed = step + WARMUP_STEPS + 1

    def step_begins(self, iteration: int) -> None:
        self.iteration = iteration
        self.beat("forward-backward", iteration)
        self._step_start = time.perf_counter()
        self._open = (self.marks.mark(), None) if iteration >= self.first_timed else None

    def compute_done(self) -> None:
        if self.slow_s:
            time.sleep(self.slow_s)  # test only: this rank computes slower (SlowdownForTests)
        self.beat("optimizer", self.iteration)
        if self._open is not None:
            self._open = (self._open[0], self.marks.mark())

    def step_ends(self) -> None:
        """After the update; past the warm-up the step's time is the heartbeat's, checked against the hang
        timeout once."""
        if self._open is None:
            return
        start, split = self._open
        self._sections.append((start, split if split is not None else start, self.marks.mark()))
        self._open = None
        self.step_s = time.perf_counter() - self._step_start
        if not self._checked:
            self._checked = True
            measured = self.step_s
            if self.hang_timeout_s is not None and self.world_max is not None:
                # Every rank decides on the slowest rank's first timed step (one collective, once a process, only
                # with a configured timeout): ranks whose own step came in just under it would otherwise go on and
                # wait in the next collective for peers that stopped, until the watchdog or the collective timeout.
                measured = self.world_max(self.step_s)
            problem = hang_timeout_problem(configured=self.hang_timeout_s, measured_step_s=measured,
                                           iteration=self.iteration)
            if problem:
                raise ConfigError(problem)

    def interval(self) -> tuple[float, float, int]:
        """Compute and wait seconds summed over the timed steps since the last call, and their number."""
        compute = sum(self.marks.seconds(a, b) for a, b, _ in self._sections)
        wait = sum(self.marks.seconds(b, c) for _, b, c in self._sections)
        steps = len(self._sections)
        self._sections.clear()
        return compute, wait, steps

    def timed(self, forward_backward: ForwardBackward) -> ForwardBackward:
        """forward_backward, with the end of its compute marked."""
        return _Timed(forward_backward, self)

    def close(self) -> None:
        self.beat("done", self.iteration)
        if self.writer is not None:
            self.writer.close()


class _Timed:
    def __init__(self, inner: ForwardBackward, pulse: Pulse):
        self.inner, self.pulse = inner, pulse

    def __call__(self, micro_batches: Sequence[torch.Tensor], *, scale: float,
                 before_last_backward: Callable[[], None]) -> torch.Tensor:
        total = self.inner(micro_batches, scale=scale, before_last_backward=before_last_backward)
        self.pulse.compute_done()
        return total
