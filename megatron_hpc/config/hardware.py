"""What a node's hardware can do, as data: peak FLOP/s, memory, links. Built-ins with their sources, and the
platform file a user describes their own nodes with (`plan --platform-file hw.yaml`, `platforms:` in a cluster
profile).

The step-time model (plan/steptime.py) reads only these numbers. Each is a datasheet figure: what the vendor
states, not what a run achieves (the achievable share lives in plan/calibration.py). Units are in the field names
and are bytes, never bits: a bandwidth of 3200 in a GB/s field is a NIC's Gbit/s and is refused by magnitude.

A platform file names a `runtime`, the built-in platform whose launcher, backend and environment the nodes run with
(an A100 DGX node runs like p5: CUDA, NCCL, one worker per GPU); its figures replace the runtime's in the plan.
Pure: the file is read by the caller (load_platform_file is the one function that opens it).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_hpc.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One kind of link as a collective sees it."""

    bandwidth_gbytes_per_s: float
    """Unidirectional bandwidth in GB/s (1e9 bytes): per worker inside a node, per node between nodes."""
    latency_us: float
    """Startup cost of one message or one step of a ring, microseconds."""

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbytes_per_s * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """One node type: its workers and what each can do. The fields of a platform file."""

    name: str
    """What `plan` calls it (a built-in's own name, or the file's)."""
    runtime: str
    """The built-in platform whose launcher, backend and environment these nodes run with."""
    workers_per_node: int
    """Devices (one worker each) per node."""
    memory_per_worker_gib: float
    """Device memory of one worker, GiB."""
    memory_bandwidth_gbytes_per_s: float
    """Device memory bandwidth of one worker, GB/s: what element-wise work and the optimizer step are bound by."""
    peak_tflops_16bit: float
    """Dense bf16/fp16 peak of one worker, TFLOP/s (no sparsity)."""
    peak_tflops_fp32: float
    """Dense fp32 peak of one worker, TFLOP/s (what train.precision=fp32 matmuls run at)."""
    intra_node: Link
    """Between the workers of a node: bandwidth per worker."""
    inter_node: Link
    """Between nodes: bandwidth per node (all of a node's NICs together)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each figure comes from, by field name."""

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s of one worker at a train.precision."""
        return (self.peak_tflops_fp32 if precision == "fp32" else self.peak_tflops_16bit) * 1e12


_NEURON_ARCH = "awsdocs-neuron architecture pages (read 2026)"
BUILTIN_HARDWARE: dict[str, Hardware] = {
    "trn1": Hardware(
        name="trn1", runtime="trn1", workers_per_node=32, memory_per_worker_gib=16.0,
        memory_bandwidth_gbytes_per_s=410.0, peak_tflops_16bit=95.0, peak_tflops_fp32=23.75,
        intra_node=Link(bandwidth_gbytes_per_s=103.1, latency_us=10.0),
        inter_node=Link(bandwidth_gbytes_per_s=100.0, latency_us=20.0),
        sources={
            "peak_tflops_16bit": f"{_NEURON_ARCH}, trainium: 190 BF16 TFLOPS per chip of 2 NeuronCore-v2",
            "peak_tflops_fp32": f"{_NEURON_ARCH}, trainium: 47.5 FP32 TFLOPS per chip of 2 cores",
            "memory_per_worker_gib": f"{_NEURON_ARCH}, trainium: 32 GiB per chip of 2 cores",
            "memory_bandwidth_gbytes_per_s": f"{_NEURON_ARCH}, trainium: 820 GiB/s per chip of 2 cores",
            "inter_node": f"{_NEURON_ARCH}, trn1-arch: trn1.32xlarge EFA 800 Gbps = 100 GB/s",
            "intra_node": f"{_NEURON_ARCH}, trn1-arch: NeuronLink-v2 384 GiB/s per device on trn1.32xlarge "
                          "(768 on trn1n), read as both directions (as NVLink's 900 GB/s): 206 GB/s each way "
                          "per device of 2 cores",
            "latency_us": "assumed: typical collective startup costs, not published",
        },
    ),
    "trn2": Hardware(
        name="trn2", runtime="trn2", workers_per_node=64, memory_per_worker_gib=24.0,
        memory_bandwidth_gbytes_per_s=725.0, peak_tflops_16bit=166.75, peak_tflops_fp32=45.25,
        intra_node=Link(bandwidth_gbytes_per_s=160.0, latency_us=10.0),
        inter_node=Link(bandwidth_gbytes_per_s=400.0, latency_us=20.0),
        sources={
            "peak_tflops_16bit": f"{_NEURON_ARCH}, trainium2: 667 BF16 TFLOPS per chip = 4 logical cores at LNC=2",
            "peak_tflops_fp32": f"{_NEURON_ARCH}, trainium2: 181 FP32 TFLOPS per chip of 4 logical cores",
            "memory_per_worker_gib": f"{_NEURON_ARCH}, trainium2: 96 GiB per chip of 4 logical cores",
            "memory_bandwidth_gbytes_per_s": f"{_NEURON_ARCH}, trainium2: 2.9 TB/s per chip of 4 logical cores",
            "inter_node": "AWS trn2.48xlarge: 3.2 Tbps EFAv3 = 400 GB/s per node",
            "intra_node": f"{_NEURON_ARCH}, trainium2: NeuronLink-v3 1.28 TB/s per chip, read as both "
                          "directions (as NVLink's 900 GB/s): 640 GB/s each way per chip of 4 logical cores",
            "latency_us": "assumed: typical collective startup costs, not published",
        },
    ),
    "p5": Hardware(
        name="p5", runtime="p5", workers_per_node=8, memory_per_worker_gib=80.0,
        memory_bandwidth_gbytes_per_s=3350.0, peak_tflops_16bit=989.0, peak_tflops_fp32=67.0,
        intra_node=Link(bandwidth_gbytes_per_s=450.0, latency_us=5.0),
        inter_node=Link(bandwidth_gbytes_per_s=400.0, latency_us=10.0),
        sources={
            "peak_tflops_16bit": "NVIDIA H100 SXM datasheet: 989 dense BF16 TFLOPS (1979 with sparsity)",
            "peak_tflops_fp32": "NVIDIA H100 SXM datasheet: 67 FP32 TFLOPS",
            "memory_per_worker_gib": "NVIDIA H100 SXM datasheet: 80 GB HBM3",
            "memory_bandwidth_gbytes_per_s": "NVIDIA H100 SXM datasheet: 3.35 TB/s",
            "intra_node": "NVIDIA H100 SXM datasheet: NVLink 900 GB/s bidirectional = 450 GB/s each way",
            "inter_node": "AWS p5.48xlarge: 3200 Gbps EFA = 400 GB/s per node",
            "latency_us": "assumed: typical NCCL startup costs, not published",
        },
    ),
    "cpu": Hardware(
        name="cpu", runtime="cpu", workers_per_node=1, memory_per_worker_gib=4.0,
        memory_bandwidth_gbytes_per_s=20.0, peak_tflops_16bit=1.0, peak_tflops_fp32=1.0,
        intra_node=Link(bandwidth_gbytes_per_s=5.0, latency_us=50.0),
        inter_node=Link(bandwidth_gbytes_per_s=1.0, latency_us=100.0),
        sources={"all": "nominal: a CPU worker's speed depends on the host; predictions on cpu are only as good "
                        "as a measured calibration"},
    ),
}


def builtin_hardware(name: str) -> Hardware:
    """The hardware of built-in platform `name` (KeyError for another name: the caller checked it)."""
    return BUILTIN_HARDWARE[name]


# Largest plausible values, per worker or per node as the field says; a value above one is a unit slip.
_INTRA_MAX = 2000.0
"""GB/s of one worker inside a node: above any shipped NVLink (900 GB/s each way per GPU)."""
_INTER_MAX = 1000.0
"""GB/s of one node's NICs together: above any shipped node (3200 Gbit/s = 400 GB/s on p5 and trn2), so a node's
1600 or 3200 written in Gbit/s is caught; 800 Gbit/s written as GB/s is not (trn1's EFA is 100 GB/s)."""
_MEMORY_BANDWIDTH_MAX = 20000.0
_TFLOPS_MAX = 5000.0
_MEMORY_MAX_GIB = 1024.0
_LATENCY_MAX_US = 1000.0
_LATENCY_MIN_US = 0.05
_REQUIRED = ("name", "runtime", "workers_per_node", "memory_per_worker_gib", "memory_bandwidth_gbytes_per_s",
             "peak_tflops_16bit", "peak_tflops_fp32", "intra_node", "inter_node")
_LINK_FIELDS = ("bandwidth_gbytes_per_s", "latency_us")
_UNIT_TEXT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]+)\s*$")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""A platform's name: it is also a file name (compile_cache/calibrations.py keeps `<name>.json`)."""
_TEXT_FIELDS = ("name", "runtime", "sources")
"""Fields that are text, not numbers: never read as a number written with its unit."""
_UNIT_OF_NAME = (("_gib", "GiB"), ("_gbytes_per_s", "GB/s"), ("_us", "microseconds"), ("tflops", "TFLOP/s"),
                 ("workers_per_node", "a count"))


