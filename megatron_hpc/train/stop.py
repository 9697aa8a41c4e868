"""Stopping early and cleanly: SLURM's warning signal, SIGTERM, a stop-request file, or a time budget.

SLURM sends USR2 some time before the time limit (submitit asks for `--signal=USR2@90`) and SIGTERM
on preemption, `scancel` or `scontrol requeue`. A signal reaches the ranks at different moments, so
no rank acts on its own: at a step boundary every rank contributes its local reason to one MAX
all-reduce over the world, and all of them stop after the same iteration, save, and leave the loop.
The node task (launch/node_task.py) then requeues the job when it was SLURM that asked.

The stop-request file covers process trackers that signal only the node task (proctrack/pgid): the
node task writes it on a signal and rank 0 looks for it at each check (one stat).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_hpc.run_markers import (
    STOP_REQUEST_FILE,
    STOPPED_FILE,
    StoppedMarker,
    clear_marker,
    read_marker,
    write_record,
)

HANDLED_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
NODE_TASK_SIGNALS = tuple(s.name.removeprefix("SIG") for s in HANDLED_SIGNALS)
"""What node.sh's traps write into the stop-request file: the same signals, without the SIG prefix."""

_NONE, _BUDGET, _SIGNAL = 0, 1, 2


@dataclass(frozen=True, kw_only=True, slots=True)
class StopDecision:
    iteration: int
    reason: str
    """`signal SIGUSR2`, `signal SIGTERM`, `signal SIGUSR2 on another rank`, `stop request` or `time budget of N
    min`."""


class StopWatch:
    """Installs the signal handlers; `check(iteration)` is collective and says whether to stop now."""

    def __init__(self, *, run_dir: Path | None, time_budget_min: float, check_every: int = 1,
                 is_first_rank: bool, device: torch.device, clock: Callable[[], float] = time.monotonic):
        self.run_dir = run_dir
        self.budget_s = time_budget_min * 60.0
        self.check_every = max(1, check_every)
        self.is_first_rank = is_first_rank
        self.device = device
        self.clock = clock
        self.started = clock()
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        if is_first_rank and run_dir is not None:
            clear_marker(run_dir, STOPPED_FILE)  # this attempt has not stopped (yet)
        if threading.current_thread() is threading.main_thread():  # signal.signal works only there
            for sig in HANDLED_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only a flag: the step in flight finishes, and the collective check decides.
        self.signal_name = signal.Signals(signum).name

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _local(self) -> tuple[int, str, int]:
        """This rank's code, reason and signal number (0 when no signal is behind it)."""
        if self.signal_name:
            return _SIGNAL, f"signal {self.signal_name}", int(signal.Signals[self.signal_name])
        if self.is_first_rank and (requested := self._stop_request()) is not None:
            return _SIGNAL, *requested
        if self.budget_s > 0 and self.clock() - self.started >= self.budget_s:
            return _BUDGET, f"time budget of {self.budget_s / 60:g} min", 0
        return _NONE, "", 0

    def _stop_request(self) -> tuple[str, int] | None:
        """The stop-request file's reason and signal: the one the node task got (node.sh writes USR2 or TERM), which
        often comes before this rank's own copy of it is handled; else `stop request` (the in-job driver's)."""
        marker = None if self.run_dir is None else read_marker(self.run_dir, STOP_REQUEST_FILE)
        if marker is None:
            return None
        name = str(marker.get("signal") or "")
        if name not in NODE_TASK_SIGNALS:
            return "stop request", 0
        return f"signal SIG{name}", int(signal.Signals["SIG" + name])

    def check(self, iteration: int) -> StopDecision | None:
        """Collective over the world on every `check_every`-th iteration; the same answer on every rank."""
        if iteration % self.check_every:
            return None
        code, reason, signum = self._local()
        # The signal's number travels with the code: a rank it has not reached yet still names it.
        flag = torch.tensor([code, signum], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed, agreed_signum = (int(v) for v in flag.tolist())
        if agreed == _NONE:
            return None
        if agreed != code:  # another rank saw it first
            name = f" {signal.Signals(agreed_signum).name}" if agreed_signum else ""
            reason = (f"signal{name} on another rank" if agreed == _SIGNAL
                      else f"time budget of {self.budget_s / 60:g} min")
        return StopDecision(iteration=iteration, reason=reason)


def record_stop(run_dir: Path, decision: StopDecision, *, checkpoint: str | None) -> Path:
    """stopped.json, for the node task (requeue) and for people."""
    return write_record(run_dir, StoppedMarker(iteration=decision.iteration, reason=decision.reason,
                                               checkpoint=checkpoint))
