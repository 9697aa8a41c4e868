"""The node watchdog: tear a hung step down within minutes, stacks and a report first.

node.sh starts it in the background beside torchrun in the run phase, on every node (a SLURM node, the local
executor, a Kubernetes pod):

    python -m megatron_hpc.launch.watchdog --run-dir RUN --node-rank K --nproc-per-node N --job-id J \
        --parent-pid PID

It polls this node's ranks' heartbeats (megatron_hpc/heartbeat.py). When none of them moved for the hang
timeout, it collects the Python stacks of this node's workers (launch/stack_dump.py: py-spy, else SIGUSR1 to
faulthandler; a stopped process answers no signal, so its /proc state is recorded instead) into
`<run>/debug/hang-<stamp>-<host>.txt`, writes `<run>/hangs/<stamp>-<host>.json` naming the ranks that were not
where the others were, and kills this node's workers: torchrun fails, node.sh exits non-zero and the job
restarts (in the job with spares, else requeued; a Kubernetes pod restarts under OnFailure).

Only this node's ranks decide (every rank blocks once one hangs, and the local files are never stale over
NFS); the report reads every rank's beat. The timeout is launch.hang_timeout_s, or when unset
max(60 s, 10 measured steps); before a step past the warm-up was timed, and while any rank is in a long phase
(init, load, eval, save), it is launch.collective_timeout_s, after which the process group fails anyway.

The decisions (timeout, hung or not, suspects) are pure functions; main() does the I/O. No torch import.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.launch.debug_run import DebugReport, format_report, group_ranks
from megatron_hpc.launch.process_alive import pid_alive
from megatron_hpc.launch.stack_dump import (
    RankStacks,
    Worker,
    choose_method,
    dump_with_py_spy,
    dump_with_signal,
    find_workers,
)

from megatron_hpc.heartbeat import LONG_PHASES, Beat, derive_hang_timeout, read_beat
from megatron_hpc.run_folder import CONFIG_FILE, DEBUG_DIR, HANGS_DIR, PLAN_FILE, read_json, write_json

HANG_EXIT = 3
"""The watchdog's exit code after it tore a hung step down (node.sh then fails the phase)."""
CLOCK_SKEW_S = 2.0
"""A beat written this long before the watchdog started is an earlier attempt's (node clocks agree to well
under this under NTP)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankView:
    """One rank as the watchdog sees it."""

    rank: int
    beat: Beat | None
    """None: no beat of this attempt yet."""
    age_s: float
    """Since the watchdog last saw its beat change (or since the watchdog started); NaN for another node's rank
    (None in the report)."""
    state: str | None = None
    """Its process's /proc state ("R (running)", "T (stopped)"), for this node's ranks; None elsewhere."""


# ------------------------------------------------------------------------------------------ pure decisions


def hang_timeout(beats: list[Beat], *, configured: float | None, collective_timeout_s: float) -> float:
    """How long no local rank may move before the step counts as hung."""
    if not beats or any(b.phase in LONG_PHASES for b in beats):
        return float(collective_timeout_s)
    measured = [b.step_s for b in beats if b.step_s > 0]
    if not measured:  # warm-up (compilation, first allocations): the process group's timeout covers it
        return float(collective_timeout_s)
    return derive_hang_timeout(configured=configured, measured_step_s=statistics.median(measured))


def is_hung(views: list[RankView], *, timeout_s: float) -> bool:
    """No rank of this attempt moved for timeout_s; False before any rank beat (a start that fails is
    torchrun's and the rendezvous timeout's to report)."""
    started = [v for v in views if v.beat is not None]
    return bool(started) and min(v.age_s for v in views) >= timeout_s


def is_stopped(state: str | None) -> bool:
    """A /proc state of a process that cannot run: stopped (T), stopped by a tracer (t), or a zombie (Z)."""
    return bool(state) and state[0] in "TtZ"


def suspects(views: list[RankView]) -> list[int]:
    """The ranks that were not where the others were.

    A process that cannot run is the suspect. Else the ranks outside the largest group of equal positions
    (iteration, phase); when no group is largest, the ranks furthest behind; a rank without a beat of this
    attempt is behind every other. All ranks at one position name nobody.
    """
    stopped = [v.rank for v in views if is_stopped(v.state)]
    if stopped:
        return sorted(stopped)
    missing = [v.rank for v in views if v.beat is None]
    groups: dict[tuple[int, int], list[int]] = {}
    for v in views:
        if v.beat is not None:
            groups.setdefault(v.beat.position, []).append(v.rank)
    if len(groups) <= 1:
        return sorted(missing) if groups else []
    sizes = sorted((len(r) for r in groups.values()), reverse=True)
    if sizes[0] > sizes[1]:
        largest = max(groups.values(), key=len)
        behind = [r for ranks in groups.values() if ranks is not largest for r in ranks]
    else:
        behind = groups[min(groups)]
    return sorted(missing + behind)


def hang_report(views: list[RankView], *, job_id: str, timeout_s: float, detected_at: float,
                stacks: list[str]) -> dict:
    """The hangs/<stamp>-<host>.json record."""
    named = suspects(views)
    ranks = {str(v.rank): {"iteration": v.beat.iteration if v.beat else None,
                           "phase": v.beat.phase if v.beat else None,
                           "age_s": round(v.age_s, 3) if math.isfinite(v.age_s) else None,
                           "host": v.beat.host if v.beat else None, "state": v.state} for v in views}
    nodes = sorted({v.beat.host for v in views if v.rank in named and v.beat is not None})
    return {"detected_at": detected_at, "job_id": job_id, "timeout_s": timeout_s, "ranks": ranks,
            "suspect_ranks": named, "suspect_nodes": nodes, "stacks": stacks}


# ------------------------------------------------------------------------------------------------- I/O


def proc_state(pid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The State line of /proc/<pid>/status ("T (stopped)"); None when the process is gone."""
    try:
        for line in (proc_root / str(pid) / "status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


class Watch:
    """This node's ranks' beats over time: when each last changed, on this machine's monotonic clock."""

    def __init__(self, run_dir: Path, ranks: list[int], *, started_wall: float):
        self.run_dir, self.ranks, self.started_wall = run_dir, ranks, started_wall
        self.since = time.monotonic()
        self.last: dict[int, tuple[Beat | None, float]] = {r: (None, self.since) for r in ranks}

    def fresh(self, rank: int) -> Beat | None:
        """This attempt's beat: its writer runs here, and it was not written before the watchdog started. An
        earlier step's last beat fails the first test whatever its time says: after an in-job restart it may
        come from another machine whose clock runs ahead, or from this one within CLOCK_SKEW_S of the start."""
        beat = read_beat(self.run_dir, rank)
        if beat is None or not pid_alive(beat.pid):
            return None
        return beat if beat.wall >= self.started_wall - CLOCK_SKEW_S else None

    def poll(self) -> list[RankView]:
        now = time.monotonic()
        views = []
        for rank in self.ranks:
            beat = self.fresh(rank)
            seen, changed = self.last[rank]
            if beat != seen:
                self.last[rank] = (beat, now)
                changed = now
            views.append(RankView(rank=rank, beat=beat, age_s=now - changed))
        return views


def _dump(worker: Worker, state: str | None, *, run_dir: Path, method: str, host: str) -> RankStacks:
    """One worker's stacks; a stopped one is read by py-spy without suspending it, or only its state is said."""
    if is_stopped(state):
        if method == "py-spy":
            text, error = dump_with_py_spy(worker, timeout_s=20.0, nonblocking=True)
        else:
            text, error = "", f"process state {state}: a stopped process answers no signal (no stacks)"
    elif method == "py-spy":
        text, error = dump_with_py_spy(worker, timeout_s=20.0)
    else:
        text, error = dump_with_signal(worker, run_dir, timeout_s=10.0)
    return RankStacks(rank=worker.rank, pid=worker.pid, host=host, method=method, stacks=text, error=error)


def tear_down(run_dir: Path, views: list[RankView], *, job_id: str, timeout_s: float, world_size: int) -> Path:
    """Stacks, report, then SIGKILL this node's workers (also when the report fails); returns the report's path."""
    workers = find_workers(run_dir, node_name=os.environ.get("SLURMD_NODENAME"))
    try:
        return _report(run_dir, views, workers, job_id=job_id, timeout_s=timeout_s, world_size=world_size)
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)  # a stopped process dies of SIGKILL too


