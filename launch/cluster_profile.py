"""Cluster profiles: a site's SLURM settings in one YAML file, kept out of the recipes.

A recipe says what to train; a profile says where: partition, account, QoS, node constraints,
time limits per phase, extra `#SBATCH` lines, setup lines (modules, a venv), environment, a
pyxis container and the requeue cap. `submit --cluster-config FILE` reads one; without the flag
`$MEGATRON_HPC_CLUSTER_CONFIG`, then `${XDG_CONFIG_HOME:-~/.config}/megatron-hpc/cluster.yaml` is
used when it exists. Command-line flags (--partition, --time, ...) win over the profile, which
wins over the recipe's launch section. Keys are checked like recipe keys: a typo is an error
that names the closest valid key. Pure apart from reading the file; no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from megatron_hpc.launch.requeue import MAX_REQUEUES_ENV
from megatron_hpc.launch.scripts import SlurmOptions

from megatron_hpc.config.hardware import Hardware, user_hardware
from megatron_hpc.config.loader import from_dict
from megatron_hpc.errors import ConfigError
from megatron_hpc.plan.jobs import MASTER_PORT_BASE, MASTER_PORT_SPAN
from megatron_hpc.run_folder import CLUSTER_FILE

PROFILE_ENV = "MEGATRON_HPC_CLUSTER_CONFIG"

# Directives the launcher writes itself: a profile that set them would break the job's shape,
# its logs, the compile -> run dependency or the warning signal the trainer saves on.
_OWNED = {
    "nodes": "use --nodes", "N": "use --nodes", "ntasks-per-node": "the launcher runs one task per node",
    "ntasks": "the launcher runs one task per node", "n": "the launcher runs one task per node",
    "output": "logs go to the run folder", "o": "logs go to the run folder", "error": "logs go to the run folder",
    "e": "logs go to the run folder", "job-name": "the job is named after the recipe and phase",
    "J": "the job is named after the recipe and phase", "dependency": "the run phase depends on the compile phase",
    "d": "the run phase depends on the compile phase", "signal": "the trainer saves on USR2 90 s before the limit",
    "open-mode": "logs are appended across requeues", "requeue": "the run phase is always requeueable",
    "time": "use time_limit_min (per phase) or --time", "t": "use time_limit_min (per phase) or --time",
    "partition": "use the partition key", "p": "use the partition key", "account": "use the account key",
    "A": "use the account key", "qos": "use the qos key", "q": "use the qos key",
    "constraint": "use the constraint key", "C": "use the constraint key", "exclude": "use the exclude key",
    "x": "use the exclude key", "exclusive": "use the exclusive key",
    "chdir": "jobs run in the folder submit ran in", "D": "jobs run in the folder submit ran in",
    "gpus-per-node": "the platform asks for its GPUs (p5: 8 per node)",
}
_FLAG = re.compile(r"^(?:#SBATCH\s+)?--?([A-Za-z][\w-]*)(?:[=\s]\s*(.+))?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class PhaseTimes:
    compile: int | None = None
    """Time limit of the compile phase, minutes."""
    run: int | None = None
    """Time limit of the run phase, minutes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ContainerConfig:
    """A pyxis/enroot container that srun starts each node's task in."""

    image: str | None = None
    """srun --container-image (e.g. nvcr.io#nvidia/pytorch:24.05-py3 or a .sqsh path)."""
    mounts: tuple[str, ...] = ()
    """srun --container-mounts entries, SRC:DST[:FLAGS]; the run folder must be among them or below one."""
    workdir: str | None = None
    """srun --container-workdir."""
    extra_args: tuple[str, ...] = ()
    """More pyxis flags, e.g. --no-container-mount-home."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterProfile:
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    """sbatch --constraint, e.g. trn1.32xlarge or a feature name."""
    exclude: str | None = None
    """Nodes to avoid, e.g. node[3-4]."""
    time_limit_min: PhaseTimes = field(default_factory=PhaseTimes)
    exclusive: bool | None = None
    """Whole nodes; None keeps the recipe's launch.exclusive."""
    sbatch: tuple[str, ...] = ()
    """Extra #SBATCH lines, e.g. "--mail-type=END" or "--comment=sweep-3"."""
    setup: tuple[str, ...] = ()
    """Shell lines run in each sbatch script before srun (module load, source venv/bin/activate)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment set on every node before torchrun."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    max_requeues: int | None = None
    """Requeues of the run phase after a failure or preemption (default 3)."""
    platforms: tuple[Hardware, ...] = ()
    """The site's own nodes, each as a platform file's fields (config/hardware.py), named by --platform NAME."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoadedProfile:
    profile: ClusterProfile
    path: Path | None
    """Where it came from; None when no profile applies."""


