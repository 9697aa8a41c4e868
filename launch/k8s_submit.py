"""`submit --cluster k8s`: check, write the run's Kubernetes objects as YAML, and apply them in order.

A dry run writes configmap.yaml, preprocess-job.yaml (with k8s.preprocess_input), compile-pytorchjob.yaml
(unless compile_left_out, or the shared cache holds the fingerprint) and pytorchjob.yaml to the run folder,
with apply.sh: the same order with `kubectl apply` and `kubectl wait`. A real submit applies the same
objects with the Kubernetes Python client to the current kube context, waits for the preprocessing Job and
the compile PyTorchJob to succeed (Kubernetes has no afterok), then creates the run PyTorchJob.

Never run against a cluster by our tests (docs/kubernetes.md): submit_k8s's applying and waiting, and the calls
of launch/k8s_api.py, are the untested part, kept small.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from megatron_hpc.launch import k8s_objects as ko
from megatron_hpc.launch.k8s_api import load_kube_config, wait_for
from megatron_hpc.launch.requeue import DEFAULT_MAX_REQUEUES, MAX_REQUEUES_ENV
from megatron_hpc.launch.resume import previous_submissions
from megatron_hpc.launch.scripts import render_node_script
from megatron_hpc.launch.submit import RunFiles, SubmitRequest, decide_phases

from megatron_hpc.config.instance_types import INSTANCE_TYPES, InstanceType, default_instance_type, get_instance_type
from megatron_hpc.config.schema import DataConfig, RunConfig
from megatron_hpc.errors import ConfigError, LaunchError
from megatron_hpc.plan.planner import Plan
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.run_folder import (
    SUBMISSION_FILE,
    FingerprintRecord,
    JobRecord,
    SubmissionRecord,
    write_json,
    write_script,
    write_spec,
)

APPLY_SCRIPT = "apply.sh"
CONFIGMAP_FILE = "configmap.yaml"


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One object to apply, in the order of the run: the next stage waits for this one to succeed."""

    phase: str
    file: str
    obj: Any
    kind: str
    """`job` (batch/v1) or `pytorchjob`, as kubectl names them."""

    @property
    def name(self) -> str:
        return self.obj.metadata.name

    @property
    def job_id(self) -> str:
        return f"{self.kind}/{self.name}"


def resolve_instance(cfg: RunConfig, plan: Plan) -> InstanceType:
    """The instance type the pods run on; refuses one the plan cannot use, with the fix."""
    if cfg.k8s.instance_type is None:
        found = default_instance_type(plan.platform)
        if found is None:
            raise ConfigError(f"--cluster k8s needs an accelerator platform, but the plan is for {plan.platform}; "
                              "use --platform p5, trn1 or trn2 (or --set k8s.instance_type=NAME)")
        instance = found
    else:
        instance = get_instance_type(cfg.k8s.instance_type)
    if instance.platform != plan.platform:
        fits = ", ".join(n for n, t in INSTANCE_TYPES.items() if t.platform == plan.platform) or "none"
        raise ConfigError(f"k8s.instance_type={instance.name} runs the {instance.platform} plan, but this plan is for "
                          f"{plan.platform}; use --platform {instance.platform}, or k8s.instance_type in {{{fits}}}")
    tp, per_node = plan.tensor_parallel, instance.workers_per_node
    if per_node % tp:
        choices = [d for d in range(1, per_node + 1) if per_node % d == 0]
        raise ConfigError(f"tp={tp} does not divide the {per_node} processes per node of {instance.ec2_name}; use "
                          f"--set parallel.tensor=N with N in {{{', '.join(map(str, choices))}}}")
    if plan.workers_per_node > per_node:
        raise ConfigError(f"the plan runs {plan.workers_per_node} processes per node, but {instance.ec2_name} holds "
                          f"{per_node}; use --set launch.workers_per_node={per_node} or a larger instance type")
    return instance


def pod_site(cfg: RunConfig, plan: Plan, *, run_id: str) -> ko.PodSite:
    """Everything the objects need from the recipe's k8s section, checked before anything is written."""
    k8s = cfg.k8s
    if not k8s.volume_claim:
        raise ConfigError("k8s.volume_claim is not set: the pods need a shared PersistentVolumeClaim for data, "
                          "checkpoints and the compile cache; add --set k8s.volume_claim=NAME "
                          f"(`kubectl get pvc -n {k8s.namespace}` lists them)")
    if not k8s.image:
        raise ConfigError("k8s.image is not set: the pods need an image with megatron-hpc installed; add "
                          "--set k8s.image=REGISTRY/IMAGE:TAG")
    if k8s.preprocess_input and not cfg.data.path:
        raise ConfigError("k8s.preprocess_input is set but data.path is not: the preprocessing Job writes data.path; "
                          "add --set data.path=PREFIX (on the claim)")
    path = str(cfg.data.path or "")
    if k8s.preprocess_input and (len(path.split()) != 1 or not path.endswith(ko.PREPROCESS_SUFFIX)):
        # `data preprocess` writes PREFIX_text_document.bin/.idx: another data.path (or a blend) is never written.
        fix = (f"--set data.path={path}{ko.PREPROCESS_SUFFIX}" if len(path.split()) == 1
               else f"--set data.path=PREFIX{ko.PREPROCESS_SUFFIX} (one prefix, not a blend)")
        raise ConfigError(f"k8s.preprocess_input writes <prefix>{ko.PREPROCESS_SUFFIX}.bin/.idx, which "
                          f"data.path={path!r} does not name, so the run would not find what the Job wrote; use {fix}")
    if k8s.preprocess_input and (fix := _missing_tokenizer_files(cfg.data)):
        raise ConfigError(f"k8s.preprocess_input: the preprocessing Job's {cfg.data.tokenizer_type} needs its files, "
                          f"which the recipe does not name (the Job would fail in its pod); add {fix}")
    instance = resolve_instance(cfg, plan)
    return ko.PodSite(k8s=k8s, image=k8s.image, volume_claim=k8s.volume_claim, instance=instance,
                      run_name=ko.dns_name(f"{cfg.name}-{run_id}"),
                      run_dir=ko.pod_run_dir(k8s, recipe=cfg.name, run_id=run_id))


