"""EC2 instance types as data, beside the platforms: what a Kubernetes pod on one node asks for.

A platform (platforms.py) says how a job runs (workers, backend, environment); an instance type says
what a Kubernetes node offers to one pod: its devices under the device plugin's resource name, its EFA
interfaces, and the memory of each device. Several instance types run one platform's plan (p5, p5e,
p5en and p6-b200 all run the 8-GPU `p5` plan); the planner keeps the platform's memory per worker, so
on the larger GPUs it plans conservatively.

Sources (read 2026-11-24):
- Resource names. GPUs: `nvidia.com/gpu` (NVIDIA k8s device plugin). EFA: `vpc.amazonaws.com/efa`, the
  extended resource the EFA device plugin advertises (docs.aws.amazon.com/eks/latest/userguide/
  device-management-efa.html). Neuron: `aws.amazon.com/neuron` allocates whole Neuron devices (chips) with all
  their cores; `aws.amazon.com/neuroncore` single cores; the older `aws.amazon.com/neurondevice` is kept for
  backward compatibility (awsdocs-neuron.readthedocs-hosted.com containers/tutorials/k8s-neuron-device-plugin).
- EFA interfaces: 32 on p5.48xlarge and p5e.48xlarge, 16 on p5en.48xlarge (EC2 user guide efa-acc-inst-types,
  "32 EFA devices" for P5/P5e; torchx's named_resources_aws agrees: p5/p5e 32, p5en 16); trn1.32xlarge 8 x 100
  Gbit (800 Gbps, Neuron trn1-arch). p6-b200.48xlarge 8 and trn2.48xlarge 16 are from the EC2 accelerated
  instance spec table, not re-checked against a live node: `kubectl describe node` shows the allocatable counts.
- vCPUs: 192 on p5/p5e/p5en (torchx named_resources_aws), p6-b200 and trn2; 128 on trn1.32xlarge (Neuron trn1-arch).
- Device memory: H100 80 GB, H200 141 GB, B200 179 GB (1440 GB / 8); Trainium 32 GiB per chip (trn1.32xlarge:
  512 GiB over 16 chips, Neuron trn1-arch), Trainium2 96 GiB per chip (1.5 TiB over 16).
- Hugepages: libfabric's EFA provider registers memory from 2 MiB hugepages; the EFA/EKS examples give a pod
  5120Mi of hugepages-2Mi.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from megatron_hpc.errors import ConfigError

GPU_RESOURCE = "nvidia.com/gpu"
NEURON_RESOURCE = "aws.amazon.com/neuron"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
"""The well-known node label the kubelet sets from the cloud provider; pods select their instance type by it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InstanceType:
    name: str
    """Short name used by k8s.instance_type (p5, trn1, ...)."""
    ec2_name: str
    """The EC2 instance type, the value of the node.kubernetes.io/instance-type label."""
    platform: str
    """The platform (platforms.py) whose plan runs on it."""
    device_resource: str
    """The extended resource name of its accelerators (nvidia.com/gpu or aws.amazon.com/neuron)."""
    devices_per_node: int
    """Accelerators one node offers under device_resource (GPUs, or Neuron chips)."""
    workers_per_device: int
    """Training processes one device holds: 1 per GPU; 2 NeuronCores per trn1 chip; 4 logical cores (LNC=2) per
    trn2 chip."""
    efa_interfaces: int
    """EFA interfaces (vpc.amazonaws.com/efa) of one node."""
    memory_per_device_gib: float
    """Accelerator memory of one device."""
    vcpus: int
    """Host vCPUs (192 on the p5/p6 48xlarge sizes and trn2.48xlarge, 128 on trn1.32xlarge)."""
    hugepages_2mi_mib: int = 5120
    """2 MiB hugepages a pod asks for (libfabric's EFA provider registers its buffers there)."""

    @property
    def workers_per_node(self) -> int:
        """Processes per node when every device is used: what torchrun --nproc-per-node may go up to."""
        return self.devices_per_node * self.workers_per_device


def _types(*rows: tuple[str, str, str, str, int, int, int, float, int]) -> dict[str, InstanceType]:
    return {row[0]: InstanceType(name=row[0], ec2_name=row[1], platform=row[2], device_resource=row[3],
                                 devices_per_node=row[4], workers_per_device=row[5], efa_interfaces=row[6],
                                 memory_per_device_gib=row[7], vcpus=row[8]) for row in rows}


INSTANCE_TYPES: dict[str, InstanceType] = _types(
    # name      EC2 type            platform resource        devices workers/device EFA  GiB/device vCPUs
    ("p5",      "p5.48xlarge",      "p5",   GPU_RESOURCE,    8,  1, 32, 80.0,  192),
    ("p5e",     "p5e.48xlarge",     "p5",   GPU_RESOURCE,    8,  1, 32, 141.0, 192),
    ("p5en",    "p5en.48xlarge",    "p5",   GPU_RESOURCE,    8,  1, 16, 141.0, 192),
    ("p6-b200", "p6-b200.48xlarge", "p5",   GPU_RESOURCE,    8,  1, 8,  179.0, 192),
    ("trn1",    "trn1.32xlarge",    "trn1", NEURON_RESOURCE, 16, 2, 8,  32.0,  128),
    ("trn2",    "trn2.48xlarge",    "trn2", NEURON_RESOURCE, 16, 4, 16, 96.0,  192),
)


def get_instance_type(name: str) -> InstanceType:
    """The instance type called `name`, or a ConfigError with the closest known name."""
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(INSTANCE_TYPES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"k8s.instance_type: unknown instance type {name!r}; {hint}use one of "
                          f"{', '.join(INSTANCE_TYPES)}") from None


def default_instance_type(platform: str) -> InstanceType | None:
    """The instance type named like the platform (p5 -> p5.48xlarge), or None (cpu has none)."""
    return INSTANCE_TYPES.get(platform)
