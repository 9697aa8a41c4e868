"""Megatron's iteration line and validation block, their metrics.jsonl twins, and the FLOPs behind TFLOP/s.

Line format: shared/reference/megatron-and-launchers.md 4.1 (training_log, the version with the
timestamp prefix and `learning rate: {:.6E}`; the validation block of evaluate_and_print_results),
printed by the last rank. FLOPs: the planner's formula (megatron_hpc.plan.model_math, the classic
form of 4.4 with the padded vocabulary). TensorBoard scalars go through train/tensorboard.py.
"""

from __future__ import annotations

import math
import time
from datetime import datetime
from pathlib import Path
from typing import TextIO

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.evaluate.perplexity import capped_ppl
from megatron_hpc.plan.model_math import flops_per_token
from megatron_hpc.run_folder import METRICS_FILE, IterationRecord, ValidationRecord, append_line
from megatron_hpc.train.tensorboard import TensorBoardWriter

WARMUP_STEPS = 2
"""Steps at the start of a process (graph capture, allocator growth) kept out of throughput figures."""


def format_iteration_line(rec: IterationRecord, *, now: datetime) -> str:
    """The iteration line exactly as Megatron prints it (log-throughput on, no skipped samples).

    Skipped and NaN iterations are counts within the log interval, as in Megatron. A loss that is not a
    positive number (an interval of skipped steps only, or a NaN) leaves out the `lm loss` field, as Megatron's
    `if avg > 0.0` does; a non-finite grad norm (a skipped step: Megatron's optimizer returns None) leaves out
    `grad norm`. Megatron never prints "NAN" there; the skips and NaNs show in the counts.
    """
    loss = f" lm loss: {rec.lm_loss:.6E} |" if rec.lm_loss > 0.0 else ""  # False for NaN, as in Megatron
    grad_norm = f" grad norm: {rec.grad_norm:.3f} |" if math.isfinite(rec.grad_norm) else ""
    return (
        f" [{now.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        f" iteration {rec.iteration:8d}/{rec.train_iters:8d} |"
        f" consumed samples: {rec.consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {rec.elapsed_ms:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {rec.tflops_per_worker:.1f} |"
        f" learning rate: {rec.lr:.6E} |"
        f" global batch size: {rec.global_batch_size:5d} |"
        f"{loss}"
        f" loss scale: {rec.loss_scale:.1f} |"
        f"{grad_norm}"
        f" number of skipped iterations: {rec.num_skipped_iterations:3d} |"
        f" number of nan iterations: {rec.num_nan_iterations:3d} |"
    )


def format_validation_block(iteration: int, *, lm_loss: float, split: str = "valid") -> str:
    """Dashes, the validation line, dashes (evaluate_and_print_results; the dash line is one longer). The test
    split's prefix is Megatron's "iteration N on test set"."""
    where = f"iteration {iteration}" + (" on test set" if split == "test" else "")
    line = (f" validation loss at {where} | lm loss value: {lm_loss:.6E} |"
            f" lm loss PPL: {capped_ppl(lm_loss):.6E} | ")
    dashes = "-" * (len(line) + 1)
    return f"{dashes}\n{line}\n{dashes}"


def parse_iteration_line(line: str) -> dict[str, str]:
    """Fields of an iteration line: split on ' | ', then on the last ': ' (reference 4.1)."""
    body = line.strip()
    if body.startswith("["):
        body = body[body.index("]") + 1:]
    fields: dict[str, str] = {}
    for part in body.strip().strip("|").split(" | "):
        part = part.strip().strip("|").strip()
        if not part:
            continue
        if part.startswith("iteration "):
            fields["iteration"] = "".join(part.split()[1:])  # "5/      20" -> "5/20"
            continue
        key, _, value = part.rpartition(": ")
        fields[key] = value
    return fields


