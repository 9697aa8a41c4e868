"""The run folder contract: its file names, the one atomic JSON writer, and the run spec read and written there.

Everything that reads or writes a run folder (the launcher, requeue, status, report, the trainer) takes its
names from here, and node.sh gets the ones it needs rendered from here, so a file is never called two things.
No torch, no clock beyond time stamps in records; safe for the launcher to import.

    <run>/config.json            resolved config (RunConfig as JSON)
    <run>/plan.json              the plan made from it (plan/planner.py Plan); with config.json the RunSpec
    <run>/cluster.json           the cluster profile it was submitted with
    <run>/compile-fingerprint.json   what shapes the compiled graphs (compile_cache/fingerprint.py)
    <run>/submission.json        job ids of every submission
    <run>/node.sh, <phase>.sbatch, submit.sh   the scripts
    <run>/logs/<phase>-node<K>.log
    <run>/attempts.jsonl         one line per phase end on node 0 (launch/requeue.py)
    <run>/metrics.jsonl          one line per logged iteration (the trainer's last rank)
    <run>/stop-request, stopped.json, fatal.json   markers between node task and trainer (run_markers.py)
    <run>/checkpoints/           default checkpoint folder
    <run>/tensorboard/, debug/, compile-published/, submitit/
    <run>/heartbeat/rank-<R>     each rank's progress, rewritten in place (issue 28: hang detection)
    <run>/hangs/                 one report per node watchdog that tore a hung step down
    <run>/stragglers.json        the nodes named slow (the trainer's last rank)
    <run>/restarts.jsonl         one line per in-job restart (launch/in_job.py)
    <run>/restart-request.json   `megatron-hpc restart RUN --exclude NODE` for the running job
    <run>/step-exits/<job>.<attempt>.<step>/<host>.json   how each node's part of an in-job step ended
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.atomic_write import write_json_atomic, write_text_atomic
from megatron_hpc.errors import ConfigError
from megatron_hpc.plan.spec import RunSpec

CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
CLUSTER_FILE = "cluster.json"
SUBMISSION_FILE = "submission.json"
FINGERPRINT_FILE = "compile-fingerprint.json"
NODE_SCRIPT = "node.sh"
SUBMIT_SCRIPT = "submit.sh"
LOG_DIR = "logs"
ATTEMPTS_FILE = "attempts.jsonl"
METRICS_FILE = "metrics.jsonl"
STOP_REQUEST_FILE = "stop-request"
STOPPED_FILE = "stopped.json"
FATAL_FILE = "fatal.json"
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
DEBUG_DIR = "debug"
PUBLISHED_DIR = "compile-published"
SUBMITIT_DIR = "submitit"
HEARTBEAT_DIR = "heartbeat"
HANGS_DIR = "hangs"
STRAGGLERS_FILE = "stragglers.json"
RESTARTS_FILE = "restarts.jsonl"
RESTART_REQUEST_FILE = "restart-request.json"
TUNE_CANDIDATES_FILE = "tune-candidates.json"
"""What a tune job runs: each candidate's spec and its predicted parts (launcher -> trainer)."""
TUNE_MEASURED_FILE = "tune-measured.json"
"""What a tune job's rank 0 measured: each candidate's step time and each collective's time (trainer -> launcher)."""
TUNE_FILE = "tune.json"
"""What a tune job measured and fitted: every candidate predicted before and after, measured, error."""
TUNE_OVERLAY_FILE = "tune-overlay.txt"
"""The winning layout as --set arguments, one line."""
STEP_EXITS_DIR = "step-exits"


def sbatch_file(phase: str) -> str:
    return f"{phase}.sbatch"


def node_log(run_dir: Path, phase: str, node: int) -> Path:
    return run_dir / LOG_DIR / f"{phase}-node{node}.log"


def node_logs(run_dir: Path, phase: str) -> list[Path]:
    """Every node's log of a phase, by node number."""
    found = (run_dir / LOG_DIR).glob(f"{phase}-node*.log")
    return sorted(found, key=lambda p: int(p.stem.rsplit("node", 1)[1]) if p.stem.rsplit("node", 1)[1].isdigit()
                  else -1)


def write_json(path: Path, data: Any, *, indent: int | None = 2) -> Path:
    """Write a run-folder record atomically (atomic_write.py): a reader (another node, `status`) sees the old
    file or the new one, never half of one."""
    return write_json_atomic(path, data, indent=indent)


