"""Root resolution and entry classification of the Neuron compile cache (shared/reference/neuron-xla.md 2.1, 2.2).

The cache trees are stand-ins built by tests/fixtures/fake_neuron_cache.py from the documented layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_hpc.compile_cache import neuron

from megatron_hpc.cli.main import main
from megatron_hpc.errors import CompileCacheError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import fake_neuron_cache as fake


@pytest.mark.parametrize(("env", "expected", "source"), [
    ({}, "/var/tmp/neuron-compile-cache", "default"),
    ({"NEURON_COMPILE_CACHE_URL": "/fsx/cache"}, "/fsx/cache", "NEURON_COMPILE_CACHE_URL"),
    ({"NEURON_COMPILE_CACHE_URL": "/fsx/cache", "NEURON_CC_FLAGS": "--model-type transformer --cache_dir=/home/u/nc"},
     "/home/u/nc", "NEURON_CC_FLAGS --cache_dir"),
    ({"NEURON_CC_FLAGS": "--cache_dir /scratch/nc --log_level=INFO"}, "/scratch/nc", "NEURON_CC_FLAGS --cache_dir"),
    ({"NEURON_CC_FLAGS": "--model-type transformer", "NEURON_COMPILE_CACHE_URL": ""},
     "/var/tmp/neuron-compile-cache", "default"),
])
def test_root_precedence(env, expected, source):
    root = neuron.resolve_root(env)
    assert (str(root.path), root.source) == (expected, source)


def test_root_warns_on_ignored_url_and_no_cache_and_rejects_s3():
    root = neuron.resolve_root({"NEURON_COMPILE_CACHE_URL": "/a", "NEURON_CC_FLAGS": "--cache_dir=/b --no_cache"})
    assert any("/a is ignored" in w for w in root.warnings)
    assert any("--no_cache" in w for w in root.warnings)
    with pytest.raises(CompileCacheError, match="S3"):
        neuron.resolve_root({"NEURON_COMPILE_CACHE_URL": "s3://bucket/cache"})


@pytest.mark.parametrize(("names", "state"), [
    ({"model.hlo_module.pb", "compile_flags.json", "model.neff", "model.done"}, "complete"),
    ({"model.hlo_module.pb", "compile_flags.json", "model.log"}, "failed"),
    ({"model.hlo_module.pb", "model.hlo_module.pb.lock"}, "locked"),
    ({"model.hlo_module.pb", "model.log", "model.hlo_module.pb.lock"}, "locked"),  # a retry compiling
    ({"model.hlo_module.pb", "compile_flags.json"}, "incomplete"),
    ({"model.hlo_module.pb", "model.neff"}, "incomplete"),  # interrupted before model.done
    (set(), "incomplete"),
])
def test_classify(names, state):
    assert neuron.classify(names).value == state


def _fake_tree(root: Path) -> dict[str, str]:
    expected = {}
    for i, state in enumerate(fake.STATES * 2):
        version = fake.VERSION if i < 4 else fake.OLD_VERSION
        name = fake.module_name(i)
        fake.write_entry(root, version=version, name=name, files=fake.entry_files(state, seed=i))
        expected[f"neuronxcc-{version}/{name}"] = state
    # not entries: a publisher's temp dir, a stray file, a non-neuronxcc dir
    (root / f"neuronxcc-{fake.VERSION}" / ".MODULE_x+1.tmp.h.1.ab").mkdir()
    (root / "README").write_text("not an entry")
    (root / "torch-inductor").mkdir()
    return expected


def test_cli_ls_and_stats_classify_the_fake_tree(tmp_path, capsys):
    expected = _fake_tree(tmp_path)
    assert main(["cache", "ls", "--root", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["key"]: r["state"] for r in rows} == expected
    assert main(["cache", "stats", "--root", str(tmp_path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["entries"] == 8
    assert s["counts"] == {"complete": 2, "locked": 2, "failed": 2, "incomplete": 2}
    assert set(s["versions"]) == {fake.VERSION, fake.OLD_VERSION}
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("neuronxcc-*/MODULE_*/*"))
    assert s["bytes"] == on_disk


def test_cli_neuron_layout_without_root_takes_neuron_own_root_from_the_environment(tmp_path, monkeypatch, capsys):
    _fake_tree(tmp_path / "nc")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "/nonexistent/elsewhere")
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--model-type transformer --cache_dir={tmp_path / 'nc'}")
    assert main(["cache", "stats", "--layout", "neuron", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["entries"] == 8
    assert "NEURON_CC_FLAGS --cache_dir" in captured.err


def test_cli_without_root_shows_the_shared_cache_of_submit_and_names_neurons_own(tmp_path, monkeypatch, capsys,
                                                                                  own_compile_cache):
    """A user who ran `submit` and then `cache ls` sees what the jobs put in $MEGATRON_HPC_CACHE_DIR (neuron/ of
    the launcher root); Neuron's own cache, filled by compiles outside submit, is named on stderr, not hidden."""
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "nc"))
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    neurons_own = _fake_tree(tmp_path / "nc")
    shared = {}
    for i in (20, 21):
        fake.write_entry(own_compile_cache / "neuron", version=fake.VERSION, name=fake.module_name(i),
                         files=fake.entry_files("complete", seed=i))
        shared[f"neuron/neuronxcc-{fake.VERSION}/{fake.module_name(i)}"] = "complete"
    (own_compile_cache / "inductor" / "ab").mkdir(parents=True)
    (own_compile_cache / "inductor" / "ab" / "cab.py").write_bytes(b"code")
    shared["inductor/ab/cab.py"] = "complete"

    assert main(["cache", "ls", "--json"]) == 0
    captured = capsys.readouterr()
    assert {r["key"]: r["state"] for r in json.loads(captured.out)} == shared
    assert f"cache root {own_compile_cache} (the shared compile cache of submit)" in captured.err
    assert f"Neuron's own cache {tmp_path / 'nc'} (from NEURON_COMPILE_CACHE_URL) holds 8 entries" in captured.err
    assert main(["cache", "stats", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert (s["layout"], s["entries"], s["parts"]["neuron"]["entries"]) == ("launcher", 3, 2)
    assert main(["cache", "ls"]) == 0
    table = capsys.readouterr().out
    assert all(key in table for key in shared) and not any(key in table for key in neurons_own)

    # --layout neuron is Neuron's own root; an explicit --root is read in the layout it holds
    assert main(["cache", "ls", "--layout", "neuron", "--json"]) == 0
    assert {r["key"]: r["state"] for r in json.loads(capsys.readouterr().out)} == neurons_own
    assert main(["cache", "ls", "--root", str(tmp_path / "nc"), "--json"]) == 0
    assert {r["key"]: r["state"] for r in json.loads(capsys.readouterr().out)} == neurons_own
    assert main(["cache", "ls", "--root", str(own_compile_cache), "--json"]) == 0
    assert {r["key"]: r["state"] for r in json.loads(capsys.readouterr().out)} == shared


def test_cli_clear_failed_and_locks_without_root_work_on_the_shared_neuron_folder(tmp_path, monkeypatch, capsys,
                                                                                  own_compile_cache):
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "nc"))
    _fake_tree(tmp_path / "nc")
    fake.write_entry(own_compile_cache / "neuron", version=fake.VERSION, name=fake.module_name(30),
                     files=fake.entry_files("failed", seed=30))
    assert main(["cache", "clear-failed", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [f"neuron/neuronxcc-{fake.VERSION}/{fake.module_name(30)}"]
    assert main(["cache", "clear-failed", "--layout", "neuron", "--dry-run", "--json"]) == 0
    removed = json.loads(capsys.readouterr().out)["removed"]
    assert len(removed) == 2 and all(key.startswith("neuronxcc-") for key in removed)  # the fake tree's two


def test_compile_cache_and_its_cli_never_import_torch(tmp_path):
    code = ("import sys\n"
            "import megatron_hpc.compile_cache.neuron, megatron_hpc.compile_cache.locks\n"
            "import megatron_hpc.compile_cache.store, megatron_hpc.compile_cache.prune\n"
            "import megatron_hpc.compile_cache.report, megatron_hpc.compile_cache.paths\n"
            "from megatron_hpc.cli.main import main\n"
            f"assert main(['cache', 'stats', '--root', {str(tmp_path)!r}]) == 0\n"
            "print('TORCH', 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert "TORCH False" in proc.stdout
