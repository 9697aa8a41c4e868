"""Checkpointer: the trainer's one object for checkpoints (`ckpt.restore(...)`, `ckpt.maybe_save(...)`).

The saved state dict follows the reference Megatron's keys where they exist (neuron-xla.md 1.3):
flat args, checkpoint_version 3.0, iteration, model, optimizer, lr_scheduler and the RNG keys.
Ours: rng_state (one entry per DP rank, Megatron HEAD's key), xla_rng_state, resolved_config, data_position and
precision (what the weights really hold: under XLA_USE_BF16 the files say float32 but the values are bf16).
Unlike the reference, consumed_train_samples is read back (its bug (a)).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from megatron_hpc.checkpoint.loader import find_checkpoint, load_checkpoint
from megatron_hpc.checkpoint.paths import iteration_dir
from megatron_hpc.checkpoint.ranks import RankInfo
from megatron_hpc.checkpoint.saver import save_checkpoint
from megatron_hpc.checkpoint.state import ResumeState
from megatron_hpc.config.loader import config_to_dict
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.train.precision import DynamicGradScaler

CHECKPOINT_VERSION = 3.0


def build_state_dict(cfg: RunConfig, *, model: nn.Module, optimizer: torch.optim.Optimizer, resume: ResumeState,
                     padded_vocab: int, rng_per_dp_rank: list[dict[str, Any]],
                     scaler: DynamicGradScaler | None = None, lr_steps: int | None = None,
                     float_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One TP rank's checkpoint content; model tensors are state_dict() tensors, never Parameters.

    lr_steps counts the optimizer steps that were applied (skipped fp16-overflow steps excluded);
    None means every step was. Megatron's lr_scheduler.num_steps counts samples, so it is stored as
    lr_steps * global batch size, with our own successful_steps beside it. float_dtype is what the device held
    float32 tensors as (DeviceInfo.float_dtype).
    """
    successful = resume.step if lr_steps is None else lr_steps
    m = cfg.model
    extra = {} if scaler is None else {"grad_scaler": scaler.state_dict()}  # Megatron keeps it for fp16
    return {
        **extra,
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "num_attention_heads": m.num_attention_heads,
        "tensor_model_parallel_size": cfg.parallel.tensor, "pipeline_model_parallel_size": 1,
        "consumed_train_samples": resume.consumed_samples, "consumed_valid_samples": 0,
        "max_position_embeddings": m.max_position_embeddings,
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by, "padded_vocab_size": padded_vocab,
        "tokenizer_type": cfg.data.tokenizer_type,
        "checkpoint_version": CHECKPOINT_VERSION, "iteration": resume.step,
        "model": dict(model.state_dict()),
        "optimizer": optimizer.state_dict(),
        # The LR is a pure function of the successful steps (train/lr.py): their count and the config suffice.
        "lr_scheduler": {"num_steps": successful * cfg.train.global_batch_size, "successful_steps": successful,
                         "train_iters": cfg.train.num_steps,
                         "optim": config_to_dict(cfg.optim)},
        **resume.rng_dict(),
        "rng_state": rng_per_dp_rank,
        "resolved_config": config_to_dict(cfg),
        "data_position": {"step": resume.step, "consumed_samples": resume.consumed_samples,
                          "global_batch_size": cfg.train.global_batch_size, "seed": cfg.train.seed},
        "precision": {"train_precision": cfg.train.precision,
                      "weights_hold": str(float_dtype).removeprefix("torch.")},
    }


