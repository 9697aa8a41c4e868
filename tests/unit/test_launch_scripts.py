"""The launcher: dry-run scripts, bad input refused before anything is queued, no torch import."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hpc.cli.main import main


def dry_run(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "d"
    code = main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1",
                 "--set", "data.source=synthetic", "--dry-run", "--out", str(out), *extra])
    assert code == 0
    return out


def sbatch_flags(text: str) -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH")]


def test_dry_run_writes_the_reference_shape(tmp_path):
    out = dry_run(tmp_path)
    compile_ = (out / "compile.sbatch").read_text()
    run = (out / "run.sbatch").read_text()
    node = (out / "node.sh").read_text()
    submit = (out / "submit.sh").read_text()
    for text in (compile_, run):
        flags = sbatch_flags(text)
        assert "--nodes=16" in flags and "--exclusive" in flags and "--ntasks-per-node=1" in flags
    # node.sh runs neuron_parallel_compile around torchrun in the compile phase (not srun around node.sh)
    assert "neuron_parallel_compile" not in compile_ and "neuron_parallel_compile" not in run
    assert "  TORCHRUN_WRAPPER=(neuron_parallel_compile)" in node.splitlines()
    assert "--requeue" in sbatch_flags(run)
    assert "afterok" in run  # the dependency is carried as a comment
    assert (f'RUN_JOB_ID=$(sbatch --parsable "--dependency=afterok:$COMPILE_JOB_ID" --kill-on-invalid-dep=yes '
            f"{out}/run.sbatch)") in submit.splitlines()
    assert submit.index("compile.sbatch") < submit.index("run.sbatch")
    assert "ulimit -n 65535" in node
    assert "--nproc_per_node=32" in node and "torchrun" in node
    assert "NEURON_RT_VISIBLE_CORES" not in node  # torch-xla derives it from LOCAL_RANK
    assert "export XLA_USE_BF16=1" in node and "export FI_PROVIDER=efa" in node
    assert "export NEURON_CC_FLAGS='--model-type transformer'" in node
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["tensor_parallel"], plan["data_parallel"]) == (8, 64)
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["num_layers"] == 32


def test_generated_scripts_are_valid_bash(tmp_path):
    out = dry_run(tmp_path)
    for name in ("compile.sbatch", "run.sbatch", "node.sh", "submit.sh"):
        proc = subprocess.run(["bash", "-n", str(out / name)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr}"


def test_site_options_reach_both_phases(tmp_path):
    out = dry_run(tmp_path, "--partition", "train", "--account", "proj", "--qos", "high",
                  "--exclude", "node7", "--time", "90")
    for name in ("compile.sbatch", "run.sbatch"):
        flags = sbatch_flags((out / name).read_text())
        for flag in ("--partition=train", "--account=proj", "--qos=high", "--exclude=node7", "--time=90"):
            assert flag in flags, (name, flag)


def test_node_script_exports_cpu_environment_without_neuron(tmp_path):
    out = tmp_path / "cpu"
    assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(out),
                 "--set", "train.compile=true"]) == 0
    node = (out / "node.sh").read_text()
    assert "NEURON" not in node and "XLA_USE_BF16" not in node
    assert "--nproc_per_node=1" in node and "TORCHRUN_WRAPPER=()" in node.splitlines()
    assert "neuron_parallel_compile" not in (out / "compile.sbatch").read_text()
    assert not any(f.startswith("--gpus") for f in sbatch_flags((out / "run.sbatch").read_text()))


@pytest.mark.parametrize("recipe, platform, phases", [
    ("tiny", "cpu", ["run"]),             # nothing to compile: no compiler wrapper, train.compile false
    ("gpt2_small", "p5", ["run"]),
    ("gpt3_6.7b", "trn1", ["compile", "run"]),  # neuron_parallel_compile in the compile phase
])
def test_a_run_that_compiles_nothing_queues_only_the_run_phase(tmp_path, capsys, recipe, platform, phases):
    out = tmp_path / "d"
    assert main(["submit", "--recipe", recipe, "--platform", platform, "--dry-run", "--json", "--out", str(out),
                 "--set", "data.source=synthetic"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert sorted(p.stem for p in out.glob("*.sbatch")) == sorted(phases)
    assert [ln.split()[-1].rsplit("/", 1)[1] for ln in (out / "submit.sh").read_text().splitlines()
            if "sbatch --parsable" in ln] == [f"{p}.sbatch)" for p in phases]
    if phases == ["run"]:
        assert report["compile_left_out"] == (f"nothing to compile: platform {platform} has no graph compiler "
                                              "and train.compile is false")
        assert "afterok" not in (out / "run.sbatch").read_text()
    else:
        assert report["compile_left_out"] is None
    assert report["compile_skipped"] is False  # that field is only for a compile the shared cache made needless


def test_the_left_out_compile_phase_is_said_in_one_line(tmp_path, capsys):
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(tmp_path / "d")]) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if "compile phase" in ln]
    assert line == ("compile phase left out (nothing to compile: platform cpu has no graph compiler and "
                    "train.compile is false): only the run phase is queued; --set train.compile=true adds one")
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(tmp_path / "e"),
                 "--set", "train.compile=true"]) == 0
    assert "compile phase" not in capsys.readouterr().out
    assert (tmp_path / "e" / "compile.sbatch").is_file()


def test_each_phase_gets_its_own_time_limit_and_the_profile_and_time_win(tmp_path):
    sets = ["--set", "train.compile=true", "--set", "launch.compile_time_limit_min=7",
            "--set", "launch.time_limit_min=300"]
    out = tmp_path / "recipe"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), *sets]) == 0
    assert "--time=7" in sbatch_flags((out / "compile.sbatch").read_text())
    assert "--time=300" in sbatch_flags((out / "run.sbatch").read_text())
    profile = tmp_path / "cluster.yaml"
    profile.write_text("time_limit_min: {compile: 11}\n")
    out = tmp_path / "profile"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), "--cluster-config", str(profile),
                 *sets]) == 0
    assert "--time=11" in sbatch_flags((out / "compile.sbatch").read_text())
    assert "--time=300" in sbatch_flags((out / "run.sbatch").read_text())  # the profile names no run limit
    out = tmp_path / "flag"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out), "--cluster-config", str(profile),
                 "--time", "45", *sets]) == 0
    for phase in ("compile", "run"):
        assert "--time=45" in sbatch_flags((out / f"{phase}.sbatch").read_text())


@pytest.mark.parametrize("key", ["launch.compile_time_limit_min", "launch.time_limit_min"])
def test_a_time_limit_that_is_not_positive_is_refused(tmp_path, capsys, key):
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(tmp_path / "d"), "--set", f"{key}=0",
                 "--set", "train.compile=true"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"megatron-hpc: error: {key}=0 must be at least 1; fix the recipe or use --set {key}=..."
    assert not (tmp_path / "d").exists()  # refused by the planner, before the run folder exists


def test_compile_phase_can_be_disabled(tmp_path):
    out = tmp_path / "nocompile"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(out),
                 "--set", "compile.enabled=false"]) == 0
    assert not (out / "compile.sbatch").exists()
    assert "afterok" not in (out / "submit.sh").read_text()


def test_slurm_without_sbatch_suggests_local(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    out = tmp_path / "never"
    assert main(["submit", "--recipe", "tiny", "--cluster", "slurm", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "--cluster local" in err and "sbatch" in err
    assert not out.exists(), "nothing may be written or queued"


def test_slurm_without_a_controller_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    # A slurm.conf whose controller is not running: the real scontrol (or its absence) stops submit cleanly.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=6999\nAuthType=auth/none\n"
                    "CredType=cred/none\nNodeName=n1 CPUs=1\nPartitionName=p Nodes=ALL\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    out = tmp_path / "never"
    assert main(["submit", "--recipe", "tiny", "--cluster", "slurm", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "--cluster local" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_local_with_several_nodes_is_refused(tmp_path, capsys):
    assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--nodes", "2",
                 "--out", str(tmp_path / "x")]) == 1
    assert "--cluster slurm" in capsys.readouterr().err


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(blocker / "run")]) == 1
    err = capsys.readouterr().err
    assert "cannot write the run folder" in err and "--out" in err


@pytest.mark.parametrize("argv, needle", [
    (["--nodes", "0"], "at least 1 node"),
    (["--set", "parallel.tensor=3"], "{1, 2, 8, 16, 32}"),
    (["--set", "trian.num_steps=3"], "did you mean 'train'"),
])
def test_bad_input_is_one_line_and_nonzero(argv, needle, capsys, tmp_path):
    code = main(["submit", "--recipe", "gpt3_6.7b", "--set", "data.source=synthetic", "--platform", "trn1", "--dry-run",
                 "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 1 and needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_dry_run_with_missing_data_writes_the_scripts_and_warns(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--json", "--out", str(out),
                 "--set", f"data.path={tmp_path / 'nope_text_document'}"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any("nope_text_document.idx not found" in w and "the run fails unless" in w for w in warnings)
    assert (out / "run.sbatch").is_file()


def test_unknown_recipe_exit_code_and_list(capsys):
    assert main(["plan", "--recipe", "nope"]) == 1
    assert "known recipes" in capsys.readouterr().err


def test_launcher_and_plan_never_import_torch(tmp_path):
    code = (
        "import sys\n"
        "import megatron_hpc.launch.submit, megatron_hpc.launch.scripts, megatron_hpc.compile_cache.paths\n"
        "from megatron_hpc.cli.main import main\n"
        "assert main(['plan', '--recipe', 'gpt3_6.7b', '--nodes', '16', '--json']) == 0\n"
        f"assert main(['submit', '--recipe', 'tiny', '--dry-run', '--out', {str(tmp_path / 'd')!r}]) == 0\n"
        "heavy = [m for m in ('torch', 'megatron_hpc.model', 'megatron_hpc.parallel', 'megatron_hpc.train')"
        " if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


@pytest.mark.parametrize("platform", ["trn1", "trn2", "p5"])
@pytest.mark.parametrize("nodes", [1, 16, 512])
def test_dry_run_scales_to_512_nodes(tmp_path, platform, nodes):
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", str(nodes), "--platform", platform, "--dry-run",
                 "--json", "--out", str(out), "--set", "train.global_batch_size=8192",
                 "--set", "data.source=synthetic"]) == 0
    plan = json.loads((out / "plan.json").read_text())
    mesh = plan["data_parallel"] * plan["tensor_parallel"] * plan["pipeline_parallel"]
    assert plan["num_nodes"] == nodes and mesh == plan["world_size"]
    phases = ["run"] if platform == "p5" else ["compile", "run"]  # p5 compiles nothing without train.compile
    assert sorted(p.stem for p in out.glob("*.sbatch")) == phases
    for phase in phases:
        flags = sbatch_flags((out / f"{phase}.sbatch").read_text())
        assert f"--nodes={nodes}" in flags and "--ntasks-per-node=1" in flags
        assert ("--gpus-per-node=8" in flags) == (platform == "p5")
    node = (out / "node.sh").read_text()
    assert f"--nproc_per_node={plan['workers_per_node']}" in node
    proc = subprocess.run(["bash", "-n", str(out / "node.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
