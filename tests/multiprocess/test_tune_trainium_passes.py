"""`megatron-hpc tune` on Trainium, on this machine: the real node script of a tune job, rendered for the cpu platform
given Trainium's compile wrapper and Neuron's cache environment (as tests/unit/test_compile_cache_node_publish.py
does for the compile phase), runs under a STAND-IN for `neuron_parallel_compile` (no Neuron SDK here) on the local
executor's path (node.sh run directly, 2 gloo workers, no SLURM).

The stand-in does what shared/reference/neuron-xla.md 2.5 says the real tool does, in small: it runs its arguments
as the trial with NEURON_EXTRACT_GRAPHS_ONLY=1, then "compiles" after the trial returned, writing one made-up entry
in the documented layout (2.2) into the cache root Neuron would pick (2.1), and reports what it saw. Expected bytes
come from this file, never from the code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from megatron_hpc.compile_cache import fingerprint
from megatron_hpc.launch.run_dir import python_bin_dir
from megatron_hpc.launch.scripts import render_node_script
from megatron_hpc.launch.submit import SubmitRequest, write_run_files
from megatron_hpc.launch.tune_job import plan_candidates, write_request

from megatron_hpc.cli.main import main
from megatron_hpc.config.loader import load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.plan.calibration import DEFAULT_CALIBRATION
from megatron_hpc.plan.jobs import make_tune_phase
from megatron_hpc.plan.planner import make_plan
from megatron_hpc.run_folder import TUNE_MEASURED_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from stand_in_phase import run_phase_under_stand_in

pytestmark = pytest.mark.multiprocess

KEY = "neuronxcc-2.15.141.0+d3cfc8ca/MODULE_5d1c7e0a9b2f4c3e8a61+39f12043"  # names as in neuron-xla.md 2.2/2.4
NEFF = b"made-up tune neff " * 32
STAND_IN = f'''#!{sys.executable}
"""STAND-IN for neuron_parallel_compile, written by tests/multiprocess/test_tune_trainium_passes.py."""
import json, os, re, subprocess, sys
from pathlib import Path

if os.environ.get("FAKE_NPC_FAIL") == "1":
    print("stand-in neuron_parallel_compile: made-up failure before the trial", flush=True)
    sys.exit(1)
trial = subprocess.run(sys.argv[1:], env={{**os.environ, "NEURON_EXTRACT_GRAPHS_ONLY": "1"}})
if trial.returncode != 0:
    sys.exit(1)
run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
flag = re.search(r"--cache_dir[= ](\\S+)", os.environ.get("NEURON_CC_FLAGS", ""))
url = flag.group(1) if flag else os.environ.get("NEURON_COMPILE_CACHE_URL")
if not url:
    sys.exit("stand-in: no cache root set; refusing to write the default /var/tmp/neuron-compile-cache")
entry = Path(url) / "{KEY}"
entry.mkdir(parents=True)
(entry / "model.hlo_module.pb").write_bytes(b"made-up HLO")
(entry / "compile_flags.json").write_text("[]")
(entry / "model.neff").write_bytes({NEFF!r})
(entry / "model.done").write_bytes(b"")
shared = Path(os.environ["FAKE_NPC_SHARED"]) / "neuron"
seen = sorted(str(p.relative_to(shared)) for p in shared.rglob("*")) if shared.exists() else []
Path(os.environ["FAKE_NPC_REPORT"]).write_text(json.dumps({{
    "argv": sys.argv[1:], "root": url, "shared_when_done": seen,
    "times_after_trial": (run_dir / "{TUNE_MEASURED_FILE}").exists()}}))
print(f"stand-in neuron_parallel_compile: compiled into {{url}}", flush=True)
'''
SETS = ["launch.workers_per_node=2", "data.source=synthetic", "parallel.tensor=0", "parallel.pipeline=0",
        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.vocab_size=256",
        "model.seq_length=32", "model.max_position_embeddings=32", "compile.num_steps=4"]


def trainium_like_tune(run_dir: Path, cache_root: Path) -> None:
    """A tune run folder as `megatron-hpc tune` writes it (tune_cmd.run_tune_job's calls), on a cpu platform that
    carries Trainium's compile wrapper; its node script gets Neuron's cache environment."""
    platform = replace(get_platform("cpu"), compile_wrapper=get_platform("trn1").compile_wrapper)
    cfg = load_recipe("tiny", SETS)
    plan = make_plan(cfg, num_nodes=1, platform=platform)
    candidates = plan_candidates("tiny", SETS, plan=plan, platform=platform, top=2, calibration=DEFAULT_CALIBRATION)
    first = candidates[0].spec
    run_dir.mkdir()
    req = SubmitRequest(cfg=first.config, plan=first.plan, platform=platform, cluster="local", run_dir=run_dir,
                        cache_root=cache_root, tune=True)
    request = write_request(run_dir, candidates, platform=platform, calibration=DEFAULT_CALIBRATION,
                            cache_root=cache_root, cluster="local")
    assert request["compiles"]
    files = write_run_files(req)
    tune = make_tune_phase(first.config, first.plan, platform, extra_env={})
    assert [p.phase for p in files.phases] == ["tune"] and tune.torchrun_wrapper == ("neuron_parallel_compile",)
    (run_dir / "node.sh").write_text(render_node_script(tune, recipe=cfg.name, run_dir=str(run_dir),
                                                        bin_dir=python_bin_dir(), backend="xla",
                                                        shared_cache=str(cache_root)))


def run_tune_phase(tmp_path: Path, run_dir: Path, shared: Path, *, fail: bool = False) -> subprocess.CompletedProcess:
    return run_phase_under_stand_in(tmp_path, run_dir, shared, phase="tune", stand_in=STAND_IN, fail=fail)


def test_tune_compiles_the_graphs_first_then_times_them_and_the_winner_skips_its_compile(tmp_path,
                                                                                         own_compile_cache):
    shared, run_dir = own_compile_cache, tmp_path / "tune"
    trainium_like_tune(run_dir, shared)
    proc = run_tune_phase(tmp_path, run_dir, shared)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # Pass 1: the trials under the tool, in the node-local cache; no times kept; nothing published while it ran.
    tool = json.loads((tmp_path / "tool.json").read_text())
    assert tool["argv"][0] == "torchrun" and tool["argv"][-2:] == ["--phase", "tune"]
    assert not tool["times_after_trial"]
    assert Path(tool["root"]).parent.name.startswith("megatron-hpc-cache.") and Path(tool["root"]).name == "neuron"
    assert tool["shared_when_done"] == []
    assert not list(tmp_path.glob("megatron-hpc-cache.*"))  # the node-local cache is removed at the end
    entry = shared / "neuron" / KEY
    assert (entry / "model.neff").read_bytes() == NEFF
    # Pass 2 after the publish, timed; then the fit and the fingerprints.
    log = (run_dir / "logs" / "tune-node0.log").read_text()
    order = ["tune pass 1 of 2", "stand-in neuron_parallel_compile: compiled into", "neuron: 1 copied",
             "tune pass 2 of 2", "recorded the compile fingerprints of the 2 layouts", "tune: fastest measured"]
    places = [log.find(line) for line in order]
    assert -1 not in places and places == sorted(places), list(zip(order, places))
    assert log.count("megatron-hpc compile: world 2") == 4  # each candidate's banner in each pass
    result = json.loads((run_dir / "tune.json").read_text())
    assert len(result["candidates"]) == 2 and all(r["measured_s"] > 0 for r in result["candidates"])

    # The run `submit --tune` plans with any candidate, the winner first, finds its graphs: no compile phase.
    rows = sorted(result["candidates"], key=lambda r: r["label"] != result["winner"]["label"])
    for n, row in enumerate(rows):
        out = tmp_path / f"run{n}"
        overlay = [a for s in [*SETS, *row["overlay"]] for a in ("--set", s)]
        assert main(["submit", "--recipe", "tiny", "--cluster", "local", "--dry-run", "--out", str(out),
                     *overlay]) == 0
        sha = json.loads((out / "compile-fingerprint.json").read_text())["sha256"]
        assert fingerprint.find(shared, sha) is not None, row["label"]


def test_a_failed_graphs_pass_runs_no_timed_pass_and_publishes_nothing(tmp_path, own_compile_cache):
    shared, run_dir = own_compile_cache, tmp_path / "tune"
    trainium_like_tune(run_dir, shared)
    proc = run_tune_phase(tmp_path, run_dir, shared, fail=True)
    assert proc.returncode != 0
    log = (run_dir / "logs" / "tune-node0.log").read_text()
    assert "tune pass 1 (graphs) failed (exit 1); no timed pass" in log and "tune pass 2" not in log
    assert "tune phase failed (exit 1)" in log
    assert not (run_dir / TUNE_MEASURED_FILE).exists() and not (run_dir / "tune.json").exists()
    assert not (shared / "neuron").exists() and not list((shared / fingerprint.MARKER_DIR).glob("*.json"))
    assert not list(tmp_path.glob("megatron-hpc-cache.*"))