def hardware_from_dict(data: Any, *, where: str, runtimes: tuple[str, ...]) -> Hardware:
    """A platform file's mapping as Hardware; ConfigError naming the field and the fix for a missing field, an
    unknown one, or a value whose magnitude says its unit is wrong. `runtimes`: the built-in platform names."""
    from megatron_hpc.config.loader import from_dict

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of the platform's fields ({', '.join(_REQUIRED)})")
    missing = [k for k in _REQUIRED if k not in data]
    missing += [f"{link}.{k}" for link in ("intra_node", "inter_node") if isinstance(data.get(link), dict)
                for k in _LINK_FIELDS if k not in data[link]]
    if missing:
        raise ConfigError(f"{where}: missing {', '.join(missing)}; a platform file states every field (see "
                          "docs/planning.md#platform-files, or the shipped one: --platform-file dgx_a100_80gb)")
    _refuse_unit_text(data, where=where)
    hardware = from_dict(Hardware, data, where=where)
    if not _NAME.fullmatch(hardware.name):
        raise ConfigError(f"{where}: name {hardware.name!r} also names the file tune keeps its calibration in; use "
                          "letters, digits, '.', '_' and '-', starting with a letter or digit (e.g. dgx_a100_80gb)")
    if hardware.runtime not in runtimes:
        raise ConfigError(f"{where}: runtime {hardware.runtime!r} is not a built-in platform; use one of "
                          f"{', '.join(runtimes)} (the one whose launcher and backend the nodes run with)")
    _check_magnitudes(hardware, where=where)
    return hardware


