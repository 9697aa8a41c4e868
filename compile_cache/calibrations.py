"""Measured calibrations of the step-time model, kept in the shared cache beside the compile fingerprints.

`megatron-hpc tune` keeps what it fitted at `<cache root>/megatron-hpc/calibrations/<hardware>.json`: the cache
root is the cluster's shared folder (paths.py default_cache_root, MEGATRON_HPC_CACHE_DIR, which the cluster
profile's env may set), so a calibration belongs to the cluster whose nodes measured it, and the file name to the
hardware (a built-in platform, a platform file's or the profile's `platforms:` name). The newest tune replaces the
file. `plan` and `submit` read it (find) and use it when `usable` finds nothing wrong; otherwise they print the
one line it returns and plan on the built-in defaults.

Never imports torch: the versions are read from the installed distributions' metadata.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_hpc.atomic_write import write_json_atomic
from megatron_hpc.errors import CompileCacheError
from megatron_hpc.plan.calibration import Calibration

CALIBRATION_DIR = "megatron-hpc/calibrations"
MAX_AGE_DAYS = 30
"""Older calibrations are refused: drivers, compilers and the cluster's load move on."""
FUTURE_SLACK_S = 600.0
"""How far ahead of this machine's clock a calibration's date may be (the login node's and a compute node's clocks
differ a little); further ahead, its age is unknown and it is not used."""
_FIT_FIELDS = ("gemm_peak_fraction", "gemm_overhead_s", "collective_bandwidth_fraction", "collective_latency_factor",
               "memory_bandwidth_fraction", "elementwise_bytes_per_saved_byte", "optimizer_bytes_per_parameter",
               "tp_comm_overlap", "pp_comm_overlap", "attention_scores_in_memory", "op_overhead_factor")
_ADDED_FIELDS = ("op_overhead_factor",)
"""Fields added after calibrations were first kept: a record without one takes the default (1.0: the built-in)."""


def calibration_to_json(cal: Calibration) -> dict[str, Any]:
    return {"source": cal.source, **{k: getattr(cal, k) for k in _FIT_FIELDS}}


def calibration_from_json(data: dict[str, Any]) -> Calibration:
    """KeyError or TypeError on a record that lacks a field (the caller says which file)."""
    return Calibration(source=str(data["source"]),
                       **{k: data[k] for k in _FIT_FIELDS if k in data or k not in _ADDED_FIELDS})


def software_versions() -> dict[str, str]:
    """What the measured speed depends on besides the hardware: torch's and megatron-hpc's versions."""
    found = {}
    for key, dist in (("torch", "torch"), ("megatron_hpc", "megatron-hpc")):
        try:
            found[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[key] = "none"
    return found


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredCalibration:
    calibration: Calibration
    hardware: str
    runtime: str
    workers_per_node: int
    measured_at_s: float
    """Seconds since the epoch when the tune job fitted it."""
    versions: dict[str, str]
    run_dir: str
    """The tune run folder (its tune.json says what was measured)."""
    path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "runtime": self.runtime, "workers_per_node": self.workers_per_node,
                "measured_at_s": self.measured_at_s, "versions": self.versions, "run_dir": self.run_dir,
                "calibration": calibration_to_json(self.calibration)}

    @classmethod
    def from_json(cls, data: dict[str, Any], *, path: Path) -> StoredCalibration:
        try:
            cal = calibration_from_json(data["calibration"])
            return cls(calibration=cal, hardware=str(data["hardware"]), runtime=str(data["runtime"]),
                       workers_per_node=int(data["workers_per_node"]), measured_at_s=float(data["measured_at_s"]),
                       versions={str(k): str(v) for k, v in data["versions"].items()}, run_dir=str(data["run_dir"]),
                       path=path)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CompileCacheError(f"{path} is not a calibration megatron-hpc wrote ({type(exc).__name__}: {exc}); "
                                    "delete it and re-run `megatron-hpc tune`") from None

    def age_days(self, now_s: float) -> float:
        return max(0.0, now_s - self.measured_at_s) / 86400.0


def calibration_path(cache_root: Path, hardware: str) -> Path:
    return cache_root / CALIBRATION_DIR / f"{hardware}.json"


def keep(cache_root: Path, stored: StoredCalibration) -> Path:
    """Write `stored` as the hardware's calibration (replacing an older one, atomically)."""
    path = calibration_path(cache_root, stored.hardware)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, stored.to_json())
    return path


def find(cache_root: Path, hardware: str) -> StoredCalibration | None:
    """The hardware's kept calibration, or None when tune never ran for it on this cache."""
    path = calibration_path(cache_root, hardware)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CompileCacheError(f"cannot read the calibration {path} ({exc}); delete it and re-run "
                                "`megatron-hpc tune`") from None
    return StoredCalibration.from_json(data, path=path)


def usable(stored: StoredCalibration, *, hardware: str, now_s: float, runtime: str, workers_per_node: int,
           versions: dict[str, str]) -> str | None:
    """Why `stored` must not be used for a plan of `hardware` on `runtime` with `workers_per_node`, with the fix;
    None when it may. Stale (older than MAX_AGE_DAYS, or dated ahead of this clock: its age cannot be known) or
    foreign (another hardware's file copied under this name, another runtime, node shape or software version)."""
    fix = f"re-run `megatron-hpc tune` on this cluster (or delete {stored.path})"
    if stored.hardware != hardware:
        return (f"{stored.path} holds the calibration of {stored.hardware}, not {hardware}; planning on the built-in "
                f"defaults: {fix}")
    ahead = stored.measured_at_s - now_s
    if ahead > FUTURE_SLACK_S:
        return (f"the calibration of {stored.hardware} is dated {ahead / 3600:.1f} h after this machine's clock, so "
                f"its age is unknown; planning on the built-in defaults: check the clocks, then {fix}")
    age = stored.age_days(now_s)
    if age > MAX_AGE_DAYS:
        return (f"the calibration of {stored.hardware} is {age:.0f} days old (over {MAX_AGE_DAYS}); planning on the "
                f"built-in defaults: {fix}")
    if stored.runtime != runtime or stored.workers_per_node != workers_per_node:
        return (f"the calibration of {stored.hardware} was measured on {stored.runtime} with "
                f"{stored.workers_per_node} workers per node, this plan runs {runtime} with {workers_per_node}; "
                f"planning on the built-in defaults: {fix}")
    changed = [f"{k} {stored.versions.get(k, '?')} -> {v}" for k, v in versions.items() if stored.versions.get(k) != v]
    if changed:
        return (f"the calibration of {stored.hardware} was measured with other software ({', '.join(changed)}); "
                f"planning on the built-in defaults: {fix}")
    return None


def labelled(stored: StoredCalibration, *, now_s: float) -> Calibration:
    """The calibration with a source line that says where it was measured and how old it is."""
    age = stored.age_days(now_s)
    hours = age * 24
    when = f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.0f} h" if age < 2 else f"{age:.0f} days"
    return dataclasses.replace(stored.calibration,
                               source=f"measured by tune {when} ago ({stored.path or stored.run_dir})")
