"""Submit the compile and run phases: locally with submitit's local executor, or to SLURM.

Everything that can be checked is checked before the first job is queued: the plan (by the
caller), the cluster tools, and that the run folder is writable. On SLURM the sbatch files
written to the run folder are what is queued (`sbatch --parsable FILE`), the same files and
command lines as a dry run's submit.sh. Never imports torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_hpc.compile_cache import fingerprint
from megatron_hpc.compile_cache.paths import default_cache_root, warm_start_env
from megatron_hpc.launch.env_checks import leaked_slurm_vars
from megatron_hpc.launch.failure_reason import explain_failure
from megatron_hpc.launch.node_task import NodeTask
from megatron_hpc.launch.requeue import MAX_REQUEUES_ENV, job_fields
from megatron_hpc.launch.resume import previous_submissions
from megatron_hpc.launch.run_dir import python_bin_dir
from megatron_hpc.launch.run_status import ENDED_STATES, slurm_job_state
from megatron_hpc.launch.scripts import (
    SlurmOptions,
    parse_job_id,
    render_node_script,
    render_sbatch,
    render_submit_script,
    sbatch_command,
)

from megatron_hpc.config.loader import config_to_dict
from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import LaunchConfig, RunConfig
from megatron_hpc.errors import LaunchError
from megatron_hpc.plan.jobs import PhaseSpec, compile_left_out, make_phases, make_tune_phase
from megatron_hpc.plan.planner import Plan
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.run_folder import (
    CLUSTER_FILE,
    LOG_DIR,
    NODE_SCRIPT,
    SUBMISSION_FILE,
    SUBMIT_SCRIPT,
    SUBMITIT_DIR,
    FingerprintRecord,
    JobRecord,
    SubmissionRecord,
    node_log,
    sbatch_file,
    write_json,
    write_script,
    write_spec,
)

Cluster = Literal["local", "slurm", "k8s"]
_FINISHED_OK = "COMPLETED"
SBATCH_TIMEOUT_S = 120


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
    workdir: Path = field(default_factory=Path.cwd)
    """Where the jobs run (sbatch --chdir): the folder submit ran in, where relative recipe paths resolve."""
    tune: bool = False
    """Queue `megatron-hpc tune`'s one job (the tune phase, launch/tune_job.py) instead of compile and run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFiles:
    """What write_run_files wrote and decided."""

    phases: tuple[PhaseSpec, ...]
    fingerprint: str
    fingerprint_inputs: dict = field(default_factory=dict)
    """What the fingerprint hashes (compile_cache/fingerprint.py compute)."""
    compile_skipped_by: dict | None = None
    """The cache marker that made the compile phase unnecessary (None when it runs or has none to run)."""
    compile_left_out: str | None = None
    """Why the run has no compile phase at all (plan/jobs.py compile_left_out), else None."""

    def skip_message(self, cache_root: Path) -> str:
        marker = self.compile_skipped_by or {}
        return (f"compile phase skipped: the shared cache at {cache_root} already holds fingerprint "
                f"{self.fingerprint[:12]} (compiled by run {marker.get('run_dir', '?')}); --recompile forces it")

    def compile_message(self, cache_root: Path) -> str | None:
        """The one line that says why no compile phase is queued, or None when one is."""
        if self.compile_left_out is not None:
            hint = "; --set train.compile=true adds one" if self.compile_left_out.startswith("nothing") else ""
            return f"compile phase left out ({self.compile_left_out}): only the run phase is queued{hint}"
        if self.compile_skipped_by is not None:
            return self.skip_message(cache_root)
        return None


@dataclass(kw_only=True, slots=True)
class SubmitResult:
    run_dir: Path
    jobs: list[JobRecord]
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


def check_spares(req: SubmitRequest, *, echo: Callable[[str], None] | None = None) -> None:
    """Hot spares need SLURM and room in the partition for --nodes + launch.spare_nodes; elsewhere say they are
    ignored."""
    spares = req.cfg.launch.spare_nodes
    if not spares:
        return
    if req.cluster != "slurm":
        if echo:
            echo(f"warning: launch.spare_nodes={spares} is ignored on --cluster {req.cluster}: hot spares and "
                 "in-job restarts need --cluster slurm")
        return
    check_spares_fit(req.plan.num_nodes, spares, partition=req.options.partition)


def check_spares_fit(num_nodes: int, spares: int, *, partition: str | None) -> None:
    """LaunchError when the partition (sinfo) has fewer nodes than --nodes + launch.spare_nodes."""
    total, name = partition_size(partition)
    wanted = num_nodes + spares
    if total is not None and wanted > total:
        fix = f"--set launch.spare_nodes={total - num_nodes}" if total > num_nodes else "fewer --nodes"
        raise LaunchError(f"--nodes {num_nodes} + launch.spare_nodes={spares} asks for {wanted} nodes, "
                          f"but partition {name} has {total}; use {fix}, or a larger --partition")


