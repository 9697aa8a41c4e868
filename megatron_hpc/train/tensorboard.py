"""TensorBoard event files of a run, written by the last rank under <run folder>/tensorboard.

Scalar names are Megatron's where it has one (training.py::training_log and
evaluate_and_print_results): "learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm",
"iteration-time", "throughput" (TFLOP/s per worker), "mem-max-allocated-bytes", "lm loss validation",
"lm loss validation ppl", plus the "... vs samples" twins keyed by consumed samples. Ours:
"samples-per-second", "tokens-per-second", "tflops-per-worker", "mfu" (against the plan's
peak_tflops_per_worker: the hardware planned for, at the run's precision), on CPU "mem-max-rss-bytes"
(peak resident set size), and "straggler-max-ratio" and "stragglers" (train/stragglers.py).
Throughput scalars skip log intervals that hold the first steps of the process (warm-up).
"""

from __future__ import annotations

import math
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_hpc.run_folder import TENSORBOARD_DIR

if TYPE_CHECKING:
    from megatron_hpc.run_folder import IterationRecord


def max_memory(device: torch.device) -> tuple[str, int] | None:
    """(tag, bytes) of this process's peak memory: accelerator allocations, or RSS on the CPU."""
    if device.type == "cpu":
        # ru_maxrss is in KiB on Linux.
        return "mem-max-rss-bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type == "cuda":
        return "mem-max-allocated-bytes", int(torch.accelerator.max_memory_allocated(device.index))
    return None  # XLA: reading device memory stats would cut the lazy graph


class TensorBoardWriter:
    """A SummaryWriter with the run's tag names; one per process, on the last rank only."""

    def __init__(self, log_dir: Path, *, peak_tflops: float, device: torch.device):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self.log_dir = log_dir
        self.peak_tflops, self.device = peak_tflops, device
        self._writer: Any = SummaryWriter(log_dir=str(log_dir))

    def _add(self, tag: str, value: float, step: int) -> None:
        if math.isfinite(value):
            self._writer.add_scalar(tag, value, step)

    def iteration(self, rec: IterationRecord) -> None:
        """Scalars of one logged interval; throughput only when it is past warm-up."""
        it, samples = rec.iteration, rec.consumed_samples
        for tag, value in (("learning-rate", rec.lr), ("batch-size", rec.global_batch_size),
                           ("lm loss", rec.lm_loss)):
            self._add(tag, value, it)
            self._add(f"{tag} vs samples", value, samples)
        self._add("loss-scale", rec.loss_scale, it)
        self._add("grad-norm", rec.grad_norm, it)
        if not rec.warmup and rec.elapsed_ms > 0:
            self._add("iteration-time", rec.elapsed_ms / 1000.0, it)
            self._add("samples-per-second", rec.global_batch_size / (rec.elapsed_ms / 1000.0), it)
            self._add("tokens-per-second", rec.tokens_per_s, it)
            self._add("tflops-per-worker", rec.tflops_per_worker, it)
            self._add("throughput", rec.tflops_per_worker, it)
            self._add("mfu", rec.tflops_per_worker / self.peak_tflops, it)
        memory = max_memory(self.device)
        if memory is not None:
            self._add(memory[0], float(memory[1]), it)
        self._writer.flush()

    def validation(self, iteration: int, *, consumed_samples: int, lm_loss: float, ppl: float,
                   split: str = "valid") -> None:
        # Megatron writes its test loss under the validation tags, at the same step as the last validation; a tag
        # of its own keeps the two curves apart.
        name = "validation" if split == "valid" else split
        for tag, value in ((f"lm loss {name}", lm_loss), (f"lm loss {name} ppl", ppl)):
            self._add(tag, value, iteration)
            self._add(f"{tag} vs samples", value, consumed_samples)
        self._writer.flush()

    def stragglers(self, iteration: int, *, max_ratio: float, count: int) -> None:
        """The slowest node's compute over the median node's, and how many nodes are named (train/stragglers.py)."""
        self._add("straggler-max-ratio", max_ratio, iteration)
        self._add("stragglers", float(count), iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def open_tensorboard(run_dir: Path | None, *, enabled: bool, peak_tflops: float,
                     device: torch.device) -> TensorBoardWriter | None:
    """The writer for <run_dir>/tensorboard, or None when disabled, not the last rank, or no run folder.

    MFU is taken against `peak_tflops`, the plan's peak_tflops_per_worker: the hardware the run was planned for
    (an A100 platform file's figure, though it runs as p5), not the runtime platform's built-in one.
    """
    if not enabled or run_dir is None:
        return None
    return TensorBoardWriter(run_dir / TENSORBOARD_DIR, peak_tflops=peak_tflops, device=device)
