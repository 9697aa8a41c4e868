"""The Trainium compile phase on this machine: the real node script and trainer under a STAND-IN for
`neuron_parallel_compile` (no Neuron SDK here), and the fingerprint that tells later submits the shared cache is warm.

The stand-in (FAKE_TOOL below) does what shared/reference/neuron-xla.md 2.5 says the real tool does, in small: it runs
its arguments as the trial with NEURON_EXTRACT_GRAPHS_ONLY=1 (exit 1 if the trial fails), then "compiles" after the
trial returned, writing one made-up entry in the documented layout (2.2) into the cache root Neuron would pick (2.1:
--cache_dir in NEURON_CC_FLAGS, then NEURON_COMPILE_CACHE_URL), and exits with the number of failed compilations.
The node script is the one `submit` writes, rendered for the cpu platform given Trainium's compile wrapper and
Neuron's cache environment, so the trainer runs on CPU. Expected bytes come from this file, never from the code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from megatron_hpc.compile_cache import fingerprint
from megatron_hpc.launch.requeue import record_fingerprint
from megatron_hpc.launch.run_dir import python_bin_dir
from megatron_hpc.launch.scripts import render_node_script

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.plan.jobs import make_phases
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.run_folder import FINGERPRINT_FILE, PUBLISHED_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from stand_in_phase import run_phase_under_stand_in

KEY = "neuronxcc-2.15.141.0+d3cfc8ca/MODULE_98ba4c9111d5882d2331+39f12043"  # names as in neuron-xla.md 2.2/2.4
NEFF = b"made-up neff " * 64
FAKE_TOOL = f'''#!{sys.executable}
"""STAND-IN for neuron_parallel_compile, written by tests/unit/test_compile_cache_node_publish.py."""
import json, os, re, subprocess, sys
from pathlib import Path

trial = subprocess.run(sys.argv[1:], env={{**os.environ, "NEURON_EXTRACT_GRAPHS_ONLY": "1"}})
if trial.returncode != 0:
    sys.exit(1)
flag = re.search(r"--cache_dir[= ](\\S+)", os.environ.get("NEURON_CC_FLAGS", ""))
url = flag.group(1) if flag else os.environ.get("NEURON_COMPILE_CACHE_URL")
if not url:
    sys.exit("stand-in: no cache root set; refusing to write the default /var/tmp/neuron-compile-cache")
entry = Path(url) / "{KEY}"
entry.mkdir(parents=True)
(entry / "model.hlo_module.pb").write_bytes(b"made-up HLO")  # what the trial's extraction leaves
(entry / "compile_flags.json").write_text("[]")
failed = os.environ.get("FAKE_NPC_FAIL") == "1"
if failed:
    (entry / "model.log").write_text("ERROR: made-up compiler failure\\n")
else:
    (entry / "model.neff").write_bytes({NEFF!r})
    (entry / "model.done").write_bytes(b"")
shared = Path(os.environ["FAKE_NPC_SHARED"])
seen = sorted(str(p.relative_to(shared)) for p in shared.rglob("*")) if shared.exists() else []
Path(os.environ["FAKE_NPC_REPORT"]).write_text(json.dumps({{"root": url, "shared_when_done": seen}}))
print(f"stand-in neuron_parallel_compile: compiled into {{url}}", flush=True)
sys.exit(1 if failed else 0)
'''
SETS = ["data.source=synthetic", "compile.num_steps=1", "train.num_steps=1", "train.tensorboard=false"]


def trainium_like_run(tmp_path: Path) -> Path:
    """A tiny cpu run folder whose node script runs the compile phase as on Trainium."""
    run_dir = tmp_path / "run"
    assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(run_dir),
                 *[a for s in SETS for a in ("--set", s)]]) == 0
    cfg = load_recipe(str(run_dir / "config.json"))
    platform = replace(get_platform("cpu"), compile_wrapper=get_platform("trn1").compile_wrapper)
    compile_spec = make_phases(cfg, make_plan(cfg, num_nodes=1, platform=platform), platform, extra_env={})[0]
    assert compile_spec.phase == "compile" and compile_spec.torchrun_wrapper == ("neuron_parallel_compile",)
    cache_root = json.loads((run_dir / FINGERPRINT_FILE).read_text())["cache_root"]
    (run_dir / "node.sh").write_text(render_node_script(compile_spec, recipe=cfg.name, run_dir=str(run_dir),
                                                        bin_dir=python_bin_dir(), backend="xla",
                                                        shared_cache=cache_root))
    return run_dir


def run_compile_phase(tmp_path: Path, run_dir: Path, shared: Path, *, fail: bool) -> subprocess.CompletedProcess:
    return run_phase_under_stand_in(tmp_path, run_dir, shared, phase="compile", stand_in=FAKE_TOOL, fail=fail)


def markers(shared: Path) -> list[Path]:
    return sorted((shared / fingerprint.MARKER_DIR).glob("*.json"))


def test_compiled_entries_reach_the_shared_cache_after_the_tool_and_then_the_fingerprint(tmp_path,
                                                                                          own_compile_cache):
    shared = own_compile_cache
    run_dir = trainium_like_run(tmp_path)
    proc = run_compile_phase(tmp_path, run_dir, shared, fail=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    tool = json.loads((tmp_path / "tool.json").read_text())
    # the trial and the compile used this phase's node-local cache, and nothing was published while they ran
    assert Path(tool["root"]).parent.name.startswith("megatron-hpc-cache.")
    assert Path(tool["root"]).parent.parent == tmp_path and Path(tool["root"]).name == "neuron"
    assert tool["shared_when_done"] == []
    assert not list(tmp_path.glob("megatron-hpc-cache.*"))  # the node-local cache is removed at the end

    entry = shared / "neuron" / KEY
    assert sorted(p.name for p in entry.iterdir()) == ["compile_flags.json", "model.done", "model.hlo_module.pb",
                                                       "model.neff"]
    assert (entry / "model.neff").read_bytes() == NEFF
    sha = json.loads((run_dir / FINGERPRINT_FILE).read_text())["sha256"]
    assert [m.stem for m in markers(shared)] == [sha]
    log = (run_dir / "logs" / "compile-node0.log").read_text()
    assert (log.index("stand-in neuron_parallel_compile: compiled into") < log.index("neuron: 1 copied")
            < log.index("recorded compile fingerprint"))
    # the next submit of the same graphs skips the compile phase
    assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(tmp_path / "next"),
                 *[a for s in SETS for a in ("--set", s)]]) == 0
    assert not (tmp_path / "next" / "compile.sbatch").exists()


def test_a_failed_compile_publishes_nothing_and_records_no_fingerprint(tmp_path, own_compile_cache):
    shared = own_compile_cache
    run_dir = trainium_like_run(tmp_path)
    proc = run_compile_phase(tmp_path, run_dir, shared, fail=True)
    assert proc.returncode != 0
    assert json.loads((tmp_path / "tool.json").read_text())["shared_when_done"] == []
    assert not (shared / "neuron").exists() or not list((shared / "neuron").rglob("MODULE_*"))
    assert markers(shared) == []
    assert "compile phase failed (exit 1)" in (run_dir / "logs" / "compile-node0.log").read_text()
    assert not list(tmp_path.glob("megatron-hpc-cache.*"))


def test_the_fingerprint_waits_for_every_node_of_the_attempt(tmp_path, own_compile_cache, capsys):
    run_dir = trainium_like_run(tmp_path)
    plan = json.loads((run_dir / "plan.json").read_text())
    (run_dir / "plan.json").write_text(json.dumps({**plan, "num_nodes": 3}))
    first = {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "0"}

    capsys.readouterr()
    for node, missing in ((2, "0, 1"), (0, "1")):  # nodes that published while node 1 still compiles: no marker
        assert record_fingerprint(run_dir, node_rank=node, environ=first, wait_s=0) is None
        assert f"not yet published: node(s) {missing};" in capsys.readouterr().out
    assert markers(own_compile_cache) == []
    # a requeued attempt of the job starts over: the earlier attempt's nodes do not count
    again = {**first, "SLURM_RESTART_COUNT": "1"}
    assert record_fingerprint(run_dir, node_rank=1, environ=again, wait_s=0) is None
    assert markers(own_compile_cache) == []
    marker = record_fingerprint(run_dir, node_rank=1, environ=first, wait_s=0)  # the last node of attempt 0
    assert marker is not None and markers(own_compile_cache) == [marker]
    assert json.loads(marker.read_text())["job_id"] == "42"
    assert sorted(p.name for p in (run_dir / PUBLISHED_DIR).iterdir()) == ["42.0", "42.1"]
