"""The CLI starts light (issue 26): building any command's parser imports neither numpy nor torch, and `plan` and
`submit --dry-run` of a run without .bin/.idx files never import them. numpy alone made `plan` two to three times
slower (benchmarks/launcher_latency.py times it); the commands that read data files import it when they read them.

Each check runs in a fresh interpreter: this test process has numpy loaded already. No timing is asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_hpc.cli.main import COMMANDS

HEAVY = ("numpy", "torch")


def _imported_after(code: str) -> list[str]:
    """The HEAVY modules a fresh interpreter holds after running `code`."""
    script = (f"import json, sys\n{code}\n"
              f"print('HEAVY', json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("HEAVY "))
    return json.loads(line[len("HEAVY "):])


def test_every_commands_parser_is_built_without_numpy_or_torch():
    code = ("from megatron_hpc.cli.main import COMMANDS, build_parser\n"
            "for name in COMMANDS:\n"
            "    build_parser([name])\n")
    assert _imported_after(code) == []
    assert len(COMMANDS) > 10  # every command of the registry was built above


@pytest.mark.parametrize("argv", [
    ["plan", "--recipe", "gpt3_6.7b", "--nodes", "16"],
    ["plan", "--recipe", "gpt3_6.7b", "--nodes", "16", "--platform", "p5", "--json"],
    ["plan", "--recipe", "gpt3_175b", "--nodes", "3"],  # a refusal tries its fixes without numpy too
    ["submit", "--recipe", "gpt3_6.7b", "--nodes", "16", "--set", "data.source=synthetic", "--dry-run", "--json"],
    ["submit", "--recipe", "tiny", "--set", "data.source=synthetic", "--dry-run"],  # tiny names the demo data
])
def test_plan_and_a_dry_run_without_data_files_import_neither(argv, tmp_path):
    out = ["--out", str(tmp_path / "run")] if argv[0] == "submit" else []
    code = f"from megatron_hpc.cli.main import main\nmain({[*argv, *out]!r})"
    assert _imported_after(code) == []


def test_the_check_sees_numpy_where_a_dry_run_reads_data_files(tmp_path):
    import numpy as np

    from megatron_hpc.data.indexed import IndexedDatasetWriter

    prefix = tmp_path / "tiny_text_document"
    writer = IndexedDatasetWriter(prefix, dtype=np.uint16)
    writer.add_document(list(range(64)))
    writer.finalize()
    code = ("from megatron_hpc.cli.main import main\n"
            f"main(['submit', '--recipe', 'tiny', '--set', 'data.path={prefix}', '--dry-run', '--out', "
            f"{str(tmp_path / 'run')!r}])")
    assert _imported_after(code) == ["numpy"]


@pytest.mark.parametrize("module", ["megatron_hpc", "megatron_hpc.cli.main"])
def test_both_module_forms_run_the_cli(module: str) -> None:
    # `python -m megatron_hpc.cli.main` imported the CLI and exited 0 having done nothing; a bad --nodes must be
    # answered in one line with exit 1 by either form.
    proc = subprocess.run([sys.executable, "-m", module, "plan", "--recipe", "tiny", "--nodes", "0"],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == ["megatron-hpc: error: --nodes 0: a run needs at least 1 node; "
                                                "use --nodes 1 or more"]
