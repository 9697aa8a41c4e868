"""Where a run stands: its jobs' SLURM state and the trainer's progress, read from the run folder.

SLURM state comes from `scontrol show job` while the controller remembers the job (it also gives
the requeue count), then from `sacct`; when neither answers (no accounting database, and the
controller has forgotten the job), from `attempts.jsonl`, which the node script appends when a phase
ends on node 0; failing that, the state recorded at submit time, marked stale. Progress comes from
`metrics.jsonl`, which the last rank appends; the last checkpoint from the checkpoint tracker.

A file that exists but may not be read (another user's run, a private mode) raises RunAccessError naming it,
never counts as missing: a status built from the files that happened to be readable would be wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_hpc.launch.restart_log import Restart, read_restarts

from megatron_hpc.checkpoint.store import parse_tracker, tracker_file
from megatron_hpc.errors import ACCESS_FIX, LaunchError, access_problem
from megatron_hpc.run_folder import (
    ATTEMPTS_FILE,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    PLAN_FILE,
    STRAGGLERS_FILE,
    SUBMISSION_FILE,
    AttemptRecord,
    IterationRecord,
    SubmissionRecord,
    parse_attempts,
    read_metrics,
)

ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


@dataclass(kw_only=True, slots=True)
class JobStatus:
    phase: str
    job_id: str
    state: str
    nodes: str = ""
    restarts: int = 0
    source: str = "submit"
    """Where the state came from: scontrol, sacct, or submit (the record written at submit time)."""


@dataclass(kw_only=True, slots=True)
class Progress:
    phase: str
    iteration: int
    train_iters: int | None
    lm_loss: float
    tokens_per_s: float
    eta_s: float | None


@dataclass(kw_only=True, slots=True)
class RunStatus:
    run_dir: str
    recipe: str
    cluster: str
    plan: dict[str, Any]
    jobs: list[JobStatus] = field(default_factory=list)
    progress: Progress | None = None
    last_checkpoint: str | None = None
    """Folder of the newest complete checkpoint, per the tracker."""
    spare_nodes: int = 0
    """launch.spare_nodes: hot spares the run phase holds beside its nodes."""
    restarts: list[Restart] = field(default_factory=list)
    """In-job restarts (restarts.jsonl), each with its reason, the nodes lost and its cost."""
    nodes_lost: list[str] = field(default_factory=list)
    """Every node an in-job restart left out, in order."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """The nodes named slow now (stragglers.json's "nodes": node, ranks, compute_s, wait_s, ratio); [] when none."""
    straggler_check: dict[str, Any] | None = None
    """The rest of stragglers.json (updated_at, iteration, threshold, window, median_compute_s); None before the
    trainer's first timed log."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RunAccessError(LaunchError):
    """A file or folder of a run that exists but may not be read by this process."""

    def __init__(self, path: Path, exc: OSError):
        super().__init__(f"cannot read {path}: {access_problem(path, exc)}; {ACCESS_FIX}")
        self.path = path
        self.reason = exc.strerror or type(exc).__name__
        """The system's words ("Permission denied"), for a table cell."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFolder:
    """One folder of a runs root: a run (it holds plan.json), or a folder that may hold runs but cannot be read."""

    path: Path
    mtime: float
    """Of submission.json, else plan.json, else (unreadable) of the folder itself."""
    submitted: bool = False
    """It holds submission.json (a dry run does not)."""
    problem: str | None = None
    """Why it cannot be read ("Permission denied"); None for a readable run."""
    message: str | None = None
    """The whole sentence: which file or folder refuses, its mode and owner, and the fix."""


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _unreadable(folder: Path, exc: OSError, *, mtime: float, file: Path | None = None) -> RunFolder:
    return RunFolder(path=folder, mtime=mtime, problem=exc.strerror or type(exc).__name__,
                     message=str(RunAccessError(file or folder, exc)))


def scan_runs(runs_root: Path) -> list[RunFolder]:
    """The run folders `<runs_root>/<recipe>/<stamp>/`, and `<runs_root>/<name>/` (`submit --out runs/NAME`), newest
    first; folders that cannot be read are listed (with their problem) rather than silently left out, as a glob
    would."""
    try:
        recipes = sorted(os.scandir(runs_root), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise RunAccessError(runs_root, exc) from None
    found: list[RunFolder] = []
    for recipe in recipes:
        if recipe.name.startswith(".") or not recipe.is_dir():
            continue
        if (Path(recipe.path) / PLAN_FILE).is_file():  # a run folder itself (--out runs/NAME): no runs inside
            _add_run(found, recipe)
            continue
        try:
            runs = list(os.scandir(recipe.path))
        except OSError as exc:
            found.append(_unreadable(Path(recipe.path), exc, mtime=_mtime(recipe)))
            continue
        for run in runs:
            if not run.name.startswith(".") and run.is_dir():
                _add_run(found, run)
    return sorted(found, key=lambda r: r.mtime, reverse=True)


def _add_run(found: list[RunFolder], entry: os.DirEntry) -> None:
    """Append `entry` to `found` when it is a run folder (it holds the plan), or one that cannot be read."""
    folder = Path(entry.path)
    try:
        stamp = (folder / PLAN_FILE).stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return  # not a run folder
    except OSError as exc:
        found.append(_unreadable(folder, exc, mtime=_mtime(entry), file=folder / PLAN_FILE))
        return
    try:
        stamp, submitted = (folder / SUBMISSION_FILE).stat().st_mtime, True
    except OSError:
        submitted = False
    found.append(RunFolder(path=folder, mtime=stamp, submitted=submitted))


def find_run_dir(spec: str | None, *, runs_root: Path = Path("runs")) -> Path:
    """A run folder from a path, a job id, or (None) the most recent submitted run under runs_root."""
    if spec and os.path.isdir(spec):
        path = Path(spec)
        try:
            (path / PLAN_FILE).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise LaunchError(f"{path} is not a run folder (no {PLAN_FILE}); pass the folder submit printed") from None
        except OSError as exc:
            raise RunAccessError(path / PLAN_FILE, exc) from None
        return path.resolve()
    candidates = [r for r in scan_runs(runs_root) if r.submitted or r.problem]
    if spec is None:
        if not candidates:
            raise LaunchError(f"no runs under {runs_root.resolve()}; pass a run folder or a job id")
        newest = candidates[0]
        if newest.problem:  # the most recent run is this one; showing an older one instead would mislead
            try:
                (newest.path / PLAN_FILE).stat()
            except OSError as exc:
                raise RunAccessError(newest.path / PLAN_FILE, exc) from None
        return newest.path.resolve()
    unreadable = [r.path for r in candidates if r.problem]
    for run in candidates:
        if run.problem:
            continue
        try:
            jobs = SubmissionRecord.from_json(json.loads(_read_text(run.path / SUBMISSION_FILE) or "{}")).jobs
        except RunAccessError as exc:
            unreadable.append(exc.path)
            continue
        except json.JSONDecodeError:
            continue
        if any(j.job_id == spec for j in jobs):
            return run.path.resolve()
    skipped = f"; {len(unreadable)} could not be read ({unreadable[0]}, ...)" if unreadable else ""
    # A run submitted with --out (or from another folder) is not under runs/: only its folder finds it.
    raise LaunchError(f"{spec!r} is neither a run folder nor a job id of a run under {runs_root.resolve()}"
                      f"{skipped}; pass the run folder submit printed, or run this where submit ran")


def read_status(run_dir: Path) -> RunStatus:
    submission = SubmissionRecord.from_json(_read_json(run_dir / SUBMISSION_FILE) or {})
    plan = _read_json(run_dir / PLAN_FILE) or {}
    config = _read_json(run_dir / CONFIG_FILE) or {}
    status = RunStatus(run_dir=str(run_dir), recipe=plan.get("recipe", config.get("name", "?")),
                       cluster=submission.cluster, plan=plan)
    attempts = parse_attempts(_read_text(run_dir / ATTEMPTS_FILE) or "")
    for job in submission.jobs:
        entry = JobStatus(phase=job.phase, job_id=job.job_id, state=job.state)
        if status.cluster == "slurm":
            _refresh_from_slurm(entry)
            if entry.source.startswith("submit"):
                _refresh_from_attempts(entry, attempts)
        elif status.cluster == "k8s":
            _refresh_from_k8s(entry, namespace=(config.get("k8s") or {}).get("namespace") or "default")
        status.jobs.append(entry)
    # A k8s run's folder is on the claim; readable here where the claim is mounted at the pods' path.
    trained_in = _k8s_run_folder(run_dir, config) if status.cluster == "k8s" else run_dir
    status.progress = read_progress(trained_in, train_iters=config.get("train", {}).get("num_steps"))
    if status.progress is not None and status.jobs and all(j.state in ENDED_STATES for j in status.jobs):
        status.progress.eta_s = None  # a cancelled or failed run has no time left to estimate, only a resume would
    save = (config.get("checkpoint") or {}).get("save")
    status.last_checkpoint = last_checkpoint(Path(save).expanduser() if save else trained_in / CHECKPOINT_DIR)
    status.spare_nodes = int((config.get("launch") or {}).get("spare_nodes") or 0)
    status.restarts = read_restarts(trained_in)
    status.nodes_lost = list(dict.fromkeys(n for r in status.restarts for n in r.nodes_lost))
    check = _read_json(trained_in / STRAGGLERS_FILE)
    if isinstance(check, dict):
        status.stragglers = list(check.pop("nodes", None) or [])
        status.straggler_check = check
    return status


def last_checkpoint(root: Path) -> str | None:
    """The folder the tracker names, when it exists (the trainer writes the tracker last)."""
    text = _read_text(tracker_file(root))
    if text is None:
        return None
    named = parse_tracker(text)
    if named is None:
        return None
    folder = root / (f"iter_{named:07d}" if isinstance(named, int) else named)
    return str(folder) if folder.is_dir() else None


_ACTION_STATE = {"done": "COMPLETED", "fail": "FAILED", "requeue": "REQUEUED"}


def _refresh_from_attempts(entry: JobStatus, attempts: list[AttemptRecord]) -> None:
    """The last phase end node 0 recorded for this job, when SLURM has nothing to say."""
    mine = [a for a in attempts if str(a.job_id) == entry.job_id and a.phase == entry.phase]
    if mine:
        entry.state = _ACTION_STATE.get(mine[-1].action, entry.state)
        entry.restarts = max(int(a.attempt or 0) for a in mine)
        entry.source = f"logs ({ATTEMPTS_FILE})"


def read_progress(run_dir: Path, *, train_iters: int | None) -> Progress | None:
    path = run_dir / METRICS_FILE
    try:
        rows = read_metrics(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise RunAccessError(path, exc) from None
    trained = [r for r in rows if isinstance(r, IterationRecord)]  # validation rows carry no throughput
    if not trained:
        return None
    last = trained[-1]
    total = train_iters if last.phase == "run" else None
    eta = max(0, total - last.iteration) * last.elapsed_ms / 1000.0 if total and last.elapsed_ms else None
    return Progress(phase=last.phase, iteration=last.iteration, train_iters=total, lm_loss=last.lm_loss,
                    tokens_per_s=last.tokens_per_s, eta_s=eta)


def _read_text(path: Path) -> str | None:
    """The file's text; None when it is not there; RunAccessError when it is there but cannot be read."""
    try:
        return path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise RunAccessError(path, exc) from None


def _read_json(path: Path) -> dict[str, Any] | None:
    text = _read_text(path)
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def slurm_job_state(job_id: str, *, fallback: str) -> str:
    """A job's state word from scontrol, then sacct; `fallback` when SLURM does not answer."""
    entry = JobStatus(phase="", job_id=job_id, state=fallback)
    _refresh_from_slurm(entry)
    return entry.state


def _refresh_from_slurm(entry: JobStatus) -> None:
    shown = _run(["scontrol", "show", "job", "-o", entry.job_id])
    if shown:
        fields = dict(tok.split("=", 1) for tok in shown.split() if "=" in tok)
        entry.state = fields.get("JobState", entry.state)
        entry.nodes = fields.get("NodeList", "") if fields.get("NodeList") != "(null)" else ""
        entry.restarts = int(fields.get("Restarts", "0") or 0)
        entry.source = "scontrol"
        return
    acct = _run(["sacct", "-j", entry.job_id, "-X", "--noheader", "--parsable2", "-o", "State,NodeList"])
    if acct and acct.strip():
        state, _, nodes = acct.strip().splitlines()[-1].partition("|")
        entry.state, entry.nodes, entry.source = state.split()[0], nodes, "sacct"
        return
    entry.source = "submit (SLURM did not answer)"


def _k8s_run_folder(run_dir: Path, config: dict[str, Any]) -> Path:
    from megatron_hpc.launch.k8s_objects import pod_run_dir

    from megatron_hpc.config.loader import from_dict
    from megatron_hpc.config.schema import K8sConfig

    k8s = from_dict(K8sConfig, config.get("k8s") or {}, where="k8s")
    return Path(pod_run_dir(k8s, recipe=str(config.get("name", "?")), run_id=run_dir.name))


def _refresh_from_k8s(entry: JobStatus, *, namespace: str) -> None:
    """The PyTorchJob's or Job's state from the API of the current kube context (never run against a cluster)."""
    from megatron_hpc.launch import k8s_api

    try:
        k8s_api.load_kube_config()
    except LaunchError:
        entry.source = "submit (no kube context)"
        return
    entry.state, entry.source = k8s_api.job_state(entry.job_id, namespace=namespace), "kubernetes"


def format_status(status: RunStatus) -> str:
    plan = status.plan
    lines = [f"run       {status.run_dir}",
             f"recipe    {status.recipe} on {plan.get('num_nodes', '?')} x {plan.get('platform', '?')} "
             f"(TP {plan.get('tensor_parallel', '?')} x DP {plan.get('data_parallel', '?')}), {status.cluster}"]
    for job in status.jobs:
        extra = f"  nodes {job.nodes}" if job.nodes else ""
        extra += f"  requeued {job.restarts}x" if job.restarts else ""
        lines.append(f"{job.phase:<9} job {job.job_id}  {job.state}{extra}")
    p = status.progress
    if p is None:
        lines.append("progress  no step logged yet")
    else:
        total = f"/{p.train_iters}" if p.train_iters else ""
        eta = f" | ETA {_duration(p.eta_s)}" if p.eta_s is not None else ""
        lines.append(f"progress  {p.phase} iteration {p.iteration}{total} | lm loss {p.lm_loss:.4f} | "
                     f"{p.tokens_per_s:,.0f} tokens/s{eta}")
    lines.append(f"checkpoint {status.last_checkpoint or 'none yet'}")
    if status.stragglers:
        lines.append("stragglers " + ", ".join(f"{n.get('node')} {n.get('ratio', 0):.2f}x the median node"
                                               for n in status.stragglers))
    lines += _restart_lines(status)
    return "\n".join(lines)


def _restart_lines(status: RunStatus) -> list[str]:
    """Spares and in-job restarts; nothing for a run without spares."""
    lines = []
    if status.spare_nodes:
        # Not all "lost": a hang or `restart --exclude` leaves out a node that still runs; say why for each.
        why = {n: r.reason for r in reversed(status.restarts) for n in r.nodes_lost}
        lost = ("; nodes left out: " + ", ".join(f"{n} ({why[n]})" if n in why else n for n in status.nodes_lost)
                if status.nodes_lost else "")
        lines.append(f"spares    {status.spare_nodes} hot spare node(s), {len(status.restarts)} in-job "
                     f"restart(s){lost}")
    for r in status.restarts:
        cost = f"cost {r.cost_s:.1f} s" if r.cost_s is not None else "no step logged since"
        lost = f" without {','.join(r.nodes_lost)}" if r.nodes_lost else ""
        lines.append(f"restart   job {r.job_id} step {r.step}: {r.reason}{lost}, now on {','.join(r.nodes)}; {cost}")
    return lines


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def cancel_run(status: RunStatus) -> list[str]:
    """scancel every job of the run that has not ended; returns the ids cancelled."""
    if status.cluster == "unknown" and not status.jobs:
        # No submission.json: `submit --dry-run` (SLURM or k8s) wrote the folder and queued or applied nothing.
        raise LaunchError(f"{status.run_dir} was never submitted (no submission.json: a --dry-run folder, or a "
                          "submit that stopped before queueing); there is nothing to cancel")
    if status.cluster not in ("slurm", "k8s"):
        raise LaunchError(f"{status.run_dir} ran with --cluster {status.cluster}; stop a local run with Ctrl-C")
    ids = [j.job_id for j in status.jobs if j.state not in ENDED_STATES]
    if status.cluster == "k8s":
        from megatron_hpc.launch import k8s_api

        config = _read_json(Path(status.run_dir) / CONFIG_FILE) or {}
        k8s_api.cancel_jobs(ids, namespace=(config.get("k8s") or {}).get("namespace") or "default")
        return ids
    if ids:
        proc = subprocess.run(["scancel", *ids], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise LaunchError(f"scancel {' '.join(ids)} failed", stderr_tail=proc.stderr[-500:])
    return ids