class Checkpointer:
    """Saves every checkpoint.save_interval steps and at the end of the run phase; restores at start.

    Nothing is saved or loaded in the compile phase or when NEURON_EXTRACT_GRAPHS_ONLY is set (a
    neuron_parallel_compile trial returns zeros). The save folder is checkpoint.save, else
    <run_dir>/checkpoints; with neither, nothing is saved.
    """

    def __init__(self, cfg: RunConfig, ctx: ParallelContext, *, device: DeviceInfo, phase: str,
                 run_dir: Path | None, padded_vocab: int, out: TextIO | None = None,
                 scaler: DynamicGradScaler | None = None):
        self.cfg, self.ctx, self.device, self.padded_vocab = cfg, ctx, device, padded_vocab
        self.scaler = scaler
        """fp16's loss scaler: saved and restored with the rest, so a resumed run does not re-probe the scale."""
        self.out = sys.stdout if out is None else out
        self.ranks = RankInfo.of(ctx, device=device.device)
        ccfg = cfg.checkpoint
        active = phase == "run" and not os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY")
        save = ccfg.save or (str(run_dir / "checkpoints") if run_dir is not None else None)
        self.save_root = Path(save).expanduser() if active and save else None
        load = ccfg.load or save
        self.load_root = Path(load).expanduser() if active and load else None
        self.last_saved = -1
        self.lr_steps: int | None = None
        """Applied (not skipped) optimizer steps, which drive the LR schedule: restore() sets it from the
        checkpoint, the loop advances it, saves record it. None before restore()."""
        self.promised = False
        """has_checkpoint() said a checkpoint will be loaded (and the model skipped its initialisation)."""

    def _print(self, message: str) -> None:
        if self.ctx.is_first_rank:
            print(message, file=self.out, flush=True)

    def has_checkpoint(self) -> bool:
        """Whether restore() will load one (every rank reads the same tracker on the shared filesystem)."""
        self.promised = self.load_root is not None and find_checkpoint(self.load_root, quiet=True) is not None
        return self.promised

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Load the newest complete checkpoint into model, optimizer and RNG; returns the step to start at.

        The model was built without its random initialisation when has_checkpoint() said so; a
        checkpoint that cannot be loaded then is an error, never a silent fresh start.
        """
        self.lr_steps = 0
        if self.load_root is None:
            return 0
        workers = self.cfg.checkpoint.io_workers_per_node
        loaded = load_checkpoint(self.load_root, ranks=self.ranks, io_workers_per_node=workers)
        if loaded is None:
            if self.promised:  # the weights were never initialised: training on them would be garbage
                raise CheckpointError(f"the checkpoint found in {self.load_root} at start-up disappeared before it "
                                      "was loaded; check that nothing else writes there, and resubmit")
            return 0
        found, state = loaded
        where = found.folder
        try:
            saved_gbs = state["data_position"]["global_batch_size"]
            if saved_gbs != self.cfg.train.global_batch_size:
                raise CheckpointError(f"{where} was trained with global_batch_size {saved_gbs}, this run has "
                                      f"{self.cfg.train.global_batch_size}; the data order depends on it, so "
                                      f"keep train.global_batch_size={saved_gbs}")
            model.load_state_dict(state["model"])
            if "optimizer" in state:
                optimizer.load_state_dict(state["optimizer"])
            else:  # `ckpt reshard` could not move it
                self._print(f"megatron-hpc: warning: {where} has no optimizer state; Adam's moments start at zero")
            if self.scaler is not None and "grad_scaler" in state:
                self.scaler.load_state_dict(state["grad_scaler"])
            rng = state["rng_state"]
            mine = rng[self.ctx.dp_rank] if self.ctx.dp_rank < len(rng) else rng[0]
            resume = ResumeState.from_rng_dict(mine, step=state["iteration"],
                                               consumed_samples=state["consumed_train_samples"])
            # Checkpoints from before the count was kept (and foreign ones) had no skipped steps recorded.
            lr_steps = int(state.get("lr_scheduler", {}).get("successful_steps", resume.step))
        except (KeyError, IndexError, TypeError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{where} does not fit this model or optimizer ({type(exc).__name__}: "
                                  f"{str(exc)[:300]}); check model.* against its resolved_config") from None
        resume.restore_rng(self.device)
        self.lr_steps = lr_steps
        self.last_saved = resume.step
        self._print(f"> loaded checkpoint {where} at iteration {resume.step} "
                    f"({resume.consumed_samples} samples consumed)")
        return resume.step

    def _rng_per_dp_rank(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        if self.ctx.dp_size == 1 or self.device.kind == "xla":
            # TODO(ckpt): no object all-gather on XLA: DP ranks > 0 resume with DP rank 0's CPU and XLA states, so
            # their dropout masks coincide after a resume (gather the XLA seeds as a device tensor instead).
            return [mine]
        gathered: list[Any] = [None] * self.ctx.dp_size
        dist.all_gather_object(gathered, mine, group=self.ctx.dp_group)
        return gathered

    def maybe_save(self, iteration: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                   num_steps: int) -> bool:
        """Save when iteration is a multiple of save_interval or the last one; True when saved."""
        if not self.save_due(iteration, num_steps=num_steps):
            return False
        return self.save_now(iteration, model=model, optimizer=optimizer) is not None

    def save_due(self, iteration: int, *, num_steps: int) -> bool:
        """Whether maybe_save(iteration) saves."""
        ccfg = self.cfg.checkpoint
        return self.save_root is not None and (
            (ccfg.save_interval > 0 and iteration % ccfg.save_interval == 0) or iteration == num_steps)

    def save_now(self, iteration: int, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
        """Save this iteration (collective); the checkpoint folder, or None when there is nowhere to save
        or the save failed with on_save_failure=continue. Saving an iteration already saved is a no-op."""
        ccfg = self.cfg.checkpoint
        if self.save_root is None:
            return None
        if iteration == self.last_saved:
            return str(iteration_dir(self.save_root, iteration))
        resume = ResumeState.capture(step=iteration, consumed_samples=iteration * self.cfg.train.global_batch_size,
                                     device=self.device)
        state = build_state_dict(self.cfg, model=model, optimizer=optimizer, resume=resume,
                                 padded_vocab=self.padded_vocab,
                                 rng_per_dp_rank=self._rng_per_dp_rank(resume.rng_dict()), scaler=self.scaler,
                                 lr_steps=self.lr_steps, float_dtype=self.device.float_dtype)
        try:
            folder = save_checkpoint(self.save_root, iteration, state, ranks=self.ranks, fmt=ccfg.format,
                                     io_workers_per_node=ccfg.io_workers_per_node, keep_last=ccfg.keep_last)
        except CheckpointError as exc:
            if ccfg.on_save_failure != "continue":
                raise
            if self.ctx.is_first_rank:
                print(f"megatron-hpc: warning: {exc}; training continues (checkpoint.on_save_failure=continue)",
                      file=sys.stderr, flush=True)
            return None
        self.last_saved = iteration
        self._print(f"> saved checkpoint {folder} at iteration {iteration}")
        return str(folder)
