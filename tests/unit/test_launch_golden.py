"""The 16-node gpt3_6.7b trn1 dry run against the hand-written golden of the reference scripts."""

import re
import shlex
from pathlib import Path

import yaml

from megatron_hpc.cli.main import main

GOLDEN = yaml.safe_load((Path(__file__).parent / "golden" / "gpt3_6.7b_trn1_16nodes.yaml").read_text())


def render(tmp_path: Path) -> Path:
    out = tmp_path / "d"
    assert main(["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1", "--dry-run",
                 "--set", "data.source=synthetic", "--out", str(out)]) == 0
    return out


def directives(text: str) -> set[str]:
    return {line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")}


def srun_line(text: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    return shlex.split(line)


def exports(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if line.startswith("export ") and "=" in line and "$" not in line:
            key, _, value = line[len("export "):].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
    return env


def test_sbatch_directives_match_the_reference(tmp_path):
    out = render(tmp_path)
    expected = set(GOLDEN["reference"]["sbatch"]) | set(GOLDEN["ours"]["sbatch_extra"])
    for phase in ("compile", "run"):
        found = directives((out / f"{phase}.sbatch").read_text())
        # --output and --job-name name our run folder and phase; every other directive is in the golden
        found = {d for d in found if not d.startswith(("--output=", "--job-name="))}
        assert found == expected, phase


def test_srun_lines_match_the_reference(tmp_path):
    out = render(tmp_path)
    ours = GOLDEN["ours"]["srun_args"].split()
    compile_cmd = srun_line((out / "compile.sbatch").read_text())
    run_cmd = srun_line((out / "run.sbatch").read_text())
    assert compile_cmd[1:1 + len(ours)] == ours and run_cmd[1:1 + len(ours)] == ours
    # the reference's compile prefix runs inside node.sh, around torchrun (`ours` says why)
    assert GOLDEN["ours"]["compile_torchrun_prefix"] == GOLDEN["reference"]["compile_srun_prefix"]
    prefix = GOLDEN["ours"]["compile_srun_prefix"].split()
    assert compile_cmd[1 + len(ours):] == [*prefix, "bash", str(out / "node.sh"), "compile"]
    assert run_cmd[1 + len(ours):] == [*GOLDEN["reference"]["run_srun_prefix"].split(), "bash",
                                       str(out / "node.sh"), "run"]


def test_the_compile_phase_runs_torchrun_under_the_reference_prefix(tmp_path):
    node = (render(tmp_path) / "node.sh").read_text()
    wrapper = GOLDEN["ours"]["compile_torchrun_prefix"]
    assert ('TORCHRUN_WRAPPER=()\nif [ "$PHASE" = compile ]; then\n'
            f"  TORCHRUN_WRAPPER=({wrapper})\nfi\n") in node
    assert 'exec "${TORCHRUN_WRAPPER[@]}" torchrun ' in node


def test_node_environment_matches_the_reference(tmp_path):
    node = (render(tmp_path) / "node.sh").read_text()
    env = exports(node)
    expected = {**GOLDEN["reference"]["env"], **GOLDEN["ours"]["env_extra"]}
    assert set(env) == set(expected)
    for key, value in expected.items():
        assert env[key] == value, key
    # the compile cache is the node-local one, known only on the node (synced from the shared cache)
    assert 'export NEURON_COMPILE_CACHE_URL="$LOCAL_CACHE/neuron"' in node
    for name in GOLDEN["reference"]["must_not_set"]:
        assert name not in node
    assert f"ulimit -n {GOLDEN['ours']['ulimit_nofile']}" in node


def test_torchrun_arguments_match_the_reference(tmp_path):
    node = (render(tmp_path) / "node.sh").read_text()
    joined = re.sub(r"\\\n\s*", " ", node)
    (line,) = [ln for ln in joined.splitlines()
               if not ln.lstrip().startswith("#") and (" torchrun --" in ln or ln.strip().startswith("torchrun "))]
    args = dict(re.findall(r"--(\w+)=\"?([^\s\"]+)\"?", line))
    for key, value in GOLDEN["reference"]["torchrun"].items():
        assert args[key] == value, key
    assert "scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1" in node
