"""`megatron-hpc debug RUN`: the Python stacks of every rank of a running job, in one report.

On SLURM one `srun --overlap --jobid J` step runs launch/stack_dump.py on every node of the
job's current worker step (it shares the job's nodes instead of waiting for free ones): with hot spares
(launch.spare_nodes) the allocation holds more nodes than the step, and after an in-job restart the step
runs on other nodes than the first one, so the nodes come from SLURM's list of the job's running steps,
not from the allocation. A local run is dumped on this machine. Ranks are then grouped by where their
main thread is: in a hang, the ranks that are somewhere else than the others are usually the culprits.
The report is written to `<run_dir>/debug/stacks-<time>.txt`. No torch import.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_hpc.launch.env_checks import remove_slurm_vars
from megatron_hpc.launch.run_status import read_status
from megatron_hpc.launch.slurm_nodes import hostnames
from megatron_hpc.launch.stack_dump import RankStacks, collect

from megatron_hpc.debug_stacks import DEBUG_DIR
from megatron_hpc.errors import LaunchError
from megatron_hpc.warm_protocol import WARM_STEP_NAME

DEBUG_STEP_NAME = "megatron-hpc-debug"
_NOT_WORKER_STEPS = frozenset({"batch", "extern", "interactive", DEBUG_STEP_NAME, WARM_STEP_NAME})
"""Step names that never run trainer workers: SLURM's own steps and debug's (which may run beside a worker step)."""
_PY_SPY_THREAD = re.compile(r'^Thread \S+ \([^)]*\): "MainThread"')
_FAULTHANDLER_CURRENT = re.compile(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):")


@dataclass(kw_only=True, slots=True)
class DebugReport:
    run_dir: str
    job_id: str | None
    world_size: int
    ranks: list[RankStacks] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    node_errors: list[str] = field(default_factory=list)
    groups: list[dict] = field(default_factory=list)
    """[{"frame": innermost frame of the main thread, "ranks": [...]}], largest group first."""
    report_file: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def innermost_frame(stacks: str) -> str:
    """The main thread's innermost frame, from py-spy's or faulthandler's output ("?" if not found)."""
    lines = stacks.splitlines()
    for i, line in enumerate(lines):
        if _PY_SPY_THREAD.match(line) or _FAULTHANDLER_CURRENT.match(line):
            for frame in lines[i + 1:]:
                if frame.strip():
                    return frame.strip()
    for line in lines:  # no main thread marked: the first frame of the first thread
        if line.startswith(("  File ", "    ")):
            return line.strip()
    return "?"


def group_ranks(ranks: list[RankStacks]) -> list[dict]:
    groups: dict[str, list[int]] = {}
    for item in ranks:
        key = innermost_frame(item.stacks) if not item.error else f"(no stacks: {item.error})"
        groups.setdefault(key, []).append(item.rank)
    return [{"frame": frame, "ranks": sorted(r)} for frame, r in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def worker_step(steps: str) -> tuple[str, str] | None:
    """(step id, node list) of the newest worker step in `squeue --steps -h -o '%i %j %N'` output, or None.

    The in-job driver numbers its steps upwards, so the highest step id is the one running now (a failed step
    may still be listed while it completes)."""
    best: tuple[int, str, str] | None = None
    for line in steps.splitlines():
        fields = line.split()
        if len(fields) != 3 or "." not in fields[0]:
            continue
        step_id, name, nodelist = fields
        number = step_id.rsplit(".", 1)[1]
        if name in _NOT_WORKER_STEPS or not number.isdigit():
            continue  # batch, extern and interactive steps have names instead of numbers too
        if best is None or int(number) > best[0]:
            best = (int(number), step_id, nodelist)
    return (best[1], best[2]) if best else None


def current_step_nodes(job_id: str) -> tuple[str, ...]:
    """The nodes of the job's running worker step (empty when SLURM lists none)."""
    try:
        proc = subprocess.run(["squeue", "--steps", f"--jobs={job_id}", "-h", "-o", "%i %j %N"],
                              capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    found = worker_step(proc.stdout) if proc.returncode == 0 else None
    return hostnames(found[1]) if found else ()


def _collect_slurm(run_dir: Path, *, job_id: str, nodes: tuple[str, ...], method: str,
                   timeout_s: float) -> tuple[list[str], list[str]]:
    """The JSON lines of every node's stack_dump, and the stderr tails of nodes that wrote any. Each task writes
    its own files in the run folder (shared by the nodes): through srun's one stdout, long lines of two nodes can
    interleave and turn into garbage."""
    parts = run_dir / DEBUG_DIR / f".parts-{os.getpid()}-{time.time_ns()}"
    try:
        parts.mkdir(parents=True)
    except OSError as exc:
        raise LaunchError(f"cannot create {parts} for the nodes' reports ({exc.strerror}); debug needs the run "
                          "folder writable from here and from the nodes") from None
    cmd = ["srun", "--overlap", f"--jobid={job_id}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
           "--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--job-name={DEBUG_STEP_NAME}", f"--output={parts}/%t.jsonl",
           f"--error={parts}/%t.err", sys.executable, "-m", "megatron_hpc.launch.stack_dump", "--run-dir",
           str(run_dir), "--method", method, "--timeout", str(timeout_s)]
    env = dict(os.environ)
    remove_slurm_vars(env)  # from inside another allocation, its SLURM_* would redirect this step
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 120, env=env, check=False)
        lines = [line for part in sorted(parts.glob("*.jsonl")) for line in part.read_text().splitlines()]
        errors = [f"task {part.stem}: {' | '.join(text.strip().splitlines()[-3:])[:400]}"
                  for part in sorted(parts.glob("*.err")) if (text := part.read_text(errors="replace")).strip()]
    except FileNotFoundError as exc:
        if exc.filename == "srun":
            raise LaunchError("srun is not on PATH; run `megatron-hpc debug` on a login node of the cluster") from None
        raise LaunchError(f"a node's report vanished from {parts} ({exc}); run debug again") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`srun --overlap --jobid={job_id}` did not finish within {timeout_s + 120:.0f} s; "
                          "the nodes may be unreachable (check `scontrol show job`)") from None
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    if proc.returncode != 0 and not lines:
        why = "; ".join(errors) or proc.stderr.strip()[:400]
        raise LaunchError(f"`srun --overlap --jobid={job_id}` failed ({why}); is the job still running?")
    return lines, errors