def _missing_tokenizer_files(data: DataConfig) -> str | None:
    """The --set that names the files `data preprocess` needs for data.tokenizer_type, or None when they are named.
    The tool refuses the same (data/text_tokenizers.py::tokenizer_spec), but only in the pod, after the apply."""
    if data.tokenizer_type == "GPT2BPETokenizer":
        if data.vocab_file and data.merge_file:
            return None
        return "--set data.vocab_file=PATH/vocab.json --set data.merge_file=PATH/merges.txt (on the claim)"
    if data.tokenizer_model or (data.tokenizer_type in ("HuggingFaceTokenizer", "HFTokenizer") and data.vocab_file):
        return None  # GPT-NeoX spells a tokenizer.json --vocab-file
    return "--set data.tokenizer_model=PATH (on the claim: a tokenizer folder or tokenizer.json, or a SentencePiece " \
        ".model)"


def build_stages(req: SubmitRequest, site: ko.PodSite, files: RunFiles) -> list[Stage]:
    """The objects of the run in the order they are applied: preprocess, compile, run."""
    stages: list[Stage] = []
    if req.cfg.k8s.preprocess_input:
        stages.append(Stage(phase="preprocess", file="preprocess-job.yaml", kind="job",
                            obj=ko.preprocess_job(site, req.cfg.data)))
    for spec in files.phases:
        # The operator sums the restarts of every pod against backoffLimit, and one failure restarts every node's
        # torchrun: the SLURM requeue cap (the cluster profile's max_requeues), counted per node.
        cap = spec.env.get(MAX_REQUEUES_ENV, "")
        limit = (int(cap) if cap.isdigit() else DEFAULT_MAX_REQUEUES) * spec.num_nodes
        stages.append(Stage(phase=spec.phase, file="pytorchjob.yaml" if spec.phase == "run" else
                            f"{spec.phase}-pytorchjob.yaml", kind="pytorchjob",
                            obj=ko.pytorch_job(site, spec, backoff_limit=limit)))
    return stages


def spec_files(req: SubmitRequest, site: ko.PodSite, files: RunFiles) -> dict[str, str]:
    """The ConfigMap's files: node.sh rendered for the pods' paths, and the run folder's spec as written."""
    node = render_node_script(files.phases[0], recipe=req.cfg.name, run_dir=site.run_dir, bin_dir=site.k8s.bin_dir,
                              backend=req.platform.backend, shared_cache=str(req.cache_root))
    out = {"node.sh": node}
    for name in ko.SPEC_FILES:
        out[name] = (req.run_dir / name).read_text()
    return out


def to_yaml(obj: Any) -> str:
    """The API's JSON form of a client or SDK model (the client's own serializer), as YAML."""
    from kubernetes.client import ApiClient

    return yaml.safe_dump(ApiClient().sanitize_for_serialization(obj), sort_keys=False)


def write_k8s_files(req: SubmitRequest) -> tuple[RunFiles, list[Stage], Any]:
    """Check, then write the run spec, the YAML files and apply.sh to the run folder; nothing is applied."""
    site = pod_site(req.cfg, req.plan, run_id=req.run_dir.name)
    files = decide_phases(req)
    write_spec(req.run_dir, RunSpec(config=req.cfg, plan=req.plan))
    FingerprintRecord(sha256=files.fingerprint, inputs=files.fingerprint_inputs,
                      cache_root=str(req.cache_root)).write(req.run_dir)
    cmap = ko.config_map(site, files=spec_files(req, site, files))
    stages = build_stages(req, site, files)
    (req.run_dir / CONFIGMAP_FILE).write_text(to_yaml(cmap))
    for stage in stages:
        (req.run_dir / stage.file).write_text(to_yaml(stage.obj))
    write_script(req.run_dir / APPLY_SCRIPT, render_apply_script(stages, namespace=site.k8s.namespace,
                                                                 out_dir=str(req.run_dir)))
    return files, stages, cmap