def _report(run_dir: Path, views: list[RankView], workers: list[Worker], *, job_id: str, timeout_s: float,
            world_size: int) -> Path:
    host, stamp = socket.gethostname(), time.strftime("%Y%m%d-%H%M%S")
    mine = {w.rank: w for w in workers}
    states = {w.rank: proc_state(w.pid) for w in workers}
    views = [RankView(rank=v.rank, beat=v.beat, age_s=v.age_s, state=states.get(v.rank)) for v in views]
    method = choose_method("auto")
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(workers)))) as pool:  # 8 py-spy dumps at once, not 8 s
        dumped = list(pool.map(lambda w: _dump(w, states.get(w.rank), run_dir=run_dir, method=method, host=host),
                                workers))
    debug = DebugReport(run_dir=str(run_dir), job_id=job_id, world_size=world_size, ranks=dumped,
                        missing=[v.rank for v in views if v.rank not in mine], groups=group_ranks(dumped))
    stacks = run_dir / DEBUG_DIR / f"hang-{stamp}-{host}.txt"
    stacks.parent.mkdir(parents=True, exist_ok=True)
    said = [f"  rank {w.rank:<6} pid {w.pid:<8} {states.get(w.rank) or 'gone'}" +
            ("  <- stopped: it answers no signal (py-spy reads it without suspending it)"
             if is_stopped(states.get(w.rank)) else "") for w in workers]
    stacks.write_text(format_report(debug) + "\nprocess states (/proc/PID/status):\n" + "\n".join(said) + "\n")
    # Every rank's beat for the report: the others' tell which ranks were not where these were.
    others = [RankView(rank=r, beat=read_beat(run_dir, r), age_s=float("nan")) for r in range(world_size)
              if r not in {v.rank for v in views}]
    report = hang_report(sorted(views + others, key=lambda v: v.rank), job_id=job_id, timeout_s=timeout_s,
                         detected_at=time.time(), stacks=[str(stacks)])
    (run_dir / HANGS_DIR).mkdir(parents=True, exist_ok=True)
    return write_json(run_dir / HANGS_DIR / f"{stamp}-{host}.json", report)


