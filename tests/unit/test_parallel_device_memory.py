"""keep_freed_memory: a freed large tensor's memory is reused, not faulted in again (measured in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, resource, sys, torch
from megatron_hpc.parallel.device import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
n = 64 << 20
torch.empty(n, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(n, dtype=torch.uint8).fill_(2)  # the same size again, as in the next training step
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults() -> None:
    pages = (64 << 20) // 4096
    default, kept = _faults("default"), _faults("keep")
    assert default["faults"] > pages // 2  # glibc unmapped the block; touching the new one faults every page
    assert kept["applied"] is True
    assert kept["faults"] < pages // 20  # the heap kept it
