"""Output ranks of a convert written side by side by forked worker processes (`ckpt convert|reshard --workers N`).

One process writes one output rank at a time and keeps about one core busy (reading, cutting and casting, torch's
zip records and our checksums, os.write): on a node with idle cores a TP 8 x PP 8 convert would wait on 64 ranks in a
row. The workers are forked once the plan is made, so each starts with the source opened and planned and nothing
read yet; each writes its own run of consecutive output ranks into the shared staging folder, and the parent commits
the manifest once every worker has exited cleanly. Consecutive ranks share pipeline stages, so with PP a worker
reads mostly the stages its own ranks need; the TP ranks of one stage each read that stage's parts (a part is read
whole, every TP column of a layer at once), so splitting TP ranks over workers reads those parts once per worker.
Each worker holds its own output rank and read budget: the peak is about `workers` times one worker's.

Processes, not threads: each worker keeps its own reader, buffers and release bookkeeping, with no lock between
them. Fork, not spawn: a spawned worker would import torch and torch.distributed.checkpoint again (1-2.5 s each).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from megatron_hpc.errors import CheckpointError, MegatronHpcError

T = TypeVar("T")
_MESSAGE_BYTES = 4096
"""What a failed worker reports back, at most (well under a pipe's buffer, so it never blocks on writing it)."""


def split_runs(items: list[T], workers: int) -> list[list[T]]:
    """`items` cut into at most `workers` runs of consecutive items, as even as they go (none empty)."""
    if workers < 1:
        raise CheckpointError(f"--workers {workers} must be 1 or more; drop it to write one output rank at a time")
    count = min(workers, len(items)) or 1
    return [items[i * len(items) // count:(i + 1) * len(items) // count] for i in range(count)]


def in_workers(runs: list[list[T]], work: Callable[[list[T]], None]) -> None:
    """work(run) for every run: in this process when there is one, else each in its own forked process, all at once.
    A worker's failure is raised here, after every worker has ended, as one CheckpointError with its message."""
    if len(runs) == 1 or not hasattr(os, "fork"):
        for run in runs:
            work(run)
        return
    children: dict[int, int] = {}
    for run in runs:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the caller's code (its cleanup is the parent's)
            os.close(read_end)
            code = 0
            try:
                work(run)
            except BaseException as exc:  # reported to the parent, whatever it was
                text = str(exc) if isinstance(exc, MegatronHpcError) else f"{type(exc).__name__}: {exc}"
                os.write(write_end, text.encode(errors="replace")[:_MESSAGE_BYTES])
                code = 1
            finally:
                os._exit(code)
        os.close(write_end)
        children[pid] = read_end
    failures = []
    for pid, read_end in children.items():
        with os.fdopen(read_end, "rb") as reader:
            message = reader.read().decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures.append(message or (f"a worker was killed by signal {-code} (9 is what the kernel's "
                                        "out-of-memory killer sends: use fewer --workers or a smaller "
                                        "--read-budget-gib)" if code < 0 else f"a worker exited with status {code}"))
    if failures:
        more = f" ({len(failures) - 1} more worker(s) failed too)" if len(failures) > 1 else ""
        raise CheckpointError(f"{failures[0]}{more}")