def profile_to_json(loaded: LoadedProfile) -> dict:
    return {"path": str(loaded.path) if loaded.path else None, "profile": dataclasses.asdict(loaded.profile)}


def stored_profile(run_dir: Path) -> LoadedProfile | None:
    """The profile kept in a run folder by an earlier submit, or None."""
    path = run_dir / CLUSTER_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        origin = data.get("path")
        return LoadedProfile(profile=profile_from_dict(data["profile"], where=str(path)),
                             path=Path(origin) if origin else None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is damaged ({type(exc).__name__}: {exc}); pass --cluster-config again") from None


def default_profile_path(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")) / ".config").expanduser()
    return base / "megatron-hpc" / "cluster.yaml"


def find_profile(given: str | Path | None, environ: Mapping[str, str] | None = None) -> LoadedProfile:
    """The profile named on the command line, else by $MEGATRON_HPC_CLUSTER_CONFIG, else the default file."""
    env = os.environ if environ is None else environ
    if given is not None:
        return LoadedProfile(profile=load_profile(Path(given)), path=Path(given))
    if env.get(PROFILE_ENV):
        path = Path(env[PROFILE_ENV]).expanduser()
        if not path.is_file():
            raise ConfigError(f"${PROFILE_ENV} names {path}, which does not exist; fix or unset it")
        return LoadedProfile(profile=load_profile(path), path=path)
    path = default_profile_path(env)
    if path.is_file():
        return LoadedProfile(profile=load_profile(path), path=path)
    return LoadedProfile(profile=ClusterProfile(), path=None)


def load_profile(path: Path) -> ClusterProfile:
    if not path.is_file():
        raise ConfigError(f"cluster profile {path} does not exist; pass an existing YAML file to --cluster-config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"cluster profile {path}: not valid YAML: {exc}") from None
    return profile_from_dict(data or {}, where=str(path))


def profile_from_dict(data: object, *, where: str = "cluster profile") -> ClusterProfile:
    from megatron_hpc.config.platforms import PLATFORMS

    platforms = data.get("platforms", ()) if isinstance(data, Mapping) else ()
    if not isinstance(platforms, (list, tuple)):
        raise ConfigError(f"{where}: platforms must be a list of platform descriptions (docs/planning.md)")
    hardware = tuple(user_hardware(dataclasses.asdict(p) if isinstance(p, Hardware) else p,
                                   where=f"{where}: platforms[{i}]", runtimes=tuple(sorted(PLATFORMS)))
                     for i, p in enumerate(platforms))
    try:
        profile = from_dict(ClusterProfile, {k: v for k, v in data.items() if k != "platforms"}
                            if isinstance(data, Mapping) else data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    profile = dataclasses.replace(profile, platforms=hardware)
    sbatch_flags(profile)  # refuse bad lines now, not at sbatch time
    for name, value in profile.env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError(f"{where}: env key {name!r} is not a valid variable name")
        check_env_entry(name, value, where=where)
    container_srun_args(profile.container)
    if profile.max_requeues is not None and profile.max_requeues < 0:
        raise ConfigError(f"{where}: max_requeues must be 0 or more, got {profile.max_requeues}")
    for phase in ("compile", "run"):
        minutes = getattr(profile.time_limit_min, phase)
        if minutes is not None and minutes <= 0:
            raise ConfigError(f"{where}: time_limit_min.{phase} must be positive minutes, got {minutes}")
    return profile


NODE_SCRIPT_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                             "NODE_RANK", "GROUP_RANK"})
"""Set for each job by the node script and torchrun: a profile's value would be overwritten."""
NEURON_CORE_ENV = frozenset({"NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES"})


def check_env_entry(name: str, value: str, *, where: str) -> None:
    """Refuse profile variables that would be ignored or break the rendezvous (neuron-xla.md 4.4)."""
    if name in NODE_SCRIPT_ENV:
        raise ConfigError(f"{where}: env {name} is set for each job by the node script and torchrun (the master "
                          f"port comes from the job id: {MASTER_PORT_BASE}-{MASTER_PORT_BASE + MASTER_PORT_SPAN - 1}); "
                          "remove it from the profile")
    if name in NEURON_CORE_ENV:
        raise ConfigError(f"{where}: env {name} must not be set: torch-xla gives each worker its NeuronCore from "
                          "LOCAL_RANK, and a node-wide value breaks nodes with several workers; remove it")
    if name == "NEURON_RT_ROOT_COMM_ID":
        port = value.rpartition(":")[2]
        if not port.isdigit():
            raise ConfigError(f"{where}: env NEURON_RT_ROOT_COMM_ID={value!r} is not HOST:PORT; remove it to get "
                              "the Neuron runtime's default (the master node, port 62182)")
        if MASTER_PORT_BASE <= int(port) < MASTER_PORT_BASE + MASTER_PORT_SPAN:
            raise ConfigError(f"{where}: env NEURON_RT_ROOT_COMM_ID uses port {port}, inside the range the master "
                              f"port is drawn from ({MASTER_PORT_BASE}-{MASTER_PORT_BASE + MASTER_PORT_SPAN - 1}), so "
                              "the two can collide; use a port outside it, or remove it for the default 62182")


def sbatch_flags(profile: ClusterProfile) -> tuple[tuple[str, str | None], ...]:
    """The extra #SBATCH lines as (long flag, value or None for a bare flag)."""
    flags = []
    for line in profile.sbatch:
        m = _FLAG.match(line.strip())
        if m is None:
            raise ConfigError(f"cluster profile sbatch line {line!r} is not an sbatch option; write it as "
                              "--option=value (e.g. --mail-type=END)")
        name, value = m.group(1), m.group(2)
        if name in _OWNED:
            raise ConfigError(f"cluster profile sbatch line {line!r}: --{name} is set by megatron-hpc "
                              f"({_OWNED[name]})")
        flags.append((name, value.strip() if value else None))
    return tuple(flags)


def container_srun_args(container: ContainerConfig) -> tuple[str, ...]:
    if container.image is None:
        if container.mounts or container.workdir or container.extra_args:
            raise ConfigError("cluster profile container: mounts, workdir or extra_args without an image; "
                              "set container.image")
        return ()
    args = [f"--container-image={container.image}"]
    if container.mounts:
        args.append(f"--container-mounts={','.join(container.mounts)}")
    if container.workdir:
        args.append(f"--container-workdir={container.workdir}")
    return (*args, *container.extra_args)


def profile_env(profile: ClusterProfile) -> dict[str, str]:
    """What the profile adds to every node's environment (its env, and the requeue cap)."""
    env = dict(profile.env)
    if profile.max_requeues is not None:
        env[MAX_REQUEUES_ENV] = str(profile.max_requeues)
    return env


def slurm_options(profile: ClusterProfile, *, partition: str | None = None, account: str | None = None,
                  qos: str | None = None, exclude: str | None = None, constraint: str | None = None,
                  time_limit_min: int | None = None) -> SlurmOptions:
    """The profile with the command line's flags laid over it."""
    times = {phase: minutes for phase in ("compile", "run")
             if (minutes := getattr(profile.time_limit_min, phase)) is not None}
    return SlurmOptions(
        partition=partition or profile.partition, account=account or profile.account, qos=qos or profile.qos,
        exclude=exclude or profile.exclude, constraint=constraint or profile.constraint,
        time_limit_min=time_limit_min, phase_time_min=times, exclusive=profile.exclusive,
        extra_sbatch=sbatch_flags(profile), setup=profile.setup, srun_extra=container_srun_args(profile.container))


def describe(loaded: LoadedProfile) -> str:
    """One line for the submit output."""
    if loaded.path is None:
        return "cluster profile: none"
    p = loaded.profile
    parts = [f"{k} {v}" for k, v in (("partition", p.partition), ("account", p.account), ("qos", p.qos),
                                     ("constraint", p.constraint)) if v]
    if p.container.image:
        parts.append(f"container {shlex.quote(p.container.image)}")
    return f"cluster profile: {loaded.path}" + (f" ({', '.join(parts)})" if parts else "")
