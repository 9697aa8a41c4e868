"""Submit the compile and run phases: locally with submitit's local executor, or to SLURM.

Everything that can be checked is checked before the first job is queued: the plan (by the
caller), the cluster tools, and that the run folder is writable. Never imports torch.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_hpc.compile_cache import fingerprint
from megatron_hpc.compile_cache.paths import default_cache_root, warm_start_env
from megatron_hpc.launch.cluster_profile import CLUSTER_FILE, MAX_REQUEUES_ENV
from megatron_hpc.launch.node_task import NodeTask
from megatron_hpc.launch.resume import previous_submissions
from megatron_hpc.launch.run_dir import NODE_SCRIPT, python_bin_dir, write_json, write_script
from megatron_hpc.launch.run_status import ENDED_STATES, slurm_job_state
from megatron_hpc.launch.scripts import (
    SlurmOptions,
    render_node_script,
    render_sbatch,
    render_submit_script,
)

from megatron_hpc.config.loader import config_to_dict
from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import ConfigError, LaunchError
from megatron_hpc.plan.jobs import PhaseSpec, make_phases
from megatron_hpc.plan.planner import Plan

Cluster = Literal["local", "slurm"]
_FINISHED_OK = "COMPLETED"


@dataclass(frozen=True, kw_only=True, slots=True)
class SubmitRequest:
    cfg: RunConfig
    plan: Plan
    platform: Platform
    cluster: Cluster
    run_dir: Path
    options: SlurmOptions = field(default_factory=SlurmOptions)
    cache_root: Path = field(default_factory=lambda: default_cache_root())
    """Shared compile cache (on a filesystem every node sees)."""
    recompile: bool = False
    """Run the compile phase even when the shared cache already holds this run's fingerprint."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """The cluster profile's environment for every node (launch/cluster_profile.py profile_env)."""
    profile: dict | None = None
    """The cluster profile as JSON ({"path", "profile"}), kept in the run folder as cluster.json."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFiles:
    """What write_run_files wrote and decided."""

    phases: tuple[PhaseSpec, ...]
    fingerprint: str
    compile_skipped_by: dict | None = None
    """The cache marker that made the compile phase unnecessary (None when it runs or is disabled)."""

    def skip_message(self, cache_root: Path) -> str:
        marker = self.compile_skipped_by or {}
        return (f"compile phase skipped: the shared cache at {cache_root} already holds fingerprint "
                f"{self.fingerprint[:12]} (compiled by run {marker.get('run_dir', '?')}); --recompile forces it")


@dataclass(kw_only=True, slots=True)
class PhaseJob:
    phase: str
    job_id: str
    state: str = "SUBMITTED"
    depends_on: str | None = None


@dataclass(kw_only=True, slots=True)
class SubmitResult:
    run_dir: Path
    jobs: list[PhaseJob]
    ok: bool = True
    reason: str = ""
    files: RunFiles | None = None


def check_cluster(cluster: Cluster, *, num_nodes: int, platform: Platform) -> None:
    """Refuse a cluster that cannot run this job, with the fix."""
    if cluster == "slurm":
        missing = [tool for tool in ("sbatch", "srun", "sacct") if shutil.which(tool) is None]
        if missing:
            raise LaunchError(f"--cluster slurm needs {', '.join(missing)} on PATH, not found; "
                              "run on a SLURM login node, or use --cluster local to run on this machine")
        _check_controller()
        return
    if num_nodes != 1:
        raise LaunchError(f"--cluster local runs on this one machine, but --nodes {num_nodes} was asked; "
                          "use --nodes 1, or --cluster slurm for several nodes")
    if platform.backend == "xla" and shutil.which("neuron_parallel_compile") is None:
        raise LaunchError(f"--platform {platform.name} needs the Neuron SDK (neuron_parallel_compile not "
                          "found); use --platform cpu to run locally, or --dry-run to write the scripts")


def _check_controller() -> None:
    """A SLURM controller must answer before anything is written or queued."""
    try:
        proc = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10, check=False)
    except subprocess.TimeoutExpired:
        raise LaunchError("no SLURM controller answered `scontrol ping` within 10 s; check the cluster, "
                          "or use --cluster local to run on this machine") from None
    if proc.returncode != 0 or "UP" not in proc.stdout:
        said = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip("* ")]
        raise LaunchError(f"no SLURM controller answers `scontrol ping` ({said[0] if said else 'no output'}); "
                          "set SLURM_CONF to your cluster's slurm.conf, or use --cluster local to run on this "
                          "machine")


RDZV_CONF_ENV = "PET_RDZV_CONF"
"""torchrun reads each option from PET_<NAME> too; this one is --rdzv-conf."""


