"""The Kubernetes objects of a `submit --cluster k8s`: Kubeflow PyTorchJobs, the preprocessing Job, a ConfigMap.

Built with the Kubernetes client's models and the Kubeflow training SDK's, never text templates. Pure: the
resolved config, plan and phase specs in, model objects out; launch/k8s_submit.py writes and applies them.

Every pod runs the very node script a SLURM node runs (launch/scripts.py render_node_script), shipped in the
ConfigMap: the same exports, ulimit, node-local compile cache with sync and publish, torchrun command line and
requeue bookkeeping. node.sh takes NNODES from MEGATRON_HPC_K8S_NNODES and the node rank, master address and
port from the training operator's RANK, MASTER_ADDR and MASTER_PORT (kubeflow/training-operator
pkg/controller.v1/pytorch/envvar.go: RANK is the replica index, master 0, worker i is i + 1; the port is the
master container's port named `pytorchjob-port`, in a container named `pytorch`).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

# Every k8s path (submit, status, logs, cancel) comes through this module: a plain `pip install megatron-hpc` lacks
# the two client packages, and gets the extra to install instead of a traceback.
try:
    from kubeflow.training.models import (
        KubeflowOrgV1PyTorchJob,
        KubeflowOrgV1PyTorchJobSpec,
        KubeflowOrgV1ReplicaSpec,
        KubeflowOrgV1RunPolicy,
    )
    from kubernetes.client import (
        V1ConfigMap,
        V1ConfigMapVolumeSource,
        V1Container,
        V1ContainerPort,
        V1EmptyDirVolumeSource,
        V1EnvVar,
        V1Job,
        V1JobSpec,
        V1ObjectMeta,
        V1PersistentVolumeClaimVolumeSource,
        V1PodSpec,
        V1PodTemplateSpec,
        V1ResourceRequirements,
        V1Volume,
        V1VolumeMount,
    )
except ModuleNotFoundError as exc:
    from megatron_hpc.errors import LaunchError

    raise LaunchError(f"--cluster k8s needs the Kubernetes and Kubeflow client packages ({exc.name} is missing); "
                      "pip install 'megatron-hpc[k8s]'") from None

from megatron_hpc.config.instance_types import (
    EFA_RESOURCE,
    HUGEPAGES_RESOURCE,
    INSTANCE_TYPE_LABEL,
    InstanceType,
)
from megatron_hpc.config.schema import DataConfig, K8sConfig
from megatron_hpc.plan.jobs import PhaseSpec

PYTORCHJOB_GROUP = "kubeflow.org"
PYTORCHJOB_VERSION = "v1"
PYTORCHJOB_PLURAL = "pytorchjobs"
CONTAINER = "pytorch"
"""The training operator injects its environment into the container of this name only."""
MASTER_PORT = 23456
PORT_NAME = "pytorchjob-port"
NNODES_ENV = "MEGATRON_HPC_K8S_NNODES"
LOCAL_CACHE_ENV = "MEGATRON_HPC_LOCAL_CACHE_DIR"
SPEC_MOUNT = "/etc/megatron-hpc"
LOCAL_CACHE_MOUNT = "/var/cache/megatron-hpc"
SPEC_FILES = ("config.json", "plan.json", "compile-fingerprint.json")
"""Run-folder files the pods copy from the ConfigMap into the run folder on the claim before node.sh runs."""
_LABEL = "megatron-hpc/run"


@dataclass(frozen=True, kw_only=True, slots=True)
class PodSite:
    """Where one run lives inside the pods, and on what they run."""

    k8s: K8sConfig
    image: str
    volume_claim: str
    instance: InstanceType | None
    run_name: str
    """DNS-1123 name of the run: prefix of every object's name."""
    run_dir: str
    """The run folder on the claim, as the pods see it."""


