"""benchmarks/data_index_build.py measures each build's own peak memory, not the script's.

The pitfall it avoids is real here: a child spawned from a large process reports that process's high-water
mark through wait4's ru_maxrss (and its own getrusage), since Linux sets it at exec from the memory the child
was spawned from. The test makes the parent large and checks that the benchmark's figure stays the child's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "data_index_build.py"
SMALL_CHILD = "print('BUILD', 0.5, 7)\nprint('MEMORY', _status_kib('VmRSS'), _status_kib('VmHWM'))\n"


def _bench():
    spec = importlib.util.spec_from_file_location("data_index_build", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_small_child_of_a_large_parent_reports_its_own_peak():
    bench = _bench()
    ballast = bytearray(512 << 20)
    for i in range(0, len(ballast), 4096):  # resident, not just reserved
        ballast[i] = 1
    code = bench.MEMORY + SMALL_CHILD
    result = bench.run(sys.executable, code, [], dict(os.environ))
    assert (result.build_s, result.samples) == (0.5, 7)
    assert result.peak_mib < 64, result  # a bare interpreter: about 10 MiB

    # the parent's view of the same child carries this process's 512+ MiB
    read, write = os.pipe()
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ),
                         file_actions=[(os.POSIX_SPAWN_DUP2, write, 1)])
    os.close(write)
    with os.fdopen(read) as fh:
        fh.read()
    _, _, usage = os.wait4(pid, 0)
    assert usage.ru_maxrss / 1024 > 512
    del ballast


def test_the_verdict_calls_mixed_rounds_parity():
    bench = _bench()
    assert bench.verdict([0.76, 1.11, 0.9]).startswith("parity")
    assert bench.verdict([0.6, 0.7]) == "faster in every round"
    assert bench.verdict([1.2, 1.01]) == "slower in every round"