def _launch_settings(run_dir: Path) -> tuple[float | None, float, int]:
    """launch.hang_timeout_s, launch.collective_timeout_s and the world size, from config.json."""
    config = read_json(run_dir / CONFIG_FILE)
    launch = config.get("launch") or {}
    plan = read_json(run_dir / PLAN_FILE)
    world = int(plan.get("num_nodes", 1)) * int(plan.get("workers_per_node", 1))
    configured = launch.get("hang_timeout_s")
    return (None if configured is None else float(configured)), float(launch.get("collective_timeout_s", 1800)), world


def _parent_alive(pid: int | None) -> bool:
    return True if pid is None else pid_alive(pid)


def watch(args: argparse.Namespace) -> int:
    try:
        configured, collective_s, world = _launch_settings(args.run_dir)
    except (OSError, ValueError, TypeError) as exc:  # not a run folder submit wrote: nothing to compare against
        print(f"megatron-hpc: watchdog: not watching {args.run_dir}: {exc}", file=sys.stderr, flush=True)
        return 0
    first = args.node_rank * args.nproc_per_node
    state = Watch(args.run_dir, list(range(first, first + args.nproc_per_node)), started_wall=time.time())
    while _parent_alive(args.parent_pid):
        views = state.poll()
        beats = [v.beat for v in views if v.beat is not None]
        timeout = hang_timeout(beats, configured=configured, collective_timeout_s=collective_s)
        if is_hung(views, timeout_s=timeout):
            # torchrun may exit while the report is written (its workers die): node.sh's TERM must not cut it short.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print(f"megatron-hpc: watchdog: no rank on this node moved for {timeout:.0f} s (launch.hang_timeout_s); "
                  "collecting stacks and tearing the step down", file=sys.stderr, flush=True)
            path = tear_down(args.run_dir, views, job_id=args.job_id, timeout_s=timeout, world_size=world)
            report = read_json(path)
            print(f"megatron-hpc: watchdog: hang report {path}: suspect ranks {report['suspect_ranks']} on "
                  f"{report['suspect_nodes']}; stacks in {report['stacks'][0]}", file=sys.stderr, flush=True)
            return HANG_EXIT
        time.sleep(args.poll if args.poll else min(5.0, max(0.2, timeout / 10)))
    return 0


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(0)  # node.sh ends the watchdog with TERM once torchrun exited


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_hpc.launch.watchdog")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--job-id", default="")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process (node.sh) is gone")
    parser.add_argument("--poll", type=float, default=None, help="seconds between polls (default: timeout / 10)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # SLURM's warning before the time limit is the trainer's to act on
    return watch(args)


if __name__ == "__main__":
    sys.exit(main())

