"""The README's install note stays true: the torch it pins everywhere is one version, and on a machine without
the local CPU wheel it says where the CPU build comes from (PyTorch's CPU wheel index), since the same pin from the
default index is the CUDA build on Linux."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(r"torch==(\d+\.\d+\.\d+)")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)


def test_the_cpu_index_note_follows_the_first_commands_with_the_same_pin():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first, note = _blocks(readme)[:2]
    assert "bash tests/run.sh" in first  # the first two commands stay first
    pins = set(PIN.findall(first)) | set(PIN.findall(note)) | set(PIN.findall((REPO / "tests/run.sh").read_text()))
    assert len(pins) == 1, pins
    install = [line for line in note.splitlines() if "pip install torch==" in line]
    assert len(install) == 1 and install[0].endswith("--index-url https://download.pytorch.org/whl/cpu"), note
    between = readme[readme.index(first) + len(first):readme.index(note)]
    assert "CUDA" in between and "PyTorch's CPU wheel index" in between