def launcher_env(cfg: RunConfig) -> dict[str, str]:
    """Node environment from the recipe's launch section: torchrun's rendezvous timeout."""
    for name in ("init_timeout_s", "collective_timeout_s"):
        if getattr(cfg.launch, name) <= 0:
            raise ConfigError(f"launch.{name} must be a positive number of seconds, got {getattr(cfg.launch, name)}")
    return {RDZV_CONF_ENV: f"timeout={cfg.launch.init_timeout_s}"}


def write_run_files(req: SubmitRequest) -> RunFiles:
    """Config, plan, compile fingerprint, node script, sbatch files and submit.sh in the run folder.

    The compile phase is left out when the shared cache holds this run's fingerprint (unless
    req.recompile): the run phase then has no dependency.
    """
    # Where the caches are is decided on each node (node.sh: a node-local cache, synced and published);
    # only the switches that make torch.compile reuse them are fixed here.
    phases = make_phases(req.cfg, req.plan, req.platform,
                         extra_env={**warm_start_env(backend=req.platform.backend, torch_compile=req.cfg.train.compile),
                                    **launcher_env(req.cfg), **req.extra_env})
    config, plan = config_to_dict(req.cfg), req.plan.to_json()
    # The requeue cap and the timeouts change what happens around the graphs, not the graphs.
    graph_env = {k: v for k, v in phases[0].env.items() if k not in (MAX_REQUEUES_ENV, RDZV_CONF_ENV)}
    fp = fingerprint.compute(config, plan, env=graph_env,
                             compiler=fingerprint.compiler_identity(req.platform.backend))
    marker = fingerprint.find(req.cache_root, fp.sha256) if req.cfg.compile.enabled and not req.recompile else None
    if marker is not None:
        phases = tuple(p for p in phases if p.phase != "compile")
    write_json(req.run_dir / "config.json", config)
    write_json(req.run_dir / "plan.json", plan)
    if req.profile is not None:
        write_json(req.run_dir / CLUSTER_FILE, req.profile)
    write_json(req.run_dir / fingerprint.FINGERPRINT_FILE,
               {"sha256": fp.sha256, "inputs": fp.inputs, "cache_root": str(req.cache_root)})
    node_script = req.run_dir / NODE_SCRIPT
    write_script(node_script, render_node_script(phases[0], recipe=req.cfg.name, run_dir=str(req.run_dir),
                                                 bin_dir=python_bin_dir(), backend=req.platform.backend,
                                                 shared_cache=str(req.cache_root)))
    previous = None
    for spec in phases:
        text = render_sbatch(spec, req.plan, node_script=str(node_script), log_dir=str(req.run_dir / "logs"),
                             out_dir=str(req.run_dir), options=req.options, depends_on=previous)
        write_script(req.run_dir / f"{spec.phase}.sbatch", text)
        previous = spec.phase
    write_script(req.run_dir / "submit.sh", render_submit_script(phases, out_dir=str(req.run_dir)))
    return RunFiles(phases=phases, fingerprint=fp.sha256, compile_skipped_by=marker)


def submit(req: SubmitRequest, *, wait: bool, echo: Callable[[str], None] | None = None) -> SubmitResult:
    """Write the run files and queue the phases; with `wait`, follow them to the end."""
    check_cluster(req.cluster, num_nodes=req.plan.num_nodes, platform=req.platform)
    files = write_run_files(req)
    if files.compile_skipped_by is not None and echo:
        echo(files.skip_message(req.cache_root))
    if req.cluster == "local":
        result = _run_local(req, files.phases, echo=echo)
    else:
        result = _submit_slurm(req, files.phases)
        if wait:
            _wait_slurm(result, req)
    result.files = files
    history = previous_submissions(req.run_dir)  # a resumed run keeps its earlier job ids
    write_json(req.run_dir / "submission.json", {
        **({"history": history} if history else {}),
        "cluster": req.cluster,
        "compile_skipped": files.compile_skipped_by is not None,
        "fingerprint": files.fingerprint,
        "jobs": [{"phase": j.phase, "job_id": j.job_id, "state": j.state, "depends_on": j.depends_on}
                 for j in result.jobs],
        "ok": result.ok,
        "reason": result.reason,
    })
    return result


def _task(req: SubmitRequest, spec: PhaseSpec) -> NodeTask:
    return NodeTask(node_script=str(req.run_dir / NODE_SCRIPT), phase=spec.phase, wrapper=spec.wrapper)


def explain_failure(run_dir: Path, phase: str, *, lines: int = 15) -> str:
    """Why a phase failed, from its node logs.

    The trainer's own one-line errors (`megatron-hpc: error: ...`) come first; failing that, the
    last exception line of a traceback; failing that, the tail of the first node's log.
    """
    logs = sorted((run_dir / "logs").glob(f"{phase}-node*.log"))
    texts = [p.read_text(errors="replace") for p in logs]
    ours: list[str] = []
    for text in texts:
        for line in text.splitlines():
            if "megatron-hpc: error:" in line and line.strip() not in ours:
                ours.append(line.strip())
    if ours:
        return "\n".join(ours[:3])
    for text in texts:
        exceptions = [ln for ln in text.splitlines() if _looks_like_exception(ln)]
        if exceptions:
            return exceptions[-1].strip()
    tail = texts[0].splitlines()[-lines:] if texts else ["(no log was written)"]
    return "last lines of its log:\n" + "\n".join(tail)