def read_json(path: Path) -> Any:
    """The JSON in `path`; OSError and ValueError (json.JSONDecodeError) pass to the caller, who knows the fix."""
    return json.loads(path.read_text())


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line in a single write (atomic enough for short lines, also on NFS)."""
    append_line(path, json.dumps(record))


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline in one write, on a line of its own.

    A writer killed mid-write (SIGKILL is checked between the pages a write spans: the watchdog's, torchrun's or
    SLURM's after KillWait, the OOM killer) leaves a line without its newline. The next attempt's first row would
    be glued to it and lost with it; it starts a new line instead, and readers skip the cut one.
    """
    with path.open("a+b") as fh:  # "a": every write goes to the end, wherever the last byte was read
        end = fh.seek(0, os.SEEK_END)
        cut = False
        if end:
            fh.seek(end - 1)
            cut = fh.read(1) != b"\n"
        fh.write((b"\n" if cut else b"") + line.encode("utf-8") + b"\n")


def write_spec(run_dir: Path, spec: RunSpec) -> None:
    """config.json and plan.json: the two halves of the run spec."""
    write_json(run_dir / CONFIG_FILE, spec.config_json())
    write_json(run_dir / PLAN_FILE, spec.plan.to_json())


def read_spec(run_dir: Path) -> RunSpec:
    """The run spec of a run folder, or ConfigError/PlanError naming the file and the fix."""
    halves = []
    for name in (CONFIG_FILE, PLAN_FILE):
        path = run_dir / name
        try:
            halves.append(read_json(path))
        except FileNotFoundError:
            raise ConfigError(f"{path} not found; is {run_dir} a run folder written by `megatron-hpc submit`?") \
                from None
        except PermissionError:
            raise ConfigError(f"{path} cannot be read (permission denied); run as its owner or fix its "
                              "permissions") from None
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}); re-create the run folder with submit") from None
    return RunSpec.from_json(halves[0], halves[1], where=str(run_dir))


# ------------------------------------------------------------------------------------------ metrics.jsonl rows


@dataclass(frozen=True, kw_only=True, slots=True)
class IterationRecord:
    """One logged training interval: Megatron's iteration line, and (without train_iters and num_nan_iterations)
    one metrics.jsonl row of phase compile or run."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    lr: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float
    tokens_per_s: float
    tflops_per_worker: float
    num_skipped_iterations: int
    num_nan_iterations: int
    phase: str
    loss_scale: float = 1.0
    """fp16 dynamic loss scale after the interval's last step; 1.0 for fp32 and bf16."""
    warmup: bool = False
    """The interval holds one of the first steps of a process: its timing is not representative."""
    applied_lr: float | None = None
    """The LR the interval's last step applied. `lr` is what Megatron logs: its scheduler's LR after that step, the
    next step's (the same after a skipped step)."""

    _NOT_IN_ROW = ("train_iters", "num_nan_iterations")

    def jsonl(self) -> str:
        data = asdict(self)
        for key in self._NOT_IN_ROW:
            data.pop(key)
        # json writes nan/inf as NaN/Infinity, which json.loads reads back.
        return json.dumps(data)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationRecord:
    """One evaluation: a metrics.jsonl row of phase valid, or test (the test split, after the last step)."""

    iteration: int
    consumed_samples: int
    lm_loss: float
    lm_loss_ppl: float
    train_phase: str
    """The phase (compile or run) whose training it evaluated."""
    phase: str = "valid"

    def jsonl(self) -> str:
        return json.dumps(asdict(self))


_ROW_DEFAULTS: dict[str, Any] = {
    "train_iters": 0, "num_nan_iterations": 0, "consumed_samples": 0, "elapsed_ms": 0.0, "lr": math.nan,
    "global_batch_size": 0, "grad_norm": math.nan, "tokens_per_s": math.nan, "tflops_per_worker": math.nan,
    "num_skipped_iterations": 0, "lm_loss_ppl": math.nan, "train_phase": "run",
}
"""What a row written by an older version (or by hand) may lack; iteration, phase and lm_loss it must have."""


def _row(data: Any) -> IterationRecord | ValidationRecord | None:
    """A parsed line as its record; None for a line that is not one."""
    if not isinstance(data, dict) or not {"iteration", "phase", "lm_loss"} <= data.keys():
        return None
    cls: type = ValidationRecord if data["phase"] in ("valid", "test") else IterationRecord
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in {**_ROW_DEFAULTS, **data}.items() if k in names}
    try:
        return cls(**values)
    except TypeError:
        return None


