"""The Kubernetes API calls of a k8s run: the kube context, job states, waiting, cancelling and pod logs.

Apart from launch/k8s_submit.py so that `status`, `logs` and `cancel` (launch/run_status.py) reach them without
importing the submit path. Never run against a cluster by our tests (docs/kubernetes.md), except
state_from_conditions, which is pure.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from megatron_hpc.launch import k8s_objects as ko

from megatron_hpc.errors import LaunchError


def load_kube_config() -> None:
    """The current kube context (or the pod's service account); LaunchError with the fix when there is none."""
    from kubernetes import config

    try:
        config.load_kube_config()
    except Exception as exc:  # ConfigException, or a missing/unreadable kubeconfig file
        try:
            config.load_incluster_config()
        except config.ConfigException:
            raise LaunchError(f"no kube context ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                              "run `aws eks update-kubeconfig --name CLUSTER` or set KUBECONFIG, or use --dry-run "
                              "to write the YAML only") from None


def job_state(job_id: str, *, namespace: str) -> str:
    """A SLURM-like state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED) of `kind/name` from the API."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    kind, _, name = job_id.partition("/")
    try:
        if kind == "job":
            status = client.BatchV1Api().read_namespaced_job_status(name, namespace).to_dict().get("status") or {}
        else:
            status = client.CustomObjectsApi().get_namespaced_custom_object(
                ko.PYTORCHJOB_GROUP, ko.PYTORCHJOB_VERSION, namespace, ko.PYTORCHJOB_PLURAL, name).get("status") or {}
    except ApiException as exc:
        return "CANCELLED" if exc.status == 404 else "UNKNOWN"
    return state_from_conditions(status.get("conditions") or [])


_CONDITION_STATE = {"Created": "PENDING", "Running": "RUNNING", "Restarting": "RUNNING", "Suspended": "PENDING",
                    "Succeeded": "COMPLETED", "Complete": "COMPLETED", "Failed": "FAILED"}


def state_from_conditions(conditions: list[dict[str, Any]]) -> str:
    """The last true condition of a PyTorchJob or Job status as a SLURM-like state. Pure."""
    state = "PENDING"
    for cond in conditions:
        if str(cond.get("status")) == "True" and cond.get("type") in _CONDITION_STATE:
            state = _CONDITION_STATE[cond["type"]]
    return state


def wait_for(kind: str, name: str, *, namespace: str, poll_s: float = 10.0) -> str:
    while True:
        state = job_state(f"{kind}/{name}", namespace=namespace)
        if state in ("COMPLETED", "FAILED", "CANCELLED"):
            return state
        time.sleep(poll_s)


def cancel_jobs(job_ids: list[str], *, namespace: str) -> None:
    """Delete the jobs (their pods go with them: Foreground propagation)."""
    from kubernetes import client

    load_kube_config()
    for job_id in job_ids:
        kind, _, name = job_id.partition("/")
        if kind == "job":
            client.BatchV1Api().delete_namespaced_job(name, namespace, propagation_policy="Foreground")
        else:
            client.CustomObjectsApi().delete_namespaced_custom_object(
                ko.PYTORCHJOB_GROUP, ko.PYTORCHJOB_VERSION, namespace, ko.PYTORCHJOB_PLURAL, name,
                propagation_policy="Foreground")


def pod_log(job_id: str, *, namespace: str, node: int | None, follow: bool = False) -> Iterator[str]:
    """The log of one node's pod: node 0 (the default) is the master, node i the worker i - 1 (the operator's pod
    names); with `follow`, streamed until the container ends."""
    from kubernetes import client

    load_kube_config()
    core = client.CoreV1Api()
    kind, _, name = job_id.partition("/")
    if kind == "job":
        pods = core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items
        if not pods:
            raise LaunchError(f"no pod of {job_id} in namespace {namespace} yet; see `kubectl describe {job_id}`")
        pod, container = pods[-1].metadata.name, "preprocess"
    else:
        pod = f"{name}-master-0" if not node else f"{name}-worker-{node - 1}"
        container = ko.CONTAINER
    if not follow:
        yield core.read_namespaced_pod_log(pod, namespace, container=container)
        return
    stream = core.read_namespaced_pod_log(pod, namespace, container=container, follow=True, _preload_content=False)
    for chunk in stream.stream():
        yield chunk.decode(errors="replace")