def dns_name(text: str, *, limit: int = 40) -> str:
    """A DNS-1123 label from `text` (lower case, digits and '-'), short enough for the operator's pod suffixes."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return name[:limit].rstrip("-") or "run"


def pod_run_dir(k8s: K8sConfig, *, recipe: str, run_id: str) -> str:
    return f"{k8s.mount_path.rstrip('/')}/runs/{recipe}/{run_id}"


def pod_cache_root(k8s: K8sConfig) -> str:
    """The shared compile cache on the claim (node.sh syncs from it and publishes to it)."""
    return f"{k8s.mount_path.rstrip('/')}/compile-cache"


def config_map(site: PodSite, *, files: dict[str, str]) -> V1ConfigMap:
    """node.sh and the run spec, mounted read-only at SPEC_MOUNT in every pod."""
    return V1ConfigMap(api_version="v1", kind="ConfigMap", metadata=_meta(site, f"{site.run_name}-spec"),
                       data=dict(sorted(files.items())))


def node_resources(instance: InstanceType | None) -> V1ResourceRequirements | None:
    """A whole node: every device and EFA interface, and the hugepages the EFA provider registers from.

    Extended resources and hugepages must be asked as limits equal to requests. A pod that asks hugepages must
    ask cpu or memory too: half the vCPUs, which the one pod per node (it takes every device) never contends for.
    """
    if instance is None:
        return None
    amounts = {instance.device_resource: str(instance.devices_per_node),
               EFA_RESOURCE: str(instance.efa_interfaces),
               HUGEPAGES_RESOURCE: f"{instance.hugepages_2mi_mib}Mi",
               "cpu": str(instance.vcpus // 2)}
    return V1ResourceRequirements(limits=dict(amounts), requests=dict(amounts))


def _volumes(site: PodSite) -> tuple[list[V1Volume], list[V1VolumeMount]]:
    volumes = [
        V1Volume(name="shared", persistent_volume_claim=V1PersistentVolumeClaimVolumeSource(
            claim_name=site.volume_claim)),
        # Docker's 64 MiB /dev/shm is too small for NCCL and data loader workers.
        V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=f"{site.k8s.shm_gib}Gi")),
        V1Volume(name="spec", config_map=V1ConfigMapVolumeSource(name=f"{site.run_name}-spec")),
        # node.sh's node-local compile cache: on the node's disk, never the shared claim (NFS-like locks).
        V1Volume(name="local-cache", empty_dir=V1EmptyDirVolumeSource()),
    ]
    mounts = [V1VolumeMount(name="shared", mount_path=site.k8s.mount_path),
              V1VolumeMount(name="dshm", mount_path="/dev/shm"),
              V1VolumeMount(name="spec", mount_path=SPEC_MOUNT, read_only=True),
              V1VolumeMount(name="local-cache", mount_path=LOCAL_CACHE_MOUNT)]
    return volumes, mounts


def node_command(run_dir: str, phase: str) -> list[str]:
    """Put the run spec into the run folder on the claim (a restarted pod keeps what is there), then node.sh."""
    copies = "; ".join(f"[ -e {shlex.quote(f'{run_dir}/{name}')} ] || cp {SPEC_MOUNT}/{name} {shlex.quote(run_dir)}/"
                       for name in SPEC_FILES)
    script = f"set -e; mkdir -p {shlex.quote(run_dir)}; {copies}; exec bash {SPEC_MOUNT}/node.sh {phase}"
    return ["bash", "-c", script]


def node_pod_template(site: PodSite, spec: PhaseSpec) -> V1PodTemplateSpec:
    """The pod of one node of a phase: the same environment as node.sh exports (also visible in `kubectl
    describe`), the node count, and a node-local cache folder."""
    volumes, mounts = _volumes(site)
    env = [V1EnvVar(name=k, value=v) for k, v in sorted(spec.env.items())]
    env += [V1EnvVar(name=NNODES_ENV, value=str(spec.num_nodes)),
            V1EnvVar(name=LOCAL_CACHE_ENV, value=LOCAL_CACHE_MOUNT)]
    container = V1Container(name=CONTAINER, image=site.image, command=node_command(site.run_dir, spec.phase),
                            env=env, ports=[V1ContainerPort(name=PORT_NAME, container_port=MASTER_PORT)],
                            resources=node_resources(site.instance), volume_mounts=mounts,
                            working_dir=site.k8s.mount_path)
    selector = {INSTANCE_TYPE_LABEL: site.instance.ec2_name} if site.instance else None
    return V1PodTemplateSpec(metadata=V1ObjectMeta(labels={_LABEL: site.run_name}),
                             spec=V1PodSpec(containers=[container], volumes=volumes, node_selector=selector))


def pytorch_job(site: PodSite, spec: PhaseSpec, *, backoff_limit: int) -> KubeflowOrgV1PyTorchJob:
    """A phase as a PyTorchJob: one Master and num_nodes - 1 Workers, each restarted in place on failure (the
    trainer resumes from the newest complete checkpoint, as after a SLURM requeue), until the pods' restarts add up
    to backoff_limit."""
    template = node_pod_template(site, spec)
    replicas = {"Master": KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy="OnFailure", template=template)}
    if spec.num_nodes > 1:
        replicas["Worker"] = KubeflowOrgV1ReplicaSpec(replicas=spec.num_nodes - 1, restart_policy="OnFailure",
                                                      template=template)
    return KubeflowOrgV1PyTorchJob(
        api_version=f"{PYTORCHJOB_GROUP}/{PYTORCHJOB_VERSION}", kind="PyTorchJob",
        metadata=_meta(site, phase_job_name(site.run_name, spec.phase)),
        spec=KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(spec.nproc_per_node), pytorch_replica_specs=replicas,
            # Pods stay after the end, so that `megatron-hpc logs` and kubectl can read them.
            run_policy=KubeflowOrgV1RunPolicy(backoff_limit=backoff_limit, clean_pod_policy="None")))


def phase_job_name(run_name: str, phase: str) -> str:
    return f"{run_name}-{phase}"


PREPROCESS_SUFFIX = "_text_document"
"""What `data preprocess` appends to --output-prefix (Megatron's `{prefix}_{json key}_{level}`, key text)."""


def preprocess_command(k8s: K8sConfig, data: DataConfig) -> list[str]:
    """`megatron-hpc data preprocess` of k8s.preprocess_input into data.path, with the recipe's tokenizer. The
    prefix is data.path less the suffix the tool adds, so the files land where the run reads them (pod_site
    refuses a data.path without it)."""
    prefix = str(data.path).removesuffix(PREPROCESS_SUFFIX)
    argv = ["megatron-hpc", "data", "preprocess", "--input", str(k8s.preprocess_input),
            "--output-prefix", prefix, "--tokenizer-type", data.tokenizer_type]
    for flag, value in (("--vocab-file", data.vocab_file), ("--merge-file", data.merge_file),
                        ("--tokenizer-model", data.tokenizer_model)):
        if value:
            argv += [flag, value]
    return [*argv, "--append-eod"]


def preprocess_job(site: PodSite, data: DataConfig) -> V1Job:
    """One pod on the claim, no accelerators; the download before it is the user's."""
    volumes, mounts = _volumes(site)
    container = V1Container(name="preprocess", image=site.image, command=preprocess_command(site.k8s, data),
                            volume_mounts=[m for m in mounts if m.name in ("shared", "dshm")],
                            working_dir=site.k8s.mount_path)
    pod = V1PodSpec(containers=[container], restart_policy="OnFailure",
                    volumes=[v for v in volumes if v.name in ("shared", "dshm")])
    return V1Job(api_version="batch/v1", kind="Job", metadata=_meta(site, phase_job_name(site.run_name, "preprocess")),
                 spec=V1JobSpec(backoff_limit=2, template=V1PodTemplateSpec(
                     metadata=V1ObjectMeta(labels={_LABEL: site.run_name}), spec=pod)))


def _meta(site: PodSite, name: str) -> V1ObjectMeta:
    return V1ObjectMeta(name=name, namespace=site.k8s.namespace, labels={_LABEL: site.run_name})