def render_apply_script(stages: list[Stage], *, namespace: str, out_dir: str) -> str:
    """kubectl lines that apply the objects in order, each after the one before succeeded; a failed one stops the
    script (`kubectl wait --for=condition=Succeeded` would wait for ever on a failed job)."""
    ns = shlex.quote(namespace)
    lines = ["#!/usr/bin/env bash", "# Apply what `megatron-hpc submit --cluster k8s --dry-run` wrote, as submit does.",
             "set -euo pipefail",
             "wait_for() {  # KIND/NAME: returns once its last true condition is Succeeded/Complete; fails on Failed",
             "  local state",
             "  while :; do",
             f"    state=$(kubectl get -n {ns} \"$1\" -o jsonpath='{{range .status.conditions[?(@.status==\"True\")]}}"
             "{.type}{\"\\n\"}{end}' | tail -n 1)",
             '    case "$state" in',
             "      Succeeded|Complete) return 0 ;;",
             f'      Failed) echo "$1 failed; see: kubectl describe -n {namespace} $1" >&2; return 1 ;;',
             "    esac",
             "    sleep 10",
             "  done",
             "}",
             f"kubectl apply -n {ns} -f {shlex.quote(f'{out_dir}/{CONFIGMAP_FILE}')}"]
    for i, stage in enumerate(stages):
        lines.append(f"kubectl apply -n {ns} -f {shlex.quote(f'{out_dir}/{stage.file}')}")
        if i < len(stages) - 1:
            lines.append(f"wait_for {stage.job_id}")
    return "\n".join(lines) + "\n"


def submit_k8s(req: SubmitRequest, *, wait: bool,
               echo: Callable[[str], None] | None = None) -> tuple[RunFiles, list[JobRecord]]:
    """Check the kube context, write the files, apply them in order; records submission.json."""
    load_kube_config()
    files, stages, cmap = write_k8s_files(req)
    from kubernetes import client

    core, batch, custom = client.CoreV1Api(), client.BatchV1Api(), client.CustomObjectsApi()
    ns = req.cfg.k8s.namespace
    _create_or_replace_config_map(core, cmap, ns)
    jobs: list[JobRecord] = []
    history = previous_submissions(req.run_dir)  # a resumed run keeps its earlier jobs; read before ours replaces it
    for i, stage in enumerate(stages):
        _create(stage, batch=batch, custom=custom, namespace=ns, run_dir=req.run_dir)
        record = JobRecord(phase=stage.phase, job_id=stage.job_id, state="PENDING",
                           depends_on=jobs[-1].job_id if jobs else None)
        jobs.append(record)
        _record(req, files, jobs, history=history)
        if echo:
            echo(f"{stage.phase:<10} {stage.job_id} created in namespace {ns}")
        if i < len(stages) - 1 or wait:
            record.state = wait_for(stage.kind, stage.name, namespace=ns)
            _record(req, files, jobs, history=history)
            if record.state != "COMPLETED":
                raise LaunchError(f"{stage.phase} {stage.job_id} ended {record.state}; see `kubectl describe "
                                  f"{stage.job_id} -n {ns}` and `megatron-hpc logs {req.run_dir}`")
    return files, jobs


def _create(stage: Stage, *, batch: Any, custom: Any, namespace: str, run_dir: Path) -> None:
    from kubernetes.client import ApiClient
    from kubernetes.client.exceptions import ApiException

    body = ApiClient().sanitize_for_serialization(stage.obj)
    try:
        if stage.kind == "job":
            batch.create_namespaced_job(namespace, body)
        else:
            custom.create_namespaced_custom_object(ko.PYTORCHJOB_GROUP, ko.PYTORCHJOB_VERSION, namespace,
                                                   ko.PYTORCHJOB_PLURAL, body)
    except ApiException as exc:
        fix = (f"`megatron-hpc cancel {run_dir}` removes the earlier one" if exc.status == 409 else
               "is the Kubeflow training operator installed (`kubectl get crd pytorchjobs.kubeflow.org`)?"
               if exc.status == 404 else "check your permissions in the namespace")
        raise LaunchError(f"creating {stage.job_id} in namespace {namespace} failed ({exc.status} {exc.reason}); "
                          f"{fix}") from None


def _create_or_replace_config_map(core: Any, cmap: Any, ns: str) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        core.create_namespaced_config_map(ns, cmap)
    except ApiException as exc:
        if exc.status != 409:
            raise LaunchError(f"creating ConfigMap {cmap.metadata.name} failed: {exc.reason}; check the namespace "
                              f"{ns} exists and you may create objects there") from None
        core.replace_namespaced_config_map(cmap.metadata.name, ns, cmap)


def _record(req: SubmitRequest, files: RunFiles, jobs: list[JobRecord], *, history: list[dict[str, Any]]) -> None:
    write_json(req.run_dir / SUBMISSION_FILE, SubmissionRecord(
        cluster="k8s", jobs=jobs, compile_skipped=files.compile_skipped_by is not None,
        compile_left_out=files.compile_left_out, fingerprint=files.fingerprint, history=history).to_json())