def read_metrics(path: Path) -> list[IterationRecord | ValidationRecord]:
    """The rows of a metrics.jsonl in file order; a line being appended right now (or not ours) is left out.

    OSError passes to the caller, who knows whether a missing file is a problem. Rows written back by a
    reader have train_iters and num_nan_iterations 0: they are not part of the file.
    """
    rows = []
    for line in path.read_text(encoding="ascii", errors="replace").splitlines():
        try:
            row = _row(json.loads(line))
        except json.JSONDecodeError:
            continue
        if row is not None:
            rows.append(row)
    return rows


# ------------------------------------------------------------------------- submission.json, attempts.jsonl


@dataclass(kw_only=True, slots=True)
class JobRecord:
    """One queued phase (mutable: submit --wait follows its state)."""

    phase: str
    job_id: str
    state: str = "SUBMITTED"
    depends_on: str | None = None
    command: tuple[str, ...] = ()
    """The sbatch command line that queued it (SLURM only)."""

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"phase": self.phase, "job_id": self.job_id, "state": self.state,
                                "depends_on": self.depends_on}
        if self.command:
            data["command"] = list(self.command)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobRecord:
        return cls(phase=str(data.get("phase", "?")), job_id=str(data.get("job_id", "?")),
                   state=str(data.get("state", "UNKNOWN")), depends_on=data.get("depends_on"),
                   command=tuple(data.get("command") or ()))


@dataclass(kw_only=True, slots=True)
class SubmissionRecord:
    """submission.json: what the last `submit` queued, with the earlier submissions of the folder (--resume)."""

    cluster: str
    jobs: list[JobRecord]
    ok: bool = True
    reason: str = ""
    compile_skipped: bool = False
    """The shared cache held this run's compile fingerprint, so no compile phase was queued."""
    compile_left_out: str | None = None
    """Why the run has no compile phase at all (nothing to compile), or None."""
    fingerprint: str | None = None
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Earlier submissions of this folder, oldest first, as they were written."""

    def to_json(self) -> dict[str, Any]:
        return {**({"history": self.history} if self.history else {}), "cluster": self.cluster,
                "compile_skipped": self.compile_skipped, "compile_left_out": self.compile_left_out,
                "fingerprint": self.fingerprint, "jobs": [j.to_json() for j in self.jobs], "ok": self.ok,
                "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SubmissionRecord:
        return cls(cluster=str(data.get("cluster", "unknown")),
                   jobs=[JobRecord.from_json(j) for j in data.get("jobs", []) if isinstance(j, dict)],
                   ok=bool(data.get("ok", True)), reason=str(data.get("reason", "")),
                   compile_skipped=bool(data.get("compile_skipped", False)),
                   compile_left_out=data.get("compile_left_out"), fingerprint=data.get("fingerprint"),
                   history=list(data.get("history", [])))


@dataclass(frozen=True, kw_only=True, slots=True)
class AttemptRecord:
    """One line of attempts.jsonl: a phase that ended on node 0, and what the node task did about it."""

    phase: str
    job_id: str | None
    attempt: int
    """SLURM_RESTART_COUNT of the attempt that ended."""
    exit_code: int
    action: str
    """done, requeue or fail (launch/requeue.py)."""
    requeued: bool = False
    message: str = ""
    time: float = 0.0
    iteration: int | None = None
    """Where a stopped run saved, when it stopped early."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptRecord | None:
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError:
            return None


def append_attempt(run_dir: Path, record: AttemptRecord) -> None:
    append_jsonl(run_dir / ATTEMPTS_FILE, asdict(record))


def parse_attempts(text: str) -> list[AttemptRecord]:
    """The records of an attempts.jsonl's text; a line being written, or not a record, is left out."""
    rows = []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        record = AttemptRecord.from_json(data) if isinstance(data, dict) else None
        if record is not None:
            rows.append(record)
    return rows


# -------------------------------------------------------------------------------- compile-fingerprint.json


@dataclass(frozen=True, kw_only=True, slots=True)
class FingerprintRecord:
    """compile-fingerprint.json: what shapes this run's compiled graphs, and where its compile phase records it."""

    sha256: str
    inputs: dict[str, Any]
    cache_root: str

    @classmethod
    def read(cls, run_dir: Path) -> FingerprintRecord:
        """OSError, ValueError or TypeError when the folder has none (written by hand or an older version)."""
        data = read_json(run_dir / FINGERPRINT_FILE)
        return cls(sha256=data["sha256"], inputs=data["inputs"], cache_root=data["cache_root"])

    def write(self, run_dir: Path) -> Path:
        return write_json(run_dir / FINGERPRINT_FILE, asdict(self))


def write_script(path: Path, text: str) -> Path:
    """A script of the run folder (node.sh, *.sbatch, submit.sh), executable, written atomically."""
    write_text_atomic(path, text)
    path.chmod(0o755)
    return path
