"""Each trainer rank's heartbeat: one fixed-width line, `<run>/heartbeat/rank-<R>`, rewritten in place.

The trainer (train/pulse.py) writes it at every phase change of a step; the node watchdog
(launch/watchdog.py) reads its node's ranks to tell a hang from progress, and every rank's when it reports
one. The line is rewritten with one os.pwrite at offset 0 on a descriptor opened once: no open, close,
rename or flush on the step's path, and always the same length, so a reader sees the old line or the new
one (a write of one short buffer to a regular file is not split by Linux). No collective, no torch.

    <iteration> <phase> <wall time> <last step s> <pid> <host>

iteration is the step being computed (1-based, as the iteration line counts) during forward-backward and
optimizer, and the step just finished in log, eval and save. last step s is 0 until a step past the warm-up
was timed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.run_folder import HEARTBEAT_DIR

PHASES = ("init", "load", "forward-backward", "optimizer", "log", "eval", "save", "done")
"""In the order a rank passes them within one iteration: where a rank is, as a position (watchdog.py)."""
LONG_PHASES = frozenset({"init", "load", "eval", "save", "done"})
"""Phases not bounded by a step (model build, checkpoint I/O, evaluation, the end of the run): a rank in one is not
hung until the collective timeout says so."""
_HOST_WIDTH = 64


HANG_FLOOR_S = 60.0
"""The shortest derived hang timeout: scheduling noise, a slow log step or a GC pause never trips it."""
HANG_STEP_MULTIPLE = 10.0
"""A derived hang timeout is this many measured steps (above the floor)."""


def derive_hang_timeout(*, configured: float | None, measured_step_s: float) -> float:
    """launch.hang_timeout_s, or when unset max(HANG_FLOOR_S, HANG_STEP_MULTIPLE x the measured step)."""
    if configured is not None:
        return configured
    return max(HANG_FLOOR_S, HANG_STEP_MULTIPLE * measured_step_s)


def hang_timeout_problem(*, configured: float | None, measured_step_s: float, iteration: int) -> str | None:
    """The one line refusing a launch.hang_timeout_s shorter than a measured step (every step would look like a
    hang), with the fix; None when it is unset or long enough."""
    if configured is None or measured_step_s <= configured:
        return None
    return (f"launch.hang_timeout_s={configured:g} is shorter than a measured step ({measured_step_s:.2f} s at "
            f"iteration {iteration}); set --set launch.hang_timeout_s={max(HANG_FLOOR_S, 3 * measured_step_s):.0f} "
            "or leave it unset to derive it from the step time")


def heartbeat_file(run_dir: Path, rank: int) -> Path:
    return run_dir / HEARTBEAT_DIR / f"rank-{rank}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Beat:
    """One heartbeat line, parsed."""

    iteration: int
    phase: str
    wall: float
    """time.time() when it was written (the writer's clock)."""
    step_s: float
    """The last timed step's wall time; 0.0 until a step past the warm-up was timed."""
    pid: int
    host: str

    @property
    def position(self) -> tuple[int, int]:
        """Where the rank is: iteration, then the phase's place in PHASES (unknown phases last)."""
        order = PHASES.index(self.phase) if self.phase in PHASES else len(PHASES)
        return self.iteration, order


def format_beat(*, iteration: int, phase: str, wall: float, step_s: float, pid: int, host: str) -> bytes:
    text = f"{iteration:10d} {phase:<16.16s} {wall:17.6f} {step_s:12.6f} {pid:8d} {host[:_HOST_WIDTH]:<{_HOST_WIDTH}}\n"
    return text.encode("ascii", errors="replace")


def parse_beat(data: bytes) -> Beat | None:
    """The beat in a heartbeat file's bytes; None for an empty, partial or foreign one."""
    parts = data.decode("ascii", errors="replace").split()
    if len(parts) != 6:
        return None
    try:
        return Beat(iteration=int(parts[0]), phase=parts[1], wall=float(parts[2]), step_s=float(parts[3]),
                    pid=int(parts[4]), host=parts[5])
    except ValueError:
        return None


def read_beat(run_dir: Path, rank: int) -> Beat | None:
    """Rank `rank`'s last beat; None when it has none (not started) or the file cannot be read."""
    try:
        return parse_beat(heartbeat_file(run_dir, rank).read_bytes())
    except OSError:
        return None


class HeartbeatWriter:
    """This rank's heartbeat file, opened once (truncated: an earlier attempt's line is not this one's)."""

    def __init__(self, run_dir: Path, rank: int, *, host: str):
        path = heartbeat_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.host, self.pid = host, os.getpid()
        # format_beat's line, with what never changes formatted once: a beat is on the step's path (about 2 us
        # instead of 6 for the whole f-string; benchmarks/heartbeat_overhead.py).
        self._phases = {name: f" {name:<16.16s} ".encode("ascii") for name in PHASES}
        self._tail = f" {self.pid:8d} {host[:_HOST_WIDTH]:<{_HOST_WIDTH}}\n".encode("ascii", errors="replace")

    def beat(self, phase: str, iteration: int, *, step_s: float = 0.0) -> None:
        os.pwrite(self.fd, b"%10d%s%17.6f %12.6f%s" % (iteration, self._phases[phase], time.time(), step_s, self._tail),
                  0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
