"""Text of the node script, the phase sbatch files and submit.sh. Pure: specs in, strings out.

The sbatch files are the very text SLURM gets: `submit` runs `sbatch_command` on them, and submit.sh
holds the same command lines for a submission by hand. The templates ship in
`megatron_hpc.slurm/templates` and use `{{name}}` placeholders, which cannot clash with the bash
`$VAR`s around them. The sbatch directives follow the reference Trainium scripts
(shared/reference/neuron-xla.md 3.1-3.2: --nodes, --exclusive, --requeue, --open-mode=append, one
srun task per node) plus --kill-on-bad-exit so one failed node ends the step, and --cpu-bind=none
because Slurm >= 22.05 srun otherwise binds every task to the cores of the first one.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from importlib import resources

from megatron_hpc.compile_cache.paths import cache_env
from megatron_hpc.launch.requeue import DEFAULT_MAX_REQUEUES, MAX_REQUEUES_ENV
from megatron_hpc.launch.run_dir import python_bin_dir
from megatron_hpc.launch.step_exit import IN_JOB_STEP_ENV
from megatron_hpc.launch.watchdog import HANG_EXIT

from megatron_hpc import __version__
from megatron_hpc.plan.jobs import MASTER_PORT_BASE, MASTER_PORT_SPAN, PhaseSpec
from megatron_hpc.plan.planner import Plan
from megatron_hpc.run_folder import LOG_DIR, STOP_REQUEST_FILE

SRUN_ARGS = ("--kill-on-bad-exit=1", "--cpu-bind=none")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmOptions:
    """Site settings: the cluster profile (launch/cluster_profile.py) with the command line's flags over it."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    exclude: str | None = None
    constraint: str | None = None
    time_limit_min: int | None = None
    """--time: overrides every other time limit, for both phases."""
    phase_time_min: dict[str, int] = field(default_factory=dict)
    """The profile's time limit per phase name; over the recipe's (launch.compile_time_limit_min and
    launch.time_limit_min)."""
    exclusive: bool | None = None
    """None keeps the recipe's launch.exclusive."""
    extra_sbatch: tuple[tuple[str, str | None], ...] = ()
    """More #SBATCH flags (name, value or None for a bare flag)."""
    setup: tuple[str, ...] = ()
    """Shell lines before srun."""
    srun_extra: tuple[str, ...] = ()
    """More srun flags (pyxis container flags)."""

    def time_for(self, spec: PhaseSpec) -> int:
        return self.time_limit_min or self.phase_time_min.get(spec.phase) or spec.time_limit_min

    def exclusive_for(self, spec: PhaseSpec) -> bool:
        return spec.exclusive if self.exclusive is None else self.exclusive

    def srun_args(self) -> tuple[str, ...]:
        return (*SRUN_ARGS, *self.srun_extra)


def load_template(name: str) -> str:
    return (resources.files("megatron_hpc.slurm") / "templates" / name).read_text()


def render(template: str, values: dict[str, object]) -> str:
    """Fill `{{name}}` placeholders; a missing value is a bug, so it raises KeyError."""
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


_WARM_PHASE = """

# Warm workers (launch.warm_restart, with hot spares): `node.sh warm` is the warm process of this node, started
# once per allocation by the in-job driver (megatron_hpc/warm_server.py), after the limits above, which the
# workers it forks inherit. An in-job step's run phase asks it for the workers (launch/warm_client.py); where
# there is none, the client says so and starts them cold itself, from the `-m ...` of the torchrun command below
# (a torchrun node would wait for the other nodes' torchrun agents, which warm nodes do not run).
if [ "$PHASE" = warm ]; then
  exec python -m megatron_hpc.warm_server >>"$LOG" 2>&1
fi
WARM_CLIENT=()
if [ "$PHASE" = run ] && [ -n "$IN_JOB_STEP" ]; then
  WARM_CLIENT=(python -m megatron_hpc.launch.warm_client --nproc-per-node={{nproc_per_node}} \\
    --node-rank="$NODE_RANK" --nnodes="$NNODES" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --)
fi"""


