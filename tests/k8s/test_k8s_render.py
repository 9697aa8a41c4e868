"""`submit --cluster k8s --dry-run`: every recipe at 1, 16 and 64 nodes (where its plan is valid) renders Kubernetes
objects that round-trip through the Kubernetes client's and the Kubeflow SDK's models, that kubectl parses offline,
and that carry the plan: replicas, processes per node, the instance type's resources, the SLURM node script's
environment, the volume claim. No cluster: nothing is applied (docs/kubernetes.md says what never ran on one)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubeflow.training.api_client import ApiClient as KubeflowApiClient
from kubernetes.client import ApiClient
from megatron_hpc.launch.requeue import DEFAULT_MAX_REQUEUES

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import known_recipes, load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.errors import MegatronHpcError
from megatron_hpc.plan.planner import check_pipeline_runtime, make_plan

NODES = (1, 16, 64)
SYNTHETIC = ["--set", "data.source=synthetic"]
GPT2_FILES = ["--set", "data.vocab_file=tok/vocab.json", "--set", "data.merge_file=tok/merges.txt"]  # on the claim
K8S = ["--set", "k8s.volume_claim=fsx-claim", "--set", "k8s.image=example.org/megatron-hpc:1"]
# Written by hand from the AWS documentation (cited in megatron_hpc/config/instance_types.py), not from the code:
# instance type -> (device resource, devices per node, EFA interfaces, EC2 name).
AWS = {
    "p5": ("nvidia.com/gpu", 8, 32, "p5.48xlarge"),
    "p5e": ("nvidia.com/gpu", 8, 32, "p5e.48xlarge"),
    "p5en": ("nvidia.com/gpu", 8, 16, "p5en.48xlarge"),
    "p6-b200": ("nvidia.com/gpu", 8, 8, "p6-b200.48xlarge"),
    "trn1": ("aws.amazon.com/neuron", 16, 8, "trn1.32xlarge"),
    "trn2": ("aws.amazon.com/neuron", 16, 16, "trn2.48xlarge"),
}
MODEL_OF_KIND = {"ConfigMap": "V1ConfigMap", "Job": "V1Job", "PyTorchJob": "KubeflowOrgV1PyTorchJob"}


def _plan_ok(recipe: str, nodes: int) -> bool:
    cfg = load_recipe(recipe, ["data.source=synthetic"])
    if cfg.launch.platform == "cpu":
        return False
    try:
        check_pipeline_runtime(make_plan(cfg, num_nodes=nodes, platform=get_platform(cfg.launch.platform)))
    except MegatronHpcError:
        return False
    return True


CASES = [(r, n) for r in known_recipes() for n in NODES if _plan_ok(r, n)]


def render(out: Path, *args: str) -> int:
    return main(["submit", *args, "--cluster", "k8s", "--dry-run", "--out", str(out)])


def objects(out: Path) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}


def round_trip(data: dict) -> dict:
    """Deserialize the API JSON into the SDK/client model of its kind, and serialize it back."""

    class Response:
        def __init__(self, text: str):
            self.data = text

    model = KubeflowApiClient().deserialize(Response(json.dumps(data)), MODEL_OF_KIND[data["kind"]])
    assert type(model).__name__ == MODEL_OF_KIND[data["kind"]]
    return ApiClient().sanitize_for_serialization(model)


def kubectl_parse(kubectl: str, path: Path, tmp_path: Path) -> dict:
    """kubectl's own reading of a file, offline: `label --local` decodes it and prints it back."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    proc = subprocess.run([kubectl, "label", "--local", "-f", str(path), "megatron-hpc/checked=yes",
                           "--dry-run=client", "-o", "json"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def exports(node_sh: str) -> dict[str, str]:
    """`export K=V` lines of a node script (PATH, which names each side's Python, apart)."""
    found = {}
    for line in node_sh.splitlines():
        words = shlex.split(line) if line.startswith("export ") else []
        if len(words) == 2 and "=" in words[1] and not words[1].startswith("PATH="):
            key, _, value = words[1].partition("=")
            found[key] = value
    return found


def container(job: dict, replica: str = "Master") -> dict:
    (only,) = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
    return only


