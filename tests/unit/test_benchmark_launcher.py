"""benchmarks/launcher_latency.py still runs: every command it times succeeds, and the .bin/.idx row reads the
dataset the script writes (issue 26: it had rotted, submitting gpt3_6.7b without data.path).

The smoke size runs each command once, without the torch anchor; no timing is asserted here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "launcher_latency.py"


def _bench():
    spec = importlib.util.spec_from_file_location("launcher_latency", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_smoke_size_runs_every_command(capsys):
    bench = _bench()
    lines = bench.main(["--smoke"])
    rows = {line.split("  ")[1].strip() for line in lines[1:]}
    assert rows == {bench.FLOOR, "--help", "plan 16 nodes", "submit --dry-run 16 nodes, synthetic",
                    "submit --dry-run 16 nodes, .bin/.idx"}
    assert "1 round(s)" in lines[0] and "bytecode cache on" in lines[0]
    assert capsys.readouterr().out.splitlines() == lines


def test_a_command_that_fails_stops_the_benchmark_with_its_error(tmp_path):
    bench = _bench()
    assert bench.child_env(tmp_path, bytecode_cache=True)["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    env = bench.child_env(tmp_path, bytecode_cache=False)
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and "PYTHONPYCACHEPREFIX" not in env
    with pytest.raises(SystemExit, match="unknown recipe 'no_such_recipe'"):
        bench.time_once([sys.executable, "-m", "megatron_hpc", "plan", "--recipe", "no_such_recipe"], env)
