"""AsyncSave: one checkpoint whose files a background thread writes while training goes on (Megatron's --async-save).

Why the split: the saver's collectives (the shared token, all_ok) must never run on a second thread beside the
training collectives of the same process group: gloo and nccl match collectives by their order on a group, so the
two streams would interleave differently on different ranks. So only the file writes move to the thread:

- start (main thread, collective): the shared temp folder (saver.begin_save), then the state copied to host memory
  (xser.snapshot: the optimizer updates the live tensors in place next step), then the thread starts; or, with
  copy_in_background, the thread makes that copy too, during the next step's forward and backward, and the caller
  waits for it (wait_copied) only before the optimizer step, the first write to the saved tensors;
- the thread writes this rank's files (saver.write_rank_files: plain file I/O; writing and crc32 release the GIL);
- finish (main thread, collective, at a well-defined point: the next save, a stop, the end of the run): join the
  thread, then saver.finish_save: all ranks agree that every rank's files are complete, and only then rank 0 writes
  the manifest, renames the folder and writes the tracker, last, as a synchronous save does.

A crash (kill -9) before finish leaves only a temp folder, which no loader reads and the next save removes.
The writers do not wait for io_workers_per_node phases (those need collectives): the state is in host memory
already, which is what the phases bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_hpc.checkpoint.store.compat import PipelineLayout
from megatron_hpc.checkpoint.store.ranks import RankInfo
from megatron_hpc.checkpoint.store.saver import begin_save, finish_save, write_rank_files
from megatron_hpc.checkpoint.store.xser import Snapshot, snapshot
from megatron_hpc.errors import CheckpointError


class AsyncSave:
    """A started save of checkpoint `iteration`; finish() completes it (every rank calls both, in the same order)."""

    def __init__(self, root: Path, iteration: int, state: dict[str, Any], *, ranks: RankInfo, fmt: str,
                 keep_last: int, layout: PipelineLayout, on_written: Callable[[], None] | None = None,
                 reuse: Snapshot | None = None, copy_in_background: bool = False):
        """Collective. `on_written` runs on the writer thread once this rank's files are complete (or failed);
        `reuse`: the host memory of an earlier, finished save, overwritten by this one's snapshot.
        `copy_in_background`: the writer thread makes the host copy too; the caller must then call wait_copied()
        before anything writes to the state's tensors (the next optimizer step). Raises CheckpointError on every
        rank when the temp folder could not be made."""
        if fmt not in ("xser", "torch"):
            raise CheckpointError(f"checkpoint.format {fmt!r} is not supported; use xser or torch")
        self.root, self.iteration, self.ranks = root, iteration, ranks
        self.fmt, self.keep_last, self.layout = fmt, keep_last, layout
        self.error: BaseException | None = None
        """This rank's failure: the folder (rank 0), the snapshot or the writes."""
        self.tmp, self.error = begin_save(root, iteration, ranks=ranks)
        self._ok = ranks.all_ok(self.error is None)
        self._thread: threading.Thread | None = None
        self.host: Snapshot | None = None
        """The host copy the writer writes from; after finish(), free for the next save to reuse."""
        self._copied = threading.Event()
        if not self._ok:  # every rank knows it now: fail together at once, not at the next save
            self.finish()
        if not ranks.is_writer:
            self._copied.set()
            return
        if not copy_in_background:
            try:
                self._copy(state, reuse)
            except CheckpointError as exc:
                self.error = exc
                return
        self._thread = threading.Thread(target=self._write, args=(state, reuse, on_written),
                                        name=f"checkpoint-{iteration}-writer", daemon=False)
        self._thread.start()

    def _copy(self, state: dict[str, Any], reuse: Snapshot | None) -> None:
        try:
            self.host = snapshot(state, into=reuse)
        finally:
            self._copied.set()

    def _write(self, state: dict[str, Any], reuse: Snapshot | None, on_written: Callable[[], None] | None) -> None:
        try:
            if not self._copied.is_set():
                self._copy(state, reuse)
            write_rank_files(self.host, self.tmp, ranks=self.ranks, fmt=self.fmt)
        except Exception as exc:  # any failure is reported at finish(), on the main thread
            self.error = exc
        finally:
            if on_written is not None:
                on_written()

    def wait_copied(self) -> None:
        """Block until the state is in host memory (no collective); after it the live tensors may change."""
        self._copied.wait()

    def wait_local(self) -> BaseException | None:
        """Wait for this rank's writer (no collective); its error or None. For error paths, where the other ranks
        may not reach finish()."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.error

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> Path:
        """Collective: wait for the writer, then commit (manifest, rename, tracker) when every rank's files are
        complete. The final folder; CheckpointError on every rank otherwise, naming this rank's cause."""
        error = self.wait_local()
        return finish_save(self.root, self.iteration, self.tmp, ranks=self.ranks, ok=self._ok, error=error,
                           fmt=self.fmt, keep_last=self.keep_last, layout=self.layout)