def _looks_like_exception(line: str) -> bool:
    head = line.strip().split(":", 1)[0]
    return head.endswith(("Error", "Exception")) and " " not in head


def _run_local(req: SubmitRequest, phases: tuple[PhaseSpec, ...],
               echo: Callable[[str], None] | None) -> SubmitResult:
    import submitit

    executor = submitit.LocalExecutor(folder=str(req.run_dir / "submitit"))
    result = SubmitResult(run_dir=req.run_dir, jobs=[])
    for spec in phases:
        executor.update_parameters(timeout_min=req.options.time_for(spec), nodes=1, tasks_per_node=1)
        job = executor.submit(_task(req, spec))
        # Locally the run phase starts only after the compile job returned successfully: afterok by hand.
        previous = result.jobs[-1].job_id if result.jobs else None
        entry = PhaseJob(phase=spec.phase, job_id=str(job.job_id), state="RUNNING", depends_on=previous)
        result.jobs.append(entry)
        _follow_log(job, req.run_dir / "logs" / f"{spec.phase}-node0.log", echo)
        try:
            job.result()
            entry.state = _FINISHED_OK
        except Exception as exc:  # submitit re-raises whatever the task raised, as FailedJobError
            entry.state = "FAILED"
            result.ok = False
            result.reason = (f"{spec.phase} phase failed ({type(exc).__name__}): "
                             f"{explain_failure(req.run_dir, spec.phase)}")
            return result
    return result


def _follow_log(job: object, log: Path, echo: Callable[[str], None] | None) -> None:
    """Print the phase's log as it grows, until the job ends."""
    offset = 0
    while True:
        done = job.done()  # type: ignore[attr-defined]
        if echo and log.exists():
            with log.open(errors="replace") as fh:
                fh.seek(offset)
                chunk = fh.read()
                offset = fh.tell()
            for line in chunk.splitlines():
                echo(line)
        if done:
            return
        time.sleep(0.5)


def _submit_slurm(req: SubmitRequest, phases: tuple[PhaseSpec, ...]) -> SubmitResult:
    import submitit

    executor = submitit.SlurmExecutor(folder=str(req.run_dir / "submitit"), python=sys.executable)
    result = SubmitResult(run_dir=req.run_dir, jobs=[])
    previous: PhaseJob | None = None
    for spec in phases:
        extra: dict[str, object] = {"open_mode": "append"}
        if spec.requeue:
            extra["requeue"] = True
        if previous is not None:
            extra["dependency"] = f"afterok:{previous.job_id}"
            # Without this a failed compile leaves the run pending forever (DependencyNeverSatisfied).
            extra["kill_on_invalid_dep"] = "yes"
        for name, value in req.options.extra_sbatch:  # the profile's own #SBATCH lines
            extra[name] = True if value is None else value
        params: dict[str, object] = dict(
            job_name=spec.job_name, nodes=spec.num_nodes, ntasks_per_node=1,
            time=req.options.time_for(spec), srun_args=list(req.options.srun_args()),
            signal_delay_s=spec.signal_lead_s, setup=list(req.options.setup),
            additional_parameters=extra,
        )
        if req.options.exclusive_for(spec):
            params["exclusive"] = True
        for key in ("partition", "account", "qos", "constraint", "exclude"):
            value = getattr(req.options, key)
            if value:
                params[key] = value
        executor.update_parameters(**params)
        try:
            job = executor.submit(_task(req, spec))
        except Exception as exc:  # submitit raises a bare error carrying sbatch's stderr
            raise LaunchError(f"sbatch refused the {spec.phase} phase: {exc}",
                              script=str(req.run_dir / f"{spec.phase}.sbatch")) from None
        entry = PhaseJob(phase=spec.phase, job_id=str(job.job_id),
                         depends_on=previous.job_id if previous else None)
        result.jobs.append(entry)
        previous = entry
    return result


def _wait_slurm(result: SubmitResult, req: SubmitRequest, *, poll_s: float = 2.0) -> None:
    """Follow the jobs with sacct until each has ended; explain a failed compile."""
    pending = list(result.jobs)
    while pending:
        for entry in list(pending):
            entry.state = slurm_job_state(entry.job_id, fallback=entry.state)
            if entry.state in ENDED_STATES:
                pending.remove(entry)
                if entry.state != _FINISHED_OK and result.ok:
                    result.ok = False
                    result.reason = (f"{entry.phase} phase (job {entry.job_id}) ended {entry.state}: "
                                     f"{explain_failure(req.run_dir, entry.phase)}")
        if pending:
            time.sleep(poll_s)