def user_hardware(data: Any, *, where: str, runtimes: tuple[str, ...]) -> Hardware:
    """Hardware a user describes (a platform file, a cluster profile's `platforms:`): hardware_from_dict, with a
    name of its own. tune keeps a calibration per hardware name, so nodes named like a built-in would share its."""
    hardware = hardware_from_dict(data, where=where, runtimes=runtimes)
    if hardware.name in runtimes:
        raise ConfigError(f"{where}: name {hardware.name!r} is a built-in platform's, whose calibration tune would "
                          f"then share; give these nodes their own name (e.g. {hardware.name}-site)")
    return hardware


def _refuse_unit_text(data: dict[str, Any], *, where: str) -> None:
    """A number written with its unit ("400 Gbps") names the unit the field takes instead of a type error."""
    items = [(k, v) for k, v in data.items() if k not in _TEXT_FIELDS]
    items += [(f"{link}.{k}", v) for link in ("intra_node", "inter_node") if isinstance(data.get(link), dict)
              for k, v in data[link].items()]
    for key, value in items:
        m = _UNIT_TEXT.match(value) if isinstance(value, str) else None
        if m is None:
            continue
        number, unit = float(m.group(1)), m.group(2)
        if "bandwidth" in key and unit.lower() in ("gbps", "gbit/s", "gb/s") and unit != "GB/s":
            raise ConfigError(f"{where}: {key} is {value!r}, bits per second; this field takes GB/s (bytes) as a "
                              f"number: write {number / 8:g}")
        unit = next((u for part, u in _UNIT_OF_NAME if part in key), "see docs/planning.md")
        raise ConfigError(f"{where}: {key} is {value!r}; write a plain number in the unit the name gives ({unit})")


