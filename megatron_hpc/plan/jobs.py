"""What each SLURM phase runs: nodes, processes, GPUs, time limit and environment. Pure.

The compile phase is a short trial run (on Trainium under `neuron_parallel_compile`, which
extracts and compiles the graphs into the cache; elsewhere with torch.compile on); the run
phase starts after it succeeded (afterok). Both phases export the same environment so the
compiler flags, and with them the cache keys, match (shared/reference/neuron-xla.md 2.1).
A run that compiles nothing (no compiler wrapper and no torch.compile) gets no compile phase:
its trial would only spend an allocation.

The node script, not srun, puts `neuron_parallel_compile` around torchrun: the tool compiles the
graphs after its trial returns (2.5), so only a script around the whole tool can publish them from
the node-local cache to the shared one once they are all compiled (slurm/templates/node.sh).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.plan.memory import xla_fp32_master
from megatron_hpc.plan.planner import Plan

PhaseName = Literal["compile", "run", "tune"]

# torchrun's rendezvous port is derived from the job id so that two jobs sharing a first node
# do not collide; the range stays clear of the Neuron runtime's root-comm port 62182 and the
# XLA coordinator's 8547 (neuron-xla.md 4.1), and below Linux's ephemeral ports (32768 and up by
# default, net.ipv4.ip_local_port_range): the kernel hands those to outgoing connections and to
# listeners bound to port 0 (gloo's, a TCPStore's), and one of them holding the derived port made a
# local job fail with EADDRINUSE while other jobs ran.
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 12000

COMMON_ENV = {
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseSpec:
    phase: PhaseName
    job_name: str
    num_nodes: int
    nproc_per_node: int
    torchrun_wrapper: tuple[str, ...] = ()
    """Command the node script runs torchrun under in this phase (neuron_parallel_compile for Trainium
    compiles), inside the node-local compile cache, so its compiles are published when it has returned. The tune
    phase runs under it only its first pass (graphs only), then torchrun again without it (timed)."""
    env: dict[str, str] = field(default_factory=dict)
    gpus_per_node: int = 0
    """GPUs each node asks SLURM for (sbatch --gpus-per-node); 0 asks for none."""
    nofile_limit: int = 65535
    time_limit_min: int = 60
    exclusive: bool = True
    requeue: bool = True
    signal_lead_s: int = 90
    """SLURM sends USR2 this long before the time limit (submitit's default): the run saves and requeues."""
    spare_nodes: int = 0
    """Hot spares (launch.spare_nodes, run phase only): the job asks num_nodes + spare_nodes with --no-kill and
    its batch script runs the in-job driver, which starts the workers as steps on num_nodes healthy nodes."""
    max_in_job_restarts: int = 0
    exclude_stragglers: bool = False
    warm_restart: bool = False
    """Warm processes fork the in-job steps' workers (launch.warm_restart, only with spares, never on XLA)."""

    @property
    def billed_nodes(self) -> int:
        return self.num_nodes + self.spare_nodes


def phase_env(cfg: RunConfig, platform: Platform, *, extra: dict[str, str]) -> dict[str, str]:
    """Environment of both phases; `extra` (the compile-cache location) comes from the launcher."""
    env = dict(COMMON_ENV)
    env.update(platform.env)
    # Not with fp32 master weights: XLA_USE_BF16 would make the masters bf16 too (train/xla_zero.py).
    if cfg.train.precision == "bf16" and not xla_fp32_master(backend=platform.backend,
                                                             distributed_optimizer=cfg.parallel.distributed_optimizer):
        env.update(platform.bf16_env)
    env.update(extra)
    return env


def warm_restart(cfg: RunConfig, platform: Platform) -> bool:
    """Whether warm processes start the in-job steps' workers: asked for, with spares, and not on XLA, whose
    runtime cannot be imported before a fork."""
    return cfg.launch.warm_restart and cfg.launch.spare_nodes > 0 and platform.backend != "xla"


def compile_left_out(cfg: RunConfig, platform: Platform) -> str | None:
    """Why this run gets no compile phase at all, or None when it gets one."""
    if not cfg.compile.enabled:
        return "compile.enabled is false"
    if not platform.compile_wrapper and not cfg.train.compile:
        return f"nothing to compile: platform {platform.name} has no graph compiler and train.compile is false"
    return None


def make_phases(cfg: RunConfig, plan: Plan, platform: Platform, *,
                extra_env: dict[str, str]) -> tuple[PhaseSpec, ...]:
    """The phases to submit, in order: compile (unless compile_left_out says why not) then run."""
    env = phase_env(cfg, platform, extra=extra_env)
    common = dict(num_nodes=plan.num_nodes, nproc_per_node=plan.workers_per_node, env=env,
                  gpus_per_node=platform.gpus_per_node, nofile_limit=cfg.launch.nofile_limit,
                  exclusive=cfg.launch.exclusive)
    run = PhaseSpec(phase="run", job_name=f"{cfg.name}-run", requeue=True,
                    time_limit_min=cfg.launch.time_limit_min, spare_nodes=cfg.launch.spare_nodes,
                    max_in_job_restarts=cfg.launch.max_in_job_restarts,
                    exclude_stragglers=cfg.launch.exclude_stragglers,
                    warm_restart=warm_restart(cfg, platform), **common)
    if compile_left_out(cfg, platform) is not None:
        return (run,)
    # Both phases requeue, as the reference scripts do: a preempted compile comes back too.
    compile_ = PhaseSpec(phase="compile", job_name=f"{cfg.name}-compile",
                         torchrun_wrapper=platform.compile_wrapper, requeue=True,
                         time_limit_min=cfg.launch.compile_time_limit_min, **common)
    return (compile_, run)


def make_tune_phase(cfg: RunConfig, plan: Plan, platform: Platform, *, extra_env: dict[str, str]) -> PhaseSpec:
    """`megatron-hpc tune`'s one job: the candidates' short trials and the collective micro-benchmark, with the
    compile phase's time limit. Where the run would get a compile phase under a compiler wrapper (Trainium's
    neuron_parallel_compile), the tune phase carries it: the node script runs the trials once under it (graphs
    extracted and compiled into the cache, no times) and then once more from the warm cache, timed
    (docs/planning.md#tune). Elsewhere (cpu, CUDA) the trials run once, timed."""
    graphs_pass = platform.compile_wrapper if compile_left_out(cfg, platform) is None else ()
    return PhaseSpec(phase="tune", job_name=f"{cfg.name}-tune", num_nodes=plan.num_nodes,
                     nproc_per_node=plan.workers_per_node, env=phase_env(cfg, platform, extra=extra_env),
                     torchrun_wrapper=graphs_pass, gpus_per_node=platform.gpus_per_node,
                     nofile_limit=cfg.launch.nofile_limit, exclusive=cfg.launch.exclusive, requeue=False,
                     time_limit_min=cfg.launch.compile_time_limit_min)
