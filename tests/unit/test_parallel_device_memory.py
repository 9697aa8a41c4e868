"""keep_freed_memory: after a warm-up, a training-like loop reuses its freed blocks instead of faulting in new pages
(measured in fresh processes), and the process does not grow."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, resource, sys, torch
from megatron_hpc.parallel.device import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
sizes = (64 << 20, 24 << 20, 40 << 20)  # large activations, allocated, touched and freed by every step

def step():
    live = [torch.empty(n, dtype=torch.uint8).fill_(1) for n in sizes]
    del live

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20

for _ in range(20):  # glibc's heap settles within a few steps
    step()
faults, rss = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, rss_mib()
for _ in range(10):
    step()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
                  "growth_mib": rss_mib() - rss}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults() -> None:
    pages_per_step = (128 << 20) // 4096
    default, kept = _probe("default"), _probe("keep")
    assert default["faults"] > 5 * pages_per_step  # glibc unmaps each block on free; every step faults them in
    assert kept["applied"] is True
    assert kept["faults"] < pages_per_step // 4  # the heap kept them
    assert kept["growth_mib"] < 16  # and it does not grow step after step