def _check_magnitudes(hw: Hardware, *, where: str) -> None:
    numbers = {"workers_per_node": hw.workers_per_node, "memory_per_worker_gib": hw.memory_per_worker_gib,
               "memory_bandwidth_gbytes_per_s": hw.memory_bandwidth_gbytes_per_s,
               "peak_tflops_16bit": hw.peak_tflops_16bit, "peak_tflops_fp32": hw.peak_tflops_fp32}
    for link in ("intra_node", "inter_node"):
        for key in _LINK_FIELDS:
            numbers[f"{link}.{key}"] = getattr(getattr(hw, link), key)
    for key, value in numbers.items():
        if value <= 0:
            raise ConfigError(f"{where}: {key} is {value}; it must be positive")
    for key, value in numbers.items():
        slip = _unit_slip(key, value)
        if slip:
            raise ConfigError(f"{where}: {key} is {value:g}, {slip}")


def _unit_slip(key: str, value: float) -> str | None:
    """Why `value` cannot be right for field `key`, with the fix; None when it is plausible."""
    limit = {"intra_node.bandwidth_gbytes_per_s": _INTRA_MAX, "inter_node.bandwidth_gbytes_per_s": _INTER_MAX}
    if key in limit and value > limit[key]:
        return (f"more than any link carries in GB/s: it looks like Gbit/s (bits); this field takes bytes: write "
                f"{value / 8:g}")
    if key == "memory_bandwidth_gbytes_per_s" and value > _MEMORY_BANDWIDTH_MAX:
        return f"more than any device memory delivers in GB/s: it looks like Gbit/s; write {value / 8:g}"
    if key.startswith("peak_tflops") and value > _TFLOPS_MAX:
        return ("more TFLOP/s than any one device: it looks like GFLOP/s or a whole node's; give one worker's "
                f"TFLOP/s (e.g. {value / 1000:g} or {value / 8:g} for 8 workers)")
    if key == "memory_per_worker_gib" and value > _MEMORY_MAX_GIB:
        return f"more GiB than any one device holds: it looks like MiB; write {value / 1024:g}"
    if key.endswith("latency_us") and value > _LATENCY_MAX_US:
        return f"over a millisecond: it looks like nanoseconds; give microseconds: {value / 1000:g}"
    if key.endswith("latency_us") and value < _LATENCY_MIN_US:
        return f"under 50 ns: it looks like seconds or milliseconds; give microseconds (e.g. {value * 1e6:g})"
    return None


def shipped_platform_files() -> dict[str, Path]:
    """The platform files shipped with the package (recipes/platforms/NAME.yaml), by name."""
    from megatron_hpc.config.loader import recipe_dir

    return {p.stem: p for p in sorted((recipe_dir() / "platforms").glob("*.yaml"))}


def resolve_platform_file(path: Path) -> Path:
    """`path`, or where it names a shipped platform file (`dgx_a100_80gb`, with or without .yaml) and is no file
    here, the shipped one: an install from a wheel has no recipes/ folder to point a path at."""
    if path.is_file() or len(path.parts) > 1:
        return path
    return shipped_platform_files().get(path.name.removesuffix(".yaml"), path)


def load_platform_file(path: Path, *, runtimes: tuple[str, ...]) -> Hardware:
    """Read and check a platform file (YAML), by path or a shipped one's name (resolve_platform_file)."""
    import yaml

    path = resolve_platform_file(path)
    if not path.is_file():
        shipped = ", ".join(shipped_platform_files())
        raise ConfigError(f"platform file {path} does not exist; pass an existing YAML file to --platform-file, or a "
                          f"shipped one by name ({shipped})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"platform file {path}: not valid YAML: {exc}") from None
    return user_hardware(data, where=f"platform file {path}", runtimes=runtimes)


def as_dict(hw: Hardware) -> dict[str, Any]:
    """The fields as a platform file holds them."""
    return dataclasses.asdict(hw)