def partition_size(partition: str | None) -> tuple[int | None, str]:
    """How many nodes `sinfo` lists in the partition (the default one when None); None when sinfo cannot say."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None, partition or "(default)"
    nodes: dict[str, set[str]] = {}
    default = None
    for line in proc.stdout.splitlines():
        node, _, part = line.strip().partition(" ")
        if part.endswith("*"):
            part = default = part[:-1]
        nodes.setdefault(part, set()).add(node)
    name = partition or default
    return (len(nodes[name]) if name in nodes else None), name or "(default)"


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


def launcher_env(launch: LaunchConfig) -> dict[str, str]:
    """Node environment from the recipe's launch section: torchrun's rendezvous timeout (the planner checked it)."""
    return {RDZV_CONF_ENV: f"timeout={launch.init_timeout_s}"}


def write_run_files(req: SubmitRequest) -> RunFiles:
    """Config, plan, compile fingerprint, node script, sbatch files and submit.sh in the run folder.

    The compile phase is left out when the run compiles nothing (plan/jobs.py compile_left_out), and
    skipped when the shared cache holds this run's fingerprint (unless req.recompile): the run phase
    then has no dependency.
    """
    files = decide_phases(req)
    phases = files.phases
    write_spec(req.run_dir, RunSpec(config=req.cfg, plan=req.plan))
    if req.profile is not None:
        write_json(req.run_dir / CLUSTER_FILE, req.profile)
    FingerprintRecord(sha256=files.fingerprint, inputs=files.fingerprint_inputs,
                      cache_root=str(req.cache_root)).write(req.run_dir)
    node_script = req.run_dir / NODE_SCRIPT
    write_script(node_script, render_node_script(phases[0], recipe=req.cfg.name, run_dir=str(req.run_dir),
                                                 bin_dir=python_bin_dir(), backend=req.platform.backend,
                                                 shared_cache=str(req.cache_root),
                                                 warm=any(p.warm_restart for p in phases)))
    previous = None
    for spec in phases:
        text = render_sbatch(spec, req.plan, node_script=str(node_script), log_dir=str(req.run_dir / LOG_DIR),
                             out_dir=str(req.run_dir), workdir=str(req.workdir), options=req.options,
                             depends_on=previous)
        write_script(req.run_dir / sbatch_file(spec.phase), text)
        previous = spec.phase
    write_script(req.run_dir / SUBMIT_SCRIPT, render_submit_script(phases, out_dir=str(req.run_dir)))
    return files


def decide_phases(req: SubmitRequest) -> RunFiles:
    """The phases to queue and the compile fingerprint, on any cluster: the compile phase is left out when the
    run compiles nothing, and skipped when the shared cache at req.cache_root holds the fingerprint (unless
    req.recompile). Reads only that cache marker."""
    # Where the caches are is decided on each node (node.sh: a node-local cache, synced and published);
    # only the switches that make torch.compile reuse them are fixed here.
    env = {**warm_start_env(backend=req.platform.backend, torch_compile=req.cfg.train.compile),
           **launcher_env(req.cfg.launch), **req.extra_env}
    phases = make_phases(req.cfg, req.plan, req.platform, extra_env=env)
    config, plan = config_to_dict(req.cfg), req.plan.to_json()
    # The requeue cap and the timeouts change what happens around the graphs, not the graphs.
    graph_env = {k: v for k, v in phases[0].env.items() if k not in (MAX_REQUEUES_ENV, RDZV_CONF_ENV)}
    fp = fingerprint.compute(config, plan, env=graph_env,
                             compiler=fingerprint.compiler_identity(req.platform.backend))
    if req.tune:
        return RunFiles(phases=(make_tune_phase(req.cfg, req.plan, req.platform, extra_env=env),),
                        fingerprint=fp.sha256, fingerprint_inputs=fp.inputs)
    left_out = compile_left_out(req.cfg, req.platform)
    marker = fingerprint.find(req.cache_root, fp.sha256) if left_out is None and not req.recompile else None
    if marker is not None:
        phases = tuple(p for p in phases if p.phase != "compile")
    return RunFiles(phases=phases, fingerprint=fp.sha256, fingerprint_inputs=fp.inputs, compile_skipped_by=marker,
                    compile_left_out=left_out)


def submit(req: SubmitRequest, *, wait: bool, echo: Callable[[str], None] | None = None) -> SubmitResult:
    """Write the run files and queue the phases; with `wait`, follow them to the end."""
    check_cluster(req.cluster, num_nodes=req.plan.num_nodes, platform=req.platform)
    check_spares(req, echo=echo)
    files = write_run_files(req)
    note = files.compile_message(req.cache_root)
    if note and echo:
        echo(note)
    history = previous_submissions(req.run_dir)  # a resumed run keeps its earlier job ids; read before ours replaces it
    if req.cluster == "local":
        result = run_local(req, files.phases, echo=echo)
    else:
        result = _submit_slurm(req, files.phases)
        if wait:
            # Recorded before the wait too: a Ctrl-C or a lost terminal there must not leave queued jobs that
            # `status`, `cancel` and a resume's still-active check know nothing of.
            _record_submission(req, result, files, history=history)
            _wait_slurm(result, req)
    result.files = files
    _record_submission(req, result, files, history=history)
    return result


def _record_submission(req: SubmitRequest, result: SubmitResult, files: RunFiles, *,
                       history: list[dict[str, Any]]) -> None:
    write_json(req.run_dir / SUBMISSION_FILE, SubmissionRecord(
        cluster=req.cluster, jobs=result.jobs, ok=result.ok, reason=result.reason,
        compile_skipped=files.compile_skipped_by is not None, compile_left_out=files.compile_left_out,
        fingerprint=files.fingerprint, history=history).to_json())


def run_local(req: SubmitRequest, phases: tuple[PhaseSpec, ...], *,
              echo: Callable[[str], None] | None) -> SubmitResult:
    """Run the phases one after another on this machine (submitit's local executor), echoing each phase's log."""
    import submitit

    executor = submitit.LocalExecutor(folder=str(req.run_dir / SUBMITIT_DIR))
    result = SubmitResult(run_dir=req.run_dir, jobs=[])
    for spec in phases:
        executor.update_parameters(timeout_min=req.options.time_for(spec), nodes=1, tasks_per_node=1)
        log = node_log(req.run_dir, spec.phase, 0)
        # A resumed run appends to its log: echo from here, not the earlier attempts' lines (their failure).
        start = log.stat().st_size if log.exists() else 0
        job = executor.submit(NodeTask(node_script=str(req.run_dir / NODE_SCRIPT), phase=spec.phase))
        # Locally the run phase starts only after the compile job returned successfully: afterok by hand.
        previous = result.jobs[-1].job_id if result.jobs else None
        entry = JobRecord(phase=spec.phase, job_id=str(job.job_id), state="RUNNING", depends_on=previous)
        result.jobs.append(entry)
        _follow_log(job, log, echo, start=start)
        try:
            job.result()
            entry.state = _FINISHED_OK
        except Exception:  # submitit re-raises whatever the task raised, as FailedJobError
            entry.state = "FAILED"
            result.ok = False
            # The error only carries the node script's exit code; the node logs say why.
            result.reason = f"{spec.phase} phase failed: {explain_failure(req.run_dir, spec.phase)}"
            return result
    return result


def _follow_log(job: object, log: Path, echo: Callable[[str], None] | None, *, start: int = 0) -> None:
    """Print the phase's log as it grows from byte `start`, until the job ends."""
    offset = start
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
    """Queue each phase's sbatch file with the command line submit.sh holds.

    Not submitit's SlurmExecutor: it writes its own sbatch text (other log paths, a pickled callable
    started by `python -m submitit.core._submit`), so the files a dry run shows and the golden tests
    check would not be what runs. A submitit.SlurmJob(folder, job_id) would add only its sacct watcher
    (.state, .done()) and result-pickle paths, which a job running plain bash has no use for: these jobs
    are followed with scontrol, then sacct (run_status.py), as `status`, `cancel` and --wait do.
    """
    # sbatch reads SLURM_*/SBATCH_* variables as options: one left over from an enclosing allocation
    # would change the job (launch/env_checks.py). SLURM_CONF, which names the cluster, stays.
    leaked = set(leaked_slurm_vars(os.environ))
    env = {k: v for k, v in os.environ.items() if k not in leaked}
    result = SubmitResult(run_dir=req.run_dir, jobs=[])
    for spec in phases:
        script = req.run_dir / f"{spec.phase}.sbatch"
        previous = result.jobs[-1].job_id if result.jobs else None
        argv = sbatch_command(str(script), after=previous)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=SBATCH_TIMEOUT_S,
                                  check=False)
            said, job_id = (proc.stderr or proc.stdout).strip(), parse_job_id(proc.stdout)
        except subprocess.TimeoutExpired:
            said, job_id = f"no answer within {SBATCH_TIMEOUT_S} s", ""
        if not job_id.isdigit():
            raise LaunchError(f"sbatch refused the {spec.phase} phase: {_last_line(said) or 'no job id printed'}"
                              f"{_cancel_queued(result)}; check the partition, account, qos, constraint and "
                              "sbatch lines of the cluster profile (--cluster-config) and the flags",
                              script=str(script))
        result.jobs.append(JobRecord(phase=spec.phase, job_id=job_id, depends_on=previous, command=tuple(argv)))
    return result


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1].removeprefix("sbatch: error: ") if lines else ""


def _cancel_queued(result: SubmitResult) -> str:
    """Cancel the phases queued before one was refused, so that no half of a run is left; says what it did."""
    if not result.jobs:
        return ""
    ids = [j.job_id for j in result.jobs]
    proc = subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60, check=False)
    done = "cancelled" if proc.returncode == 0 else "could not cancel (scancel failed)"
    return f" ({done} the {', '.join(f'{j.phase} job {j.job_id}' for j in result.jobs)} queued before it)"


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
                    restarts = job_fields(entry.job_id).get("Restarts", "0")
                    requeued = f", requeued {restarts}x" if restarts.isdigit() and int(restarts) else ""
                    result.reason = (f"{entry.phase} phase (job {entry.job_id}{requeued}) ended {entry.state}: "
                                     f"{explain_failure(req.run_dir, entry.phase)}")
        if pending:
            time.sleep(poll_s)