def test_recipes_left_out_are_refused_on_slurm_too(tmp_path):
    """A recipe with no case here is one `submit` refuses at every node count on SLURM as well (pipelining on XLA,
    say), not one the k8s path could not render."""
    rendered = {recipe for recipe, _ in CASES}
    left_out = [r for r in known_recipes() if load_recipe(r).launch.platform != "cpu" and r not in rendered]
    assert len(CASES) >= 8
    for recipe in left_out:
        for nodes in NODES:
            assert main(["submit", "--recipe", recipe, "--nodes", str(nodes), *SYNTHETIC, "--dry-run",
                         "--out", str(tmp_path / f"{recipe}-{nodes}")]) == 1, (recipe, nodes)


@pytest.mark.parametrize(("recipe", "nodes"), CASES)
def test_recipe_renders_valid_objects_that_carry_the_plan(recipe, nodes, tmp_path, kubectl):
    out = tmp_path / "k"
    assert render(out, "--recipe", recipe, "--nodes", str(nodes), *SYNTHETIC, *K8S) == 0
    plan = json.loads((out / "plan.json").read_text())
    found = objects(out)
    assert {"configmap.yaml", "pytorchjob.yaml"} <= set(found)
    for name, data in found.items():
        assert round_trip(data) == data, name
        parsed = kubectl_parse(kubectl, out / name, tmp_path)
        assert parsed["metadata"]["labels"].pop("megatron-hpc/checked") == "yes"
        assert parsed == data, name

    instance = plan["platform"]  # the default instance type is named like the platform
    resource, devices, efa, ec2 = AWS[instance]
    for name in (n for n in found if n.endswith("pytorchjob.yaml")):
        job = found[name]
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert specs["Master"]["replicas"] == 1
        assert specs["Master"]["replicas"] + (specs["Worker"]["replicas"] if "Worker" in specs else 0) == nodes
        assert ("Worker" in specs) == (nodes > 1)
        assert job["spec"]["nprocPerNode"] == str(plan["workers_per_node"])
        # the operator sums every pod's restarts; one failure restarts all nodes: the requeue cap per node
        assert job["spec"]["runPolicy"]["backoffLimit"] == DEFAULT_MAX_REQUEUES * nodes
        for replica, spec in specs.items():
            assert spec["restartPolicy"] == "OnFailure"
            pod = spec["template"]["spec"]
            limits = container(job, replica)["resources"]["limits"]
            assert limits[resource] == str(devices) and limits["vpc.amazonaws.com/efa"] == str(efa)
            assert limits["hugepages-2Mi"].endswith("Mi")
            assert container(job, replica)["resources"]["requests"] == limits
            assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": ec2}
            (claim,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert claim["persistentVolumeClaim"]["claimName"] == "fsx-claim"
            mounts = {m["name"]: m["mountPath"] for m in container(job, replica)["volumeMounts"]}
            assert mounts[claim["name"]] == "/fsx" and mounts["dshm"] == "/dev/shm"
            (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
            assert shm["emptyDir"]["medium"] == "Memory"
    node_sh = found["configmap.yaml"]["data"]["node.sh"]
    assert f"--nproc_per_node={plan['workers_per_node']}" in node_sh
    assert subprocess.run(["bash", "-n"], input=node_sh, text=True).returncode == 0


@pytest.mark.parametrize(("recipe", "nodes"), [c for c in CASES if c[1] == 16][:4])
def test_pods_get_the_environment_of_the_slurm_node_script(recipe, nodes, tmp_path):
    assert render(tmp_path / "k", "--recipe", recipe, "--nodes", str(nodes), *SYNTHETIC, *K8S) == 0
    assert main(["submit", "--recipe", recipe, "--nodes", str(nodes), *SYNTHETIC, "--dry-run",
                 "--out", str(tmp_path / "s")]) == 0
    slurm = exports((tmp_path / "s" / "node.sh").read_text())
    found = objects(tmp_path / "k")
    assert exports(found["configmap.yaml"]["data"]["node.sh"]) == slurm
    env = {e["name"]: e["value"] for e in container(found["pytorchjob.yaml"])["env"]}
    assert env.pop("MEGATRON_HPC_K8S_NNODES") == str(nodes)
    assert env.pop("MEGATRON_HPC_LOCAL_CACHE_DIR")
    literal = {k: v for k, v in slurm.items() if "$" not in v}  # the cache folders are set by node.sh on the node
    assert env == literal and literal


def test_instance_types_ask_their_resources(tmp_path):
    for name, (resource, devices, efa, ec2) in AWS.items():
        platform = "p5" if resource == "nvidia.com/gpu" else name
        out = tmp_path / name
        assert render(out, "--recipe", "gpt2_small", "--nodes", "2", "--platform", platform, *SYNTHETIC, *K8S,
                      "--set", f"k8s.instance_type={name}") == 0
        job = objects(out)["pytorchjob.yaml"]
        limits = container(job)["resources"]["limits"]
        assert (limits[resource], limits["vpc.amazonaws.com/efa"]) == (str(devices), str(efa)), name
        assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["nodeSelector"] == {
            "node.kubernetes.io/instance-type": ec2}


def test_compile_job_is_skipped_when_the_claims_cache_holds_the_fingerprint(tmp_path):
    from megatron_hpc.compile_cache import fingerprint

    args = ["--recipe", "gpt3_6.7b", "--nodes", "16", *SYNTHETIC, *K8S, "--set", f"k8s.mount_path={tmp_path}"]
    assert render(tmp_path / "a", *args) == 0
    first = objects(tmp_path / "a")
    assert "compile-pytorchjob.yaml" in first
    compile_env = container(first["compile-pytorchjob.yaml"])["command"]
    assert compile_env[-1].endswith("node.sh compile")
    apply = (tmp_path / "a" / "apply.sh").read_text()
    assert apply.index("compile-pytorchjob.yaml") < apply.index("wait_for pytorchjob/") < apply.index(
        "/pytorchjob.yaml")
    fp = json.loads((tmp_path / "a" / "compile-fingerprint.json").read_text())
    fingerprint.record(tmp_path / "compile-cache", fp, run_dir="earlier", job_id=None)
    assert render(tmp_path / "b", *args) == 0
    assert "compile-pytorchjob.yaml" not in objects(tmp_path / "b")
    assert "compile-pytorchjob" not in (tmp_path / "b" / "apply.sh").read_text()


def test_preprocess_job_runs_the_data_preprocess_command(tmp_path):
    from megatron_hpc.cli.main import build_parser

    assert render(tmp_path / "k", "--recipe", "gpt3_6.7b", "--nodes", "1", *K8S,
                  "--set", "data.path=data/corpus_text_document",
                  "--set", "k8s.preprocess_input=raw/corpus.jsonl", *GPT2_FILES) == 0
    found = objects(tmp_path / "k")
    job = found["preprocess-job.yaml"]
    (only,) = job["spec"]["template"]["spec"]["containers"]
    assert only["command"][:3] == ["megatron-hpc", "data", "preprocess"]
    args = build_parser(only["command"][1:]).parse_args(only["command"][1:])  # the CLI's own parser accepts the command
    # data preprocess appends _text_document to its prefix (Megatron's naming), so the prefix is data.path less it
    assert (args.input, args.output_prefix) == ("raw/corpus.jsonl", "data/corpus")
    assert only["workingDir"] == "/fsx"
    apply = (tmp_path / "k" / "apply.sh").read_text()
    assert apply.index("preprocess-job.yaml") < apply.index("wait_for job/") < apply.index(
        "compile-pytorchjob.yaml")


def test_the_preprocess_jobs_command_writes_the_files_the_run_reads(tmp_path, monkeypatch):
    """The Job's command, run here as the pod runs it (in the claim's mount): the .bin/.idx land at data.path."""
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"
    claim = tmp_path / "fsx"
    (claim / "raw").mkdir(parents=True)
    (claim / "raw" / "corpus.jsonl").write_bytes((fixture / "corpus.jsonl").read_bytes())
    assert render(tmp_path / "k", "--recipe", "gpt3_6.7b", "--nodes", "1", *K8S,
                  "--set", "data.path=data/corpus_text_document", "--set", "k8s.preprocess_input=raw/corpus.jsonl",
                  "--set", f"data.vocab_file={fixture / 'vocab.json'}",
                  "--set", f"data.merge_file={fixture / 'merges.txt'}") == 0
    (only,) = objects(tmp_path / "k")["preprocess-job.yaml"]["spec"]["template"]["spec"]["containers"]
    monkeypatch.chdir(claim)  # the container's workingDir, the claim's mount_path
    assert main([*only["command"][1:], "--workers", "1"]) == 0
    assert (claim / "data" / "corpus_text_document.idx").is_file()
    assert (claim / "data" / "corpus_text_document.bin").is_file()


@pytest.mark.parametrize("recipe, sets, fix", [
    ("gpt3_6.7b", [], "--set data.vocab_file=PATH/vocab.json --set data.merge_file=PATH/merges.txt"),
    ("llama3_8b", [], "--set data.tokenizer_model=PATH"),
    ("llama2_7b", ["--set", "data.vocab_file=v.json"], "--set data.tokenizer_model=PATH")])
def test_refuses_a_preprocess_job_whose_tokenizer_has_no_files(tmp_path, capsys, recipe, sets, fix):
    # `data preprocess` would refuse the same in the pod, after the apply: the Job could never succeed.
    err = _one_line_error(capsys, "--recipe", recipe, "--nodes", "1", "--platform", "p5", "--cluster", "k8s",
                          "--dry-run", "--out", str(tmp_path / "k"), *K8S, "--set", "data.path=data/c_text_document",
                          "--set", "k8s.preprocess_input=raw/corpus.jsonl", *sets)
    assert "the preprocessing Job's" in err and "needs its files" in err and fix in err, err
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("path, fix", [("data/corpus", "--set data.path=data/corpus_text_document"),
                                       ("0.5 data/a_text_document 0.5 data/b_text_document", "not a blend")])
def test_refuses_a_data_path_the_preprocess_job_cannot_write(tmp_path, capsys, path, fix):
    err = _one_line_error(capsys, "--recipe", "gpt3_6.7b", "--nodes", "1", "--cluster", "k8s", "--dry-run",
                          "--out", str(tmp_path / "k"), *K8S, "--set", f"data.path={path}",
                          "--set", "k8s.preprocess_input=raw/corpus.jsonl")
    assert "k8s.preprocess_input writes <prefix>_text_document.bin/.idx" in err and fix in err, err
    assert not (tmp_path / "k").exists()


def _one_line_error(capsys, *args: str) -> str:
    assert main(["submit", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_refuses_a_missing_volume_claim(tmp_path, capsys):
    err = _one_line_error(capsys, "--recipe", "gpt2_small", "--nodes", "2", "--cluster", "k8s", "--dry-run",
                          "--out", str(tmp_path / "k"), *SYNTHETIC, "--set", "k8s.image=x/y:1")
    assert "k8s.volume_claim is not set" in err and "--set k8s.volume_claim=" in err
    assert not (tmp_path / "k").exists()


def test_refuses_an_instance_type_tp_does_not_divide(tmp_path, capsys):
    # 6 processes per node at TP 3 is a valid plan on its own; a p5 node holds 8 GPUs, which TP 3 does not divide.
    err = _one_line_error(capsys, "--recipe", "gpt2_small", "--nodes", "2", "--cluster", "k8s", "--dry-run",
                          "--out", str(tmp_path / "k"), *SYNTHETIC, *K8S, "--set", "launch.workers_per_node=6",
                          "--set", "parallel.tensor=3")
    assert "tp=3 does not divide the 8 processes per node of p5.48xlarge" in err and "1, 2, 4, 8" in err


def test_refuses_an_instance_type_of_another_platform(tmp_path, capsys):
    err = _one_line_error(capsys, "--recipe", "gpt2_small", "--nodes", "2", "--cluster", "k8s", "--dry-run",
                          "--out", str(tmp_path / "k"), *SYNTHETIC, *K8S, "--set", "k8s.instance_type=trn1")
    assert "runs the trn1 plan, but this plan is for p5" in err and "p5, p5e, p5en, p6-b200" in err


def test_refuses_a_cpu_plan_and_names_typos(tmp_path, capsys):
    err = _one_line_error(capsys, "--recipe", "tiny", "--cluster", "k8s", "--dry-run", "--out", str(tmp_path / "k"),
                          *K8S)
    assert "needs an accelerator platform" in err
    err = _one_line_error(capsys, "--recipe", "gpt2_small", "--cluster", "k8s", "--dry-run", *SYNTHETIC, *K8S,
                          "--set", "k8s.volume_clam=x")
    assert "did you mean 'k8s.volume_claim'" in err
    err = _one_line_error(capsys, "--recipe", "gpt2_small", "--cluster", "k8s", "--dry-run", *SYNTHETIC, *K8S,
                          "--set", "k8s.instance_type=p5n")
    assert "unknown instance type 'p5n'" in err and "did you mean" in err


def test_refuses_a_real_submit_without_a_kube_context(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    err = _one_line_error(capsys, "--recipe", "gpt2_small", "--nodes", "2", "--cluster", "k8s",
                          "--out", str(tmp_path / "k"), *SYNTHETIC, *K8S)
    assert "no kube context" in err and "aws eks update-kubeconfig" in err and "--dry-run" in err
    assert not (tmp_path / "k").exists()


FAKE_KUBECTL = """#!/usr/bin/env bash
echo "$*" >> "$KUBECTL_CALLS"
if [ "$1" = get ]; then printf '%b' "$FAKE_CONDITIONS"; fi
"""


def _apply_with_stub(tmp_path: Path, out: Path, conditions: str) -> tuple[int, list[str]]:
    stub = tmp_path / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "kubectl").write_text(FAKE_KUBECTL)
    (stub / "kubectl").chmod(0o755)
    calls = tmp_path / f"calls-{len(list(tmp_path.glob('calls-*')))}"
    env = {"PATH": f"{stub}:/usr/bin:/bin", "KUBECTL_CALLS": str(calls), "FAKE_CONDITIONS": conditions}
    proc = subprocess.run(["bash", str(out / "apply.sh")], env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, calls.read_text().splitlines()


def test_apply_script_applies_in_order_and_stops_at_a_failed_job(tmp_path, kubectl):
    out = tmp_path / "k"
    assert render(out, "--recipe", "gpt3_6.7b", "--nodes", "2", *K8S, "--set", "data.path=d/x_text_document",
                  "--set", "k8s.preprocess_input=raw.jsonl", "--set", "k8s.namespace=team-a", *GPT2_FILES) == 0
    code, calls = _apply_with_stub(tmp_path, out, "Created\\nRunning\\nSucceeded\\n")
    assert code == 0
    applied = [c.split()[-1].rsplit("/", 1)[-1] for c in calls if c.startswith("apply")]
    assert applied == ["configmap.yaml", "preprocess-job.yaml", "compile-pytorchjob.yaml", "pytorchjob.yaml"]
    assert all(" -n team-a " in f" {c} " for c in calls)
    assert [c.split()[3] for c in calls if c.startswith("get")] == [
        "job/gpt3-6-7b-k-preprocess", "pytorchjob/gpt3-6-7b-k-compile"]
    code, calls = _apply_with_stub(tmp_path, out, "Created\\nFailed\\n")
    assert code == 1 and not any("compile-pytorchjob.yaml" in c for c in calls)
    # the condition query kubectl runs, on a status as the operator writes it, read by the real kubectl offline
    (line,) = [ln for ln in (out / "apply.sh").read_text().splitlines() if "jsonpath=" in ln]
    jsonpath = shlex.split(line.split("-o ", 1)[1].split(" | ")[0])[0].removeprefix("jsonpath=")
    job = yaml.safe_load((out / "compile-pytorchjob.yaml").read_text())
    job["status"] = {"conditions": [{"type": "Created", "status": "True"}, {"type": "Running", "status": "False"},
                                    {"type": "Succeeded", "status": "True"}]}
    (tmp_path / "with-status.yaml").write_text(yaml.safe_dump(job))
    proc = subprocess.run([kubectl, "label", "--local", "-f", str(tmp_path / "with-status.yaml"), "a=b",
                           "--dry-run=client", "-o", f"jsonpath={jsonpath}"], capture_output=True, text=True,
                          env={**os.environ, "KUBECONFIG": str(tmp_path / "none")}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["Created", "Succeeded"]


def test_without_the_k8s_extra_submit_names_the_extra_in_one_line(tmp_path):
    """A plain install has neither client package: one line with the extra to install, nothing written."""
    code = ("import sys; sys.modules['kubeflow'] = None; from megatron_hpc.cli.main import main; "
            f"sys.exit(main(['submit', '--recipe', 'tiny', '--cluster', 'k8s', '--dry-run', '--out', "
            f"{str(tmp_path / 'never')!r}, '--set', 'data.source=synthetic']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("megatron-hpc: error:")]
    assert "kubeflow" in line and "pip install 'megatron-hpc[k8s]'" in line, line
    assert not (tmp_path / "never").exists()
