"""kill -9 a process in the middle of saves, synchronous or asynchronous: the restart always finds a complete,
verified checkpoint."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import RankInfo, find_checkpoint, load_checkpoint, paths

# Saves iterations 1, 2, 3, ... forever; each tensor holds its iteration, so a loaded state shows
# whether it is all from one save. Prints "ready" once iteration 1 is complete.
_WRITER = textwrap.dedent('''
    import sys, torch
    from pathlib import Path
    from megatron_hpc.checkpoint.store.ranks import RankInfo
    from megatron_hpc.checkpoint.store.saver import save_checkpoint
    root, it = Path(sys.argv[1]), int(sys.argv[2])
    while True:
        state = {"iteration": it, "model": {f"w{i}": torch.full((2048,), float(it)) for i in range(60)}}
        save_checkpoint(root, it, state, ranks=RankInfo(), keep_last=2)
        if it == int(sys.argv[2]):
            print("ready", flush=True)
        it += 1
''')


# The same with checkpoint.async_save's AsyncSave as the trainer runs it: a save starts, the writer thread copies the
# state and writes it, the state is "trained" in place once copied (as the optimizer does), and the save completes
# when the next one starts. Prints "ready" once iteration 1 is committed.
_ASYNC_WRITER = textwrap.dedent('''
    import sys, torch
    from pathlib import Path
    from megatron_hpc.checkpoint.store.async_save import AsyncSave
    from megatron_hpc.checkpoint.store.compat import PipelineLayout
    from megatron_hpc.checkpoint.store.ranks import RankInfo
    root, it = Path(sys.argv[1]), int(sys.argv[2])
    model = {f"w{i}": torch.full((2048,), float(it)) for i in range(60)}
    while True:
        pending = AsyncSave(root, it, {"iteration": it, "model": model}, ranks=RankInfo(), fmt="xser", keep_last=2,
                            layout=PipelineLayout(pipeline=1), copy_in_background=True)
        pending.wait_copied()  # as the trainer's optimizer step does
        for t in model.values():  # the next step's update, in place, while the writer runs
            t.fill_(float(it + 1))
        pending.finish()  # where the next save would wait for it
        if it == int(sys.argv[2]):
            print("ready", flush=True)
        it += 1
''')


@pytest.mark.parametrize("writer", [_WRITER, _ASYNC_WRITER], ids=["sync", "async"])
def test_kill_during_saves(tmp_path: Path, writer: str) -> None:
    seed = int(os.environ.get("CKPT_KILL_SEED", "0")) or time.time_ns()  # rerun a failure with this seed
    rng = random.Random(seed)
    start = 1
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path), str(start)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside a later save (each takes ~0.1 s)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        tracked = int((tmp_path / paths.TRACKER).read_text())
        found = find_checkpoint(tmp_path)
        assert found is not None and found.iteration == tracked >= start, (seed, attempt, tracked)
        found, state = load_checkpoint(tmp_path, ranks=RankInfo())  # every file checked against the manifest
        assert state["iteration"] == tracked
        assert all(torch.equal(t, torch.full((2048,), float(tracked))) for t in state["model"].values())
        start = tracked + 1  # the restarted writer goes on from there, as a resumed run would
    leftovers = [p.name for p in tmp_path.iterdir() if paths.is_temp_dirname(p.name)]
    assert len(leftovers) <= 1, leftovers  # at most the save that was killed last