def render_node_script(spec: PhaseSpec, *, recipe: str, run_dir: str, bin_dir: str, backend: str,
                       shared_cache: str, warm: bool = False) -> str:
    """The node script of a run folder. One script serves every phase (`node.sh compile|run`); `spec` is the
    first phase submitted, and its torchrun_wrapper applies when the script runs that phase. `warm` (a run phase
    with launch.warm_restart) adds the warm phase and the warm client; without it the text is the same as before
    warm workers existed."""
    exports = "\n".join(f"export {key}={shlex.quote(value)}" for key, value in sorted(spec.env.items()))
    template = load_template("node.sh").replace("{{warm_phase}}", _WARM_PHASE if warm else "")
    return render(template, {
        "warm_client": '"${WARM_CLIENT[@]}" ' if warm else "",
        "shared_cache": shlex.quote(shared_cache),
        # double quotes: the node-local root is known only on the node
        "cache_exports": "\n".join(f'export {key}="{value}"'
                                   for key, value in cache_env(backend=backend, root="$LOCAL_CACHE").items()),
        "torchrun_wrapper": torchrun_wrapper_lines(spec),
        "recipe": recipe,
        "version": __version__,
        "run_dir": shlex.quote(run_dir),
        "nofile_limit": spec.nofile_limit,
        "bin_dir": shlex.quote(bin_dir),
        "env_exports": exports,
        "port_base": MASTER_PORT_BASE,
        "port_span": MASTER_PORT_SPAN,
        "nproc_per_node": spec.nproc_per_node,
        # The run-folder names the node script shares with the trainer and the launcher (run_folder.py).
        "log_dir": LOG_DIR,
        "stop_request": STOP_REQUEST_FILE,
        "in_job_env": IN_JOB_STEP_ENV,
        "hang_exit": HANG_EXIT,
    })


def torchrun_wrapper_lines(spec: PhaseSpec) -> str:
    """Bash that sets TORCHRUN_WRAPPER, the command the node script runs torchrun under, for spec's phase."""
    if not spec.torchrun_wrapper:
        return "TORCHRUN_WRAPPER=()"
    return (f'TORCHRUN_WRAPPER=()\nif [ "$PHASE" = {shlex.quote(spec.phase)} ]; then\n'
            f"  TORCHRUN_WRAPPER=({shlex.join(spec.torchrun_wrapper)})\nfi")


def sbatch_directives(spec: PhaseSpec, *, log_dir: str, workdir: str,
                      options: SlurmOptions) -> list[tuple[str, str | None]]:
    """(flag, value) pairs of the #SBATCH header; value None is a bare flag."""
    flags: list[tuple[str, str | None]] = [
        ("job-name", spec.job_name),
        ("nodes", str(spec.billed_nodes)),
        ("ntasks-per-node", "1"),
        ("output", f"{log_dir}/%x-%j.out"),
        ("open-mode", "append"),
        # The folder submit ran in, whoever queues the file: relative recipe paths (data.path) resolve there.
        ("chdir", workdir),
        ("time", str(options.time_for(spec))),
    ]
    if spec.gpus_per_node:
        flags.append(("gpus-per-node", str(spec.gpus_per_node)))
    if options.exclusive_for(spec):
        flags.append(("exclusive", None))
    if spec.requeue:
        flags.append(("requeue", None))
    if spec.spare_nodes:
        # A lost node must not end the job: the in-job driver starts the next step on the healthy ones.
        flags.append(("no-kill", None))
    # submitit's default warning (USR2 90 s before the limit): the run saves, then requeues.
    flags.append(("signal", f"USR2@{spec.signal_lead_s}"))
    for key, value in (("partition", options.partition), ("account", options.account),
                       ("qos", options.qos), ("constraint", options.constraint), ("exclude", options.exclude)):
        if value:
            flags.append((key, value))
    flags.extend(options.extra_sbatch)
    return flags


