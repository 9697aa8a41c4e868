"""Cluster profiles: site settings from YAML reach the sbatch files and the node script;
flags win over them; bad profiles are refused before any run folder is written."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from megatron_hpc.launch.cluster_profile import default_profile_path, find_profile

from megatron_hpc.cli.main import main

PROFILE = """\
partition: trn1-queue
account: ml-team
qos: high
constraint: trn1.32xlarge
exclude: node[7-8]
time_limit_min: {compile: 90, run: 2880}
exclusive: true
sbatch: ["--mail-type=END,FAIL", "#SBATCH --comment=pretrain sweep", "--hint=nomultithread"]
setup:
  - module load aws-neuronx/2.20
  - source /fsx/venvs/neuron/bin/activate
env: {FI_EFA_FORK_SAFE: "1", NEURON_RT_LOG_LEVEL: WARNING}
container:
  image: /fsx/images/neuron.sqsh
  mounts: [/fsx:/fsx, "/opt/aws:/opt/aws:ro"]
  workdir: /fsx/work
max_requeues: 7
"""


def _flags(text: str) -> list[str]:
    return [shlex.split(line)[1] for line in text.splitlines() if line.startswith("#SBATCH")]


def _srun_line(text: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    return shlex.split(line)


def _dry_run(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "run"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1",
                 "--set", "data.source=synthetic", "--dry-run", "--out", str(out), *extra]) == 0
    return out


def test_profile_reaches_both_sbatch_files_and_the_node_script(tmp_path: Path) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text(PROFILE)
    out = _dry_run(tmp_path, "--cluster-config", str(profile))
    for phase, minutes in (("compile", "90"), ("run", "2880")):
        text = (out / f"{phase}.sbatch").read_text()
        flags = _flags(text)
        for want in ("--partition=trn1-queue", "--account=ml-team", "--qos=high", "--constraint=trn1.32xlarge",
                     "--exclude=node[7-8]", f"--time={minutes}", "--exclusive", "--mail-type=END,FAIL",
                     "--comment=pretrain sweep", "--hint=nomultithread"):
            assert want in flags, (phase, want, flags)
        # Setup lines run before srun, in order.
        lines = text.splitlines()
        srun_at = next(i for i, ln in enumerate(lines) if ln.startswith("srun "))
        assert lines[srun_at - 2:srun_at] == ["module load aws-neuronx/2.20", "source /fsx/venvs/neuron/bin/activate"]
        srun = _srun_line(text)
        assert "--container-image=/fsx/images/neuron.sqsh" in srun
        assert "--container-mounts=/fsx:/fsx,/opt/aws:/opt/aws:ro" in srun
        assert "--container-workdir=/fsx/work" in srun
        assert "--kill-on-bad-exit=1" in srun  # the launcher's own flags stay
    node = (out / "node.sh").read_text()
    assert "export FI_EFA_FORK_SAFE=1" in node and "export NEURON_RT_LOG_LEVEL=WARNING" in node
    assert "export MEGATRON_HPC_MAX_REQUEUES=7" in node
    stored = json.loads((out / "cluster.json").read_text())
    assert stored["path"] == str(profile) and stored["profile"]["account"] == "ml-team"


def test_flags_win_over_the_profile(tmp_path: Path) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text(PROFILE)
    out = _dry_run(tmp_path, "--cluster-config", str(profile), "--partition", "debug", "--time", "30")
    flags = _flags((out / "run.sbatch").read_text())
    assert "--partition=debug" in flags and "--time=30" in flags
    assert "--partition=trn1-queue" not in flags and "--account=ml-team" in flags


def test_generated_scripts_with_a_profile_are_valid_bash(tmp_path: Path) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text(PROFILE)
    out = _dry_run(tmp_path, "--cluster-config", str(profile))
    for name in ("compile.sbatch", "run.sbatch", "node.sh", "submit.sh"):
        proc = subprocess.run(["bash", "-n", str(out / name)], capture_output=True, text=True)
        assert proc.returncode == 0, (name, proc.stderr)


def test_profile_changes_nothing_in_the_compile_fingerprint_but_env(tmp_path: Path) -> None:
    """The requeue cap is launcher behaviour; a compiler flag in env is a different graph."""
    def fingerprint(text: str, name: str) -> str:
        profile = tmp_path / f"{name}.yaml"
        profile.write_text(text)
        out = tmp_path / name
        assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out),
                     "--cluster-config", str(profile)]) == 0
        return json.loads((out / "compile-fingerprint.json").read_text())["sha256"]

    plain = fingerprint("partition: a\n", "plain")
    assert fingerprint("partition: b\nmax_requeues: 9\n", "requeues") == plain
    assert fingerprint("env: {NEURON_CC_FLAGS: --model-type=transformer}\n", "flags") != plain


@pytest.mark.parametrize("text, needle", [
    ("partiton: trn1\n", "did you mean 'partition'"),
    ("container: {imag: x.sqsh}\n", "did you mean 'container.image'"),
    ("time_limit_min: {run: -5}\n", "time_limit_min.run must be positive"),
    ("sbatch: ['--nodes=4']\n", "--nodes is set by megatron-hpc"),
    ("sbatch: ['--gpus-per-node=4']\n", "--gpus-per-node is set by megatron-hpc (the platform asks for its GPUs"),
    ("sbatch: ['--chdir=/elsewhere']\n", "--chdir is set by megatron-hpc (jobs run in the folder submit ran in)"),
    ("sbatch: ['mail-type END']\n", "is not an sbatch option"),
    ("env: {'BAD-NAME': 1}\n", "not a valid variable name"),
    ("env: {MASTER_PORT: 29500}\n", "env MASTER_PORT is set for each job by the node script"),
    ("env: {NEURON_RT_VISIBLE_CORES: 0-31}\n", "env NEURON_RT_VISIBLE_CORES must not be set"),
    ("env: {NEURON_RT_ROOT_COMM_ID: 'head:29999'}\n", "uses port 29999, inside the range the master port"),
    ("container: {mounts: ['/a:/a']}\n", "set container.image"),
    ("max_requeues: -1\n", "max_requeues must be 0 or more"),
    ("exclusive: maybe\n", "expected true or false"),
    ("partition: [\n", "not valid YAML"),
])
def test_bad_profiles_are_refused_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              text: str, needle: str) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text(text)
    out = tmp_path / "run"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out),
                 "--cluster-config", str(profile)]) == 1
    err = capsys.readouterr().err
    assert needle in err
    assert not out.exists()


def test_missing_profile_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(tmp_path / "r"),
                 "--cluster-config", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml does not exist" in capsys.readouterr().err


def test_default_profile_in_the_users_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home_cfg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home_cfg))
    monkeypatch.delenv("MEGATRON_HPC_CLUSTER_CONFIG", raising=False)
    assert find_profile(None).path is None  # none there yet: no profile, no error
    path = default_profile_path()
    assert path == home_cfg / "megatron-hpc" / "cluster.yaml"
    path.parent.mkdir(parents=True)
    path.write_text("account: from-default\n")
    out = _dry_run(tmp_path)
    assert "--account=from-default" in _flags((out / "run.sbatch").read_text())
    # The environment variable names another file and wins over the default.
    other = tmp_path / "other.yaml"
    other.write_text("account: from-env\n")
    monkeypatch.setenv("MEGATRON_HPC_CLUSTER_CONFIG", str(other))
    assert find_profile(None).profile.account == "from-env"


def test_resume_reuses_the_stored_profile(tmp_path: Path) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text("account: stored\nsetup: ['echo hello-from-setup']\n")
    out = tmp_path / "run"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), "--cluster-config", str(profile)]) == 0
    profile.unlink()  # the resumed run must not need the file any more
    (out / "run.sbatch").unlink()
    assert main(["submit", "--resume", str(out), "--dry-run"]) == 0
    text = (out / "run.sbatch").read_text()
    assert "--account=stored" in _flags(text) and "echo hello-from-setup" in text.splitlines()
