"""The node script's compile-cache lines, per platform: the compilers point at a node-local cache that is
synced before torchrun and published after it. Running them: tests/multiprocess/test_compile_tree_publish.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from megatron_hpc.cli.main import main


def node_script(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "d"
    assert main(["submit", *args, "--dry-run", "--out", str(out)]) == 0
    text = (out / "node.sh").read_text()
    assert subprocess.run(["bash", "-n", str(out / "node.sh")], capture_output=True).returncode == 0
    return text


def line_index(text: str, needle: str) -> int:
    """The last line holding needle: the tune phase's graphs pass (before the phase's own command) repeats the
    torchrun, publish and requeue lines, which the tests below place for the phase's own command."""
    found = [i for i, line in enumerate(text.splitlines()) if needle in line]
    assert found, needle
    return found[-1]


def test_cpu_with_torch_compile_uses_a_node_local_inductor_cache(tmp_path, own_compile_cache):
    node = node_script(tmp_path, "--recipe", "tiny", "--cluster", "local", "--set", "train.compile=true")
    assert "NEURON" not in node
    for line in (f"SHARED_CACHE={own_compile_cache}", 'export TORCHINDUCTOR_CACHE_DIR="$LOCAL_CACHE/inductor"',
                 'export TRITON_CACHE_DIR="$LOCAL_CACHE/triton"', "export TORCHINDUCTOR_FX_GRAPH_CACHE=1",
                 "export TORCHINDUCTOR_AUTOGRAD_CACHE=1",
                 "export TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD=1",
                 "export TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0"):
        assert line in node.splitlines(), line
    mktemp = line_index(node, "mktemp -d")
    exports = line_index(node, "export TORCHINDUCTOR_CACHE_DIR")
    sync = line_index(node, 'cache_transfer sync "$SHARED_CACHE" "$LOCAL_CACHE"')
    torchrun = line_index(node, 'exec "${TORCHRUN_WRAPPER[@]}" torchrun')
    publish = line_index(node, 'cache_transfer publish "$LOCAL_CACHE" "$SHARED_CACHE"')
    remove = line_index(node, 'rm -rf "$LOCAL_CACHE"')
    requeue = line_index(node, "megatron_hpc.launch.requeue")
    assert mktemp < exports < sync < torchrun < publish < remove < requeue


def test_cpu_without_torch_compile_sets_no_inductor_switches(tmp_path):
    node = node_script(tmp_path, "--recipe", "tiny", "--cluster", "local")
    assert "TORCHINDUCTOR_FX_GRAPH_CACHE" not in node and "TORCHINDUCTOR_CACHE_DIR" in node


def test_trainium_compiles_under_neuron_parallel_compile_in_the_node_local_cache(tmp_path):
    """The whole neuron_parallel_compile (trial and compile) uses the node-local cache; it is published after the
    tool returned. Running it: tests/unit/test_compile_cache_node_publish.py."""
    node = node_script(tmp_path, "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "trn1",
                       "--set", "data.source=synthetic")
    assert 'export NEURON_COMPILE_CACHE_URL="$LOCAL_CACHE/neuron"' in node.splitlines()
    assert "TORCHINDUCTOR" not in node
    assert "NEURON_EXTRACT_GRAPHS_ONLY" not in node and "LOCAL_CACHE=$SHARED_CACHE" not in node
    order = [line_index(node, "mktemp -d"), line_index(node, "export NEURON_COMPILE_CACHE_URL"),
             line_index(node, 'cache_transfer sync "$SHARED_CACHE" "$LOCAL_CACHE"'),
             line_index(node, 'if [ "$PHASE" = compile ]; then'),
             line_index(node, "TORCHRUN_WRAPPER=(neuron_parallel_compile)"),
             line_index(node, 'exec "${TORCHRUN_WRAPPER[@]}" torchrun'),
             line_index(node, 'cache_transfer publish "$LOCAL_CACHE" "$SHARED_CACHE"'),
             line_index(node, "megatron_hpc.launch.requeue")]
    assert order == sorted(order)