def render_sbatch(spec: PhaseSpec, plan: Plan, *, node_script: str, log_dir: str, out_dir: str, workdir: str,
                  options: SlurmOptions, depends_on: str | None = None) -> str:
    lines = [f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={shlex.quote(v)}"
             for k, v in sbatch_directives(spec, log_dir=log_dir, workdir=workdir, options=options)]
    if depends_on:
        # The id is known only once the first job is queued, so it goes on sbatch's command line.
        note = (f"# Queued after the {depends_on} phase, to start only once it succeeded:\n"
                f"#   {_shell_line(sbatch_command(f'{spec.phase}.sbatch', after=f'${depends_on.upper()}_JOB_ID'))}")
    else:
        note = ""
    node_command = ["bash", node_script, spec.phase]
    command = shlex.join(["srun", *options.srun_args(), *node_command])
    if spec.spare_nodes:
        command = in_job_command(spec, run_dir=out_dir, srun=[*options.srun_args(), *node_command])
    return render(load_template("phase.sbatch"), {
        "phase": spec.phase,
        "recipe": plan.recipe,
        "num_nodes": spec.num_nodes,
        "platform": plan.platform,
        "nproc_per_node": spec.nproc_per_node,
        "tp": plan.tensor_parallel,
        "dp": plan.data_parallel,
        "version": __version__,
        "out_dir": out_dir,
        "sbatch_lines": "\n".join(lines),
        "dependency_note": note,
        "setup_lines": "".join(f"{line}\n" for line in options.setup),
        "command": command,
    })


def in_job_command(spec: PhaseSpec, *, run_dir: str, srun: list[str]) -> str:
    """The batch script's line with hot spares: the in-job driver (launch/in_job.py) runs `srun SRUN` as steps on
    spec.num_nodes healthy nodes of the allocation and restarts in the job when one fails. It runs with the
    Python megatron-hpc was submitted from, as node.sh does. `exec`: the driver is the batch step's own process. SLURM
    sends SIGTERM to the whole batch step (scancel, preemption, the time limit, the driver's own scontrol requeue); a
    shell above the driver would die of it at once, and with it the batch step, whose leftover processes SLURM then
    kills, the driver among them, before it recorded the attempt."""
    argv = [f"{python_bin_dir()}/python", "-m", "megatron_hpc.launch.in_job", "--run-dir", run_dir,
            "--nodes", str(spec.num_nodes), "--max-restarts", str(spec.max_in_job_restarts),
            "--max-requeues", spec.env.get(MAX_REQUEUES_ENV, str(DEFAULT_MAX_REQUEUES))]
    if spec.exclude_stragglers:
        argv.append("--exclude-stragglers")
    if spec.warm_restart:
        argv.append("--warm")
    return "exec " + shlex.join([*argv, "--", *srun])


def sbatch_command(script: str, *, after: str | None = None) -> list[str]:
    """How a phase's sbatch file is queued, by `submit` and by submit.sh alike; `after` is the job id of the
    phase before, which must succeed first. Without --kill-on-invalid-dep a failed compile would leave the
    run job pending forever (DependencyNeverSatisfied) on clusters that do not set kill_invalid_depend."""
    deps = [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"] if after else []
    return ["sbatch", "--parsable", *deps, script]


def parse_job_id(parsable: str) -> str:
    """The job id from `sbatch --parsable` output ("ID" or, on a federation, "ID;CLUSTER")."""
    return parsable.strip().splitlines()[-1].split(";")[0].strip() if parsable.strip() else ""


_JOB_ID_ARG = re.compile(r"[\w=:-]*\$[A-Z]+_JOB_ID")


def _shell_line(argv: list[str]) -> str:
    # An argument naming one of submit.sh's job id variables goes in double quotes, so that bash expands it.
    return " ".join(f'"{a}"' if _JOB_ID_ARG.fullmatch(a) else shlex.quote(a) for a in argv)


def render_submit_script(phases: tuple[PhaseSpec, ...], *, out_dir: str) -> str:
    """A script that queues the phases in order with the command lines `submit` runs, each afterok on the one
    before."""
    lines = ["#!/usr/bin/env bash", "# Queue the phases written by `megatron-hpc submit --dry-run`, as submit does.",
             "set -euo pipefail"]
    previous = None
    for spec in phases:
        var = f"{spec.phase.upper()}_JOB_ID"
        argv = sbatch_command(f"{out_dir}/{spec.phase}.sbatch", after=f"${previous}" if previous else None)
        lines.append(f"{var}=$({_shell_line(argv)})")
        lines.append(f"{var}=${{{var}%%;*}}  # --parsable prints ID;CLUSTER on a federation")
        lines.append(f'echo "{spec.phase} phase: job ${var}"')
        previous = var
    return "\n".join(lines) + "\n"
