"""What each SLURM phase runs: nodes, processes, wrapper and environment. Pure.

The compile phase is a short trial run (on Trainium under `neuron_parallel_compile`, which
extracts and compiles the graphs into the cache); the run phase starts after it succeeded
(afterok). Both phases export the same environment so the compiler flags, and with them the
cache keys, match (shared/reference/neuron-xla.md 2.1).

The node script, not srun, puts `neuron_parallel_compile` around torchrun: the tool compiles the
graphs after its trial returns (2.5), so only a script around the whole tool can publish them from
the node-local cache to the shared one once they are all compiled (slurm/templates/node.sh).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_hpc.config.platforms import Platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.plan.planner import Plan

PhaseName = Literal["compile", "run"]

# torchrun's rendezvous port is derived from the job id so that two jobs sharing a first node
# do not collide; the range stays clear of the Neuron runtime's root-comm port 62182 and the
# XLA coordinator's 8547 (neuron-xla.md 4.1).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 20000

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
    wrapper: tuple[str, ...] = ()
    """Command around the node script itself (`srun ... WRAPPER bash node.sh PHASE`); none on any platform."""
    torchrun_wrapper: tuple[str, ...] = ()
    """Command the node script runs torchrun under in this phase (neuron_parallel_compile for Trainium
    compiles), inside the node-local compile cache, so its compiles are published when it has returned."""
    env: dict[str, str] = field(default_factory=dict)
    nofile_limit: int = 65535
    time_limit_min: int = 60
    exclusive: bool = True
    requeue: bool = True
    signal_lead_s: int = 90
    """SLURM sends USR2 this long before the time limit (submitit's default): the run saves and requeues."""


def master_port(job_id: int) -> int:
    """The rendezvous port of a job; the node script computes the same in bash."""
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


def phase_env(cfg: RunConfig, platform: Platform, *, extra: dict[str, str]) -> dict[str, str]:
    """Environment of both phases; `extra` (the compile-cache location) comes from the launcher."""
    env = dict(COMMON_ENV)
    env.update(platform.env)
    if cfg.train.precision == "bf16":
        env.update(platform.bf16_env)
    env.update(extra)
    return env


def make_phases(cfg: RunConfig, plan: Plan, platform: Platform, *,
                extra_env: dict[str, str]) -> tuple[PhaseSpec, ...]:
    """The phases to submit, in order: compile (unless disabled) then run."""
    env = phase_env(cfg, platform, extra=extra_env)
    common = dict(num_nodes=plan.num_nodes, nproc_per_node=plan.workers_per_node, env=env,
                  nofile_limit=cfg.launch.nofile_limit, time_limit_min=cfg.launch.time_limit_min,
                  exclusive=cfg.launch.exclusive)
    run = PhaseSpec(phase="run", job_name=f"{cfg.name}-run", requeue=True, **common)
    if not cfg.compile.enabled:
        return (run,)
    # Both phases requeue, as the reference scripts do: a preempted compile comes back too.
    compile_ = PhaseSpec(phase="compile", job_name=f"{cfg.name}-compile",
                         torchrun_wrapper=platform.compile_wrapper, requeue=True, **common)
    return (compile_, run)