def debug_run(run_dir: Path, *, method: str = "auto", timeout_s: float = 20.0) -> DebugReport:
    status = read_status(run_dir)
    plan = status.plan
    world = int(plan.get("num_nodes", 1)) * int(plan.get("workers_per_node", 1))
    report = DebugReport(run_dir=str(run_dir), job_id=None, world_size=world)
    if status.cluster == "slurm":
        running = [j for j in status.jobs if j.state == "RUNNING"]
        if not running:
            states = ", ".join(f"{j.phase} {j.job_id} {j.state}" for j in status.jobs) or "no jobs recorded"
            raise LaunchError(f"no job of {run_dir} is RUNNING ({states}); debug collects the stacks of a "
                              "running job (see `megatron-hpc logs` for one that ended)")
        report.job_id = running[-1].job_id
        nodes = current_step_nodes(report.job_id)
        if not nodes:
            raise LaunchError(f"job {report.job_id} of {run_dir} runs no worker step now (an in-job restart "
                              "between steps, or the job is starting or ending); run debug again in a few seconds")
        lines, report.node_errors = _collect_slurm(run_dir, job_id=report.job_id, nodes=nodes, method=method,
                                                   timeout_s=timeout_s)
        items = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # srun's own chatter
            if "rank" in record:
                items.append(RankStacks(**record))
            elif record.get("error"):
                report.node_errors.append(f"{record.get('host', '?')}: {record['error']}")
    else:
        items = collect(run_dir, method=method, timeout_s=timeout_s)
        if not items:
            raise LaunchError(f"no trainer worker of {run_dir} runs on this machine; debug collects the "
                              "stacks of a running job")
    by_rank: dict[int, RankStacks] = {}
    for item in items:  # several simulated nodes on one machine all see every rank
        if item.rank not in by_rank or (by_rank[item.rank].error and not item.error):
            by_rank[item.rank] = item
    report.ranks = [by_rank[r] for r in sorted(by_rank)]
    report.missing = [r for r in range(world) if r not in by_rank]
    report.groups = group_ranks(report.ranks)
    out = run_dir / DEBUG_DIR / time.strftime("stacks-%Y%m%d-%H%M%S.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(format_report(report))
    report.report_file = str(out)
    return report


def _ranges(ranks: list[int]) -> str:
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def format_report(report: DebugReport) -> str:
    got = len(report.ranks)
    head = [f"megatron-hpc debug: {report.run_dir}" + (f" (job {report.job_id})" if report.job_id else ""),
            f"stacks of {got}/{report.world_size} ranks" +
            (f"; missing ranks {_ranges(report.missing)}" if report.missing else ""),
            "", "where the main threads are:"]
    head += [f"  ranks {_ranges(g['ranks']):<12} {g['frame']}" for g in report.groups]
    head += [f"  node: {e}" for e in report.node_errors]
    body = []
    for item in report.ranks:
        body += ["", f"===== rank {item.rank} (host {item.host}, pid {item.pid}, {item.method}) ====="]
        body += [item.stacks.rstrip()] if item.stacks else []
        body += [f"(error: {item.error})"] if item.error else []
    return "\n".join(head + body) + "\n"