class MetricsLogger:
    """Times the log interval and writes the line (stdout) and the JSONL record (run_dir)."""

    def __init__(self, *, model: ModelConfig, padded_vocab: int, world_size: int, train_iters: int,
                 global_batch_size: int, phase: str, log_interval: int, enabled: bool,
                 run_dir: Path | None, out: TextIO):
        self.flops_token = flops_per_token(model, padded_vocab=padded_vocab)
        self.tokens_per_step = global_batch_size * model.seq_length
        self.world_size, self.train_iters, self.gbs = world_size, train_iters, global_batch_size
        self.phase, self.log_interval, self.enabled, self.out = phase, max(1, log_interval), enabled, out
        self.jsonl_path = run_dir / METRICS_FILE if run_dir is not None and enabled else None
        self.last_time = time.perf_counter()
        self.last_iteration = 0
        self.first_iteration: int | None = None
        self.tensorboard: TensorBoardWriter | None = None
        """Set by the loop on the last rank when train.tensorboard is on (train/tensorboard.py)."""

    def should_log(self, iteration: int) -> bool:
        """Every log_interval steps and at the last one. Same answer on every rank."""
        return iteration % self.log_interval == 0 or iteration == self.train_iters

    def reset_clock(self, iteration: int) -> None:
        if self.first_iteration is None:  # the step this process started from (0, or a restored one)
            self.first_iteration = iteration
        self.last_time, self.last_iteration = time.perf_counter(), iteration

    def log(self, iteration: int, *, lr: float, lm_loss: float, grad_norm: float,
            num_nan: int, num_skipped: int = 0, loss_scale: float = 1.0,
            applied_lr: float | None = None) -> IterationRecord:
        """Record the interval ending at `iteration`; the caller has synced the device."""
        now = time.perf_counter()
        steps = max(1, iteration - self.last_iteration)
        if self.first_iteration is None:  # never reset: the process started at step 0
            self.first_iteration = 0
        warmup = self.last_iteration < self.first_iteration + WARMUP_STEPS
        elapsed_s = (now - self.last_time) / steps
        self.reset_clock(iteration)
        rec = IterationRecord(
            iteration=iteration, train_iters=self.train_iters, consumed_samples=iteration * self.gbs,
            elapsed_ms=elapsed_s * 1000.0, lr=lr, global_batch_size=self.gbs, lm_loss=lm_loss,
            grad_norm=grad_norm, num_skipped_iterations=num_skipped,
            tokens_per_s=self.tokens_per_step / elapsed_s if elapsed_s > 0 else math.inf,
            tflops_per_worker=self.flops_token * self.tokens_per_step / (elapsed_s * 1e12 * self.world_size)
            if elapsed_s > 0 else 0.0,
            num_nan_iterations=num_nan, phase=self.phase, loss_scale=loss_scale, warmup=warmup,
            applied_lr=applied_lr)
        if self.enabled:
            print(format_iteration_line(rec, now=datetime.now()), file=self.out, flush=True)
            self._append_jsonl(rec.jsonl())
            if self.tensorboard is not None:
                self.tensorboard.iteration(rec)
        return rec

    def exclude_time(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation) out of the current interval, as Megatron stops interval-time."""
        self.last_time += seconds

    def log_validation(self, iteration: int, *, lm_loss: float, split: str = "valid") -> float:
        """Print Megatron's validation block, append a row of phase `split` (valid or test); returns the
        perplexity."""
        ppl = capped_ppl(lm_loss)
        if self.enabled:
            print(format_validation_block(iteration, lm_loss=lm_loss, split=split), file=self.out, flush=True)
            self._append_jsonl(ValidationRecord(iteration=iteration, consumed_samples=iteration * self.gbs,
                                                lm_loss=lm_loss, lm_loss_ppl=ppl, train_phase=self.phase,
                                                phase=split).jsonl())
            if self.tensorboard is not None:
                self.tensorboard.validation(iteration, consumed_samples=iteration * self.gbs, lm_loss=lm_loss,
                                            ppl=ppl, split=split)
        return ppl

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def _append_jsonl(self, row: str) -> None:
        if self.jsonl_path is not None:
            append_line(self.jsonl_path, row)
