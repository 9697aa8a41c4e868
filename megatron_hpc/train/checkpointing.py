"""Checkpointer: the trainer's one object for checkpoints (`ckpt.restore(...)`, `ckpt.maybe_save(...)`).

A thin facade: it turns the loop's TrainState, model and optimizer into the state dict of
checkpoint/store/contents.py and hands it to the pure checkpoint I/O (checkpoint/store/saver.py, loader.py), and back.
Whether checkpoints are active at all (not in a compile trial) is decided by the caller.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from megatron_hpc.checkpoint.conversion import for_model, with_masters
from megatron_hpc.checkpoint.store import (
    AsyncSave,
    PipelineLayout,
    Progress,
    RankInfo,
    Snapshot,
    build_state_dict,
    find_checkpoint,
    iteration_dir,
    load_checkpoint,
    read_progress,
    read_rng,
    save_checkpoint,
    saved_global_batch,
)
from megatron_hpc.config.schema import CheckpointConfig
from megatron_hpc.errors import CheckpointError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import DeviceInfo
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.run_folder import CHECKPOINT_DIR
from megatron_hpc.train.optimizer import CheckpointedOptimizer
from megatron_hpc.train.state import RngState, TrainState


def checkpoint_roots(ckpt: CheckpointConfig, *, run_dir: Path | None, active: bool) -> tuple[Path | None, Path | None]:
    """(save folder, load folder): checkpoint.save, else <run_dir>/checkpoints; load defaults to the save folder.

    Both are None when checkpoints are not active (a compile trial) or there is nowhere to save.
    """
    if not active:
        return None, None
    save = ckpt.save or (str(run_dir / CHECKPOINT_DIR) if run_dir is not None else None)
    load = ckpt.load or save
    return (Path(save).expanduser() if save else None), (Path(load).expanduser() if load else None)


class Checkpointer:
    """Saves every checkpoint.save_interval steps and at the end of the run; restores at start."""

    def __init__(self, spec: RunSpec, ctx: ParallelContext, *, device: DeviceInfo, save_root: Path | None,
                 load_root: Path | None, out: TextIO | None = None):
        self.ckpt: CheckpointConfig = spec.config.checkpoint
        self.ctx, self.device = ctx, device
        self.config_json: dict[str, Any] = dataclasses.asdict(spec.config)
        self.plan_json: dict[str, Any] = spec.plan.to_json()
        self.global_batch_size = spec.plan.global_batch_size
        self.precision = spec.config.train.precision
        self.out = sys.stdout if out is None else out
        self.ranks = RankInfo.of(ctx, device=device.device)
        # Which layers this pipeline rank's file holds: recorded at save, checked at load (checkpoint/store/compat.py).
        self.layout = PipelineLayout.of_run(plan=self.plan_json, config=self.config_json)
        self.save_root, self.load_root = save_root, load_root
        self.source: Path | None = None
        """Where restore() loads from: checkpoint.load, or this run's own save folder once it saved there."""
        self.own = True
        """Whether `source` is this run's own checkpoint (resumed fully), not checkpoint.load's (whose finetune,
        load_optim and load_rng apply)."""
        self.last_saved = -1
        self.pending: AsyncSave | None = None
        """The asynchronous save whose files are being written (checkpoint.async_save)."""
        self.host_memory: Snapshot | None = None
        """The last finished asynchronous save's host copy, reused by the next (no fresh pages to fault in)."""
        self.steps_while_writing: dict[int, int] = {}
        """Asynchronous saves: iteration -> training steps completed by the time this rank's writer finished, or -1
        when it finished before save_now() even returned to the loop (nothing overlapped)."""
        self._hooked: set[int] = set()
        """ids of the optimizers whose step waits for an asynchronous save's host copy."""
        self._returned = -1
        """The iteration of the last asynchronous save whose save_now() returned to the loop."""
        self.promised = False
        """has_checkpoint() said a checkpoint will be loaded (and the model skipped its initialisation)."""

    def _print(self, message: str) -> None:
        if self.ctx.is_first_rank:
            print(message, file=self.out, flush=True)

    def _choose(self) -> Path | None:
        """checkpoint.load, unless this run already saved into a different save folder: then its own checkpoint."""
        separate = (self.save_root is not None and self.load_root is not None
                    and self.save_root.resolve() != self.load_root.resolve())
        if separate and find_checkpoint(self.save_root, quiet=True) is not None:
            self.source, self.own = self.save_root, True
        else:
            self.source, self.own = self.load_root, not separate
        return self.source

    def has_checkpoint(self) -> bool:
        """Whether restore() will load one (every rank reads the same tracker on the shared filesystem)."""
        source = self._choose()
        self.promised = source is not None and find_checkpoint(source, quiet=True) is not None
        return self.promised

    def restore(self, model: nn.Module, optimizer: CheckpointedOptimizer, state: TrainState) -> TrainState:
        """Load the newest complete checkpoint into model, optimizer, RNG and `state`; `state` as it was without one.

        The model was built without its random initialisation when has_checkpoint() said so; a
        checkpoint that cannot be loaded then is an error, never a silent fresh start. A checkpoint from
        checkpoint.load follows checkpoint.finetune, load_optim and load_rng; the run's own is resumed fully.
        """
        source = self.source if self.source is not None else self._choose()
        if source is None:
            return state
        # The weights are read straight into the model's own CPU tensors (no second copy of them in fresh memory);
        # load_state_dict below then finds them in place and copies nothing. A checkpoint that does not fit is
        # refused before the first weight is written; a damaged one after some were, and this run aborts on it.
        loaded = load_checkpoint(source, ranks=self.ranks, io_workers_per_node=self.ckpt.io_workers_per_node,
                                 layout=self.layout, into={"model": model.state_dict()})
        if loaded is None:
            if self.promised:  # the weights were never initialised: training on them would be garbage
                raise CheckpointError(f"the checkpoint found in {source} at start-up disappeared before it "
                                      "was loaded; check that nothing else writes there, and resubmit")
            if self.ckpt.finetune and not self.own:  # a fine-tune of random weights is never what was meant
                raise CheckpointError(f"checkpoint.load={source} holds no complete checkpoint to fine-tune from "
                                      f"({Path(source).absolute()}), so the run would train from random weights; "
                                      "pass the folder `ckpt convert` or a run wrote, as an absolute path")
            return state
        found, saved = loaded
        finetune = self.ckpt.finetune and not self.own
        load_optim = self.own or (self.ckpt.load_optim and not finetune)
        load_rng = self.own or (self.ckpt.load_rng and not finetune)
        where = found.folder
        saved_gbs = saved_global_batch(saved)
        if not finetune and saved_gbs is not None and saved_gbs != self.global_batch_size:
            raise CheckpointError(f"{where} was trained with global_batch_size {saved_gbs}, this run has "
                                  f"{self.global_batch_size}; the data order depends on it, so keep "
                                  f"train.global_batch_size={saved_gbs}, or set checkpoint.finetune=true to start "
                                  "from its weights at iteration 0")
        progress = Progress(iteration=0, consumed_samples=0, lr_steps=0) if finetune else read_progress(saved,
                                                                                                       where=where)
        rng = self._saved_rng(saved, where=where) if load_rng else None
        try:
            model.load_state_dict(saved["model"])
            if load_optim:
                self._load_optimizer(optimizer, saved, model=model, where=where)
            if load_optim and state.scaler is not None and "grad_scaler" in saved:
                state.scaler.load_state_dict(saved["grad_scaler"])
        except (KeyError, IndexError, TypeError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{where} does not fit this model or optimizer ({type(exc).__name__}: "
                                  f"{str(exc)[:300]}); check model.* against its resolved_config") from None
        if rng is not None:
            rng.restore(self.device)
        self.last_saved = progress.iteration
        self._print(f"> loaded checkpoint {where} at iteration {found.iteration} " + (
            "(weights only, starting at iteration 0: checkpoint.finetune)" if finetune else
            f"({progress.consumed_samples} samples consumed"
            + ("" if load_optim else ", optimizer afresh: checkpoint.load_optim=false")
            + ("" if load_rng else ", RNG from train.seed: checkpoint.load_rng=false") + ")"))
        return TrainState(step=progress.iteration, consumed_samples=progress.consumed_samples,
                          lr_steps=progress.lr_steps, scaler=state.scaler, rng=rng)

    def _load_optimizer(self, optimizer: CheckpointedOptimizer, saved: dict[str, Any], *, model: nn.Module,
                        where: Path) -> None:
        """Adam's state by parameter name (a resharded checkpoint lists a stage's weights in the PP=1 model's
        order), into `optimizer` (plain layout: train/optimizer.py)."""
        if "optimizer" not in saved:  # `ckpt reshard` or `ckpt convert` could not move it
            self._print(f"megatron-hpc: warning: {where} has no optimizer state; Adam's moments start at zero")
            return
        live = model.state_dict()
        optim_state = for_model(saved["optimizer"], saved_model=saved["model"], live_model=live)
        master_key = getattr(optimizer, "master_key", None)
        if master_key is not None:  # fp32 weights of a converted checkpoint are the run's masters
            optim_state = with_masters(optim_state, model={n: saved["model"][n] for n in live}, key=master_key)
        optimizer.load_state_dict(optim_state)

    def _saved_rng(self, saved: dict[str, Any], *, where: Path) -> RngState | None:
        """This DP rank's RNG states; None, with a warning, for a converted checkpoint whose source kept none."""
        if "converted_from" in saved and "torch_rng_state" not in saved and not saved.get("rng_state"):
            self._print(f"megatron-hpc: warning: {where} holds no RNG state (its source saved none); the random "
                        "generators keep their train.seed seeding")
            return None
        return RngState.from_megatron(read_rng(saved, dp_rank=self.ctx.dp_rank, where=where), where=where)

    def _rng_per_dp_rank(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        if self.ctx.dp_size == 1 or self.device.kind == "xla":
            # TODO(ckpt): no object all-gather on XLA: DP ranks > 0 resume with DP rank 0's CPU and XLA states, so
            # their dropout masks coincide after a resume (gather the XLA seeds as a device tensor instead).
            return [mine]
        gathered: list[Any] = [None] * self.ctx.dp_size
        dist.all_gather_object(gathered, mine, group=self.ctx.dp_group)
        return gathered

    def maybe_save(self, state: TrainState, *, model: nn.Module, optimizer: CheckpointedOptimizer,
                   num_steps: int) -> bool:
        """Save when the step is a multiple of save_interval or the last one; True when saved."""
        if not self.save_due(state.step, num_steps=num_steps):
            return False
        return self.save_now(state, model=model, optimizer=optimizer) is not None

    def save_due(self, step: int, *, num_steps: int) -> bool:
        """Whether maybe_save saves after `step`."""
        interval = self.ckpt.save_interval
        return self.save_root is not None and ((interval > 0 and step % interval == 0) or step == num_steps)

    def save_now(self, state: TrainState, *, model: nn.Module, optimizer: CheckpointedOptimizer,
                 wait: bool = False) -> str | None:
        """Save this step (collective); the checkpoint folder, or None when there is nowhere to save or the
        save failed with on_save_failure=continue. Saving a step already saved is a no-op.

        With checkpoint.async_save the files are written in the background and the folder is complete only after
        wait_for_save() (the next save, a stop and the end of the run call it; `wait` calls it here)."""
        if self.save_root is None:
            return None
        if self.pending is not None and self.pending.iteration == state.step:
            return self.wait_for_save() if wait else str(iteration_dir(self.save_root, state.step))
        if state.step == self.last_saved:
            return str(iteration_dir(self.save_root, state.step))
        self.wait_for_save()  # the previous asynchronous save, complete before the next one starts
        content = self._content(state, model=model, optimizer=optimizer)
        if self.ckpt.async_save:
            self._start_async(state, content, optimizer=optimizer)
            return self.wait_for_save() if wait else str(iteration_dir(self.save_root, state.step))
        try:
            folder = save_checkpoint(self.save_root, state.step, content, ranks=self.ranks, fmt=self.ckpt.format,
                                     io_workers_per_node=self.ckpt.io_workers_per_node, keep_last=self.ckpt.keep_last,
                                     layout=self.layout)
        except CheckpointError as exc:
            return self._failed(exc)
        self.last_saved = state.step
        self._print(f"> saved checkpoint {folder} at iteration {state.step}")
        return str(folder)

    def _content(self, state: TrainState, *, model: nn.Module, optimizer: CheckpointedOptimizer) -> dict[str, Any]:
        rng = RngState.capture(self.device).to_megatron()
        return build_state_dict(
            config=self.config_json, plan=self.plan_json, model=dict(model.state_dict()),
            optimizer=optimizer.state_dict(),
            progress=Progress(iteration=state.step, consumed_samples=state.consumed_samples, lr_steps=state.lr_steps),
            rng_per_dp_rank=self._rng_per_dp_rank(rng),
            grad_scaler=state.scaler.state_dict() if state.scaler is not None else None,
            precision={"train_precision": self.precision, "weights_hold": str(_weights_hold(model, self.device))
                       .removeprefix("torch.")})

    def _failed(self, exc: CheckpointError) -> None:
        if self.ckpt.on_save_failure != "continue":
            raise exc
        if self.ctx.is_first_rank:
            print(f"megatron-hpc: warning: {exc}; training continues (checkpoint.on_save_failure=continue)",
                  file=sys.stderr, flush=True)
        return None

    def _start_async(self, state: TrainState, content: dict[str, Any], *, optimizer: CheckpointedOptimizer) -> None:
        assert self.save_root is not None
        iteration = state.step
        # Off XLA the host copy is made by the writer thread while the next step's forward and backward run (they
        # only read the weights and moments); the optimizer step, the first write to them, waits for it. On XLA a
        # second thread must not run device transfers beside the tracing main thread: the copy is made here.
        in_background = self.device.kind != "xla"
        if in_background and id(optimizer) not in self._hooked:
            optimizer.register_step_pre_hook(lambda *_: self._before_update())
            self._hooked.add(id(optimizer))

        def written() -> None:  # on the writer thread: how far training got meanwhile (state is the loop's own)
            self.steps_while_writing[iteration] = state.step - iteration if self._returned == iteration else -1

        try:
            self.pending = AsyncSave(self.save_root, iteration, content, ranks=self.ranks, fmt=self.ckpt.format,
                                     keep_last=self.ckpt.keep_last, layout=self.layout, on_written=written,
                                     reuse=self.host_memory, copy_in_background=in_background)
        except CheckpointError as exc:
            self._failed(exc)
            return
        self._print(f"> saving checkpoint {iteration} in the background")
        self._returned = iteration  # from here on the loop trains while the writer writes

    def _before_update(self) -> None:
        """The optimizer is about to change the weights and moments: the save in flight must have copied them."""
        if self.pending is not None:
            self.pending.wait_copied()

    def wait_for_save(self) -> str | None:
        """Complete the asynchronous save in flight, if any (collective: every rank calls it at the same step).
        Its folder, or None when there was none or it failed with on_save_failure=continue."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            folder = pending.finish()
        except CheckpointError as exc:
            return self._failed(exc)
        finally:
            self.host_memory = pending.host
        self.last_saved = pending.iteration
        meanwhile = self.steps_while_writing.get(pending.iteration, -1)
        overlap = f"{meanwhile} step(s) completed meanwhile" if meanwhile >= 0 else "done before training resumed"
        self._print(f"> saved checkpoint {folder} at iteration {pending.iteration} (written in the background, "
                    f"{overlap})")
        return str(folder)

    def abandon_save(self) -> None:
        """On an error path, where other ranks may never reach wait_for_save(): let this rank's writer finish its
        files (no collective) and leave them uncommitted. The tracker keeps naming the previous checkpoint; the
        next save removes the temp folder."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait_local()
            if self.ctx.is_first_rank:
                print(f"megatron-hpc: warning: checkpoint {pending.iteration} was not completed (the run failed "
                      "while it was written); the previous checkpoint is the newest", file=sys.stderr, flush=True)


def _weights_hold(model: nn.Module, device: DeviceInfo) -> torch.dtype:
    """What the weights' values are: their own dtype when it is not float32 (bf16 weights beside fp32 masters,
    train/xla_zero.py), else what the device holds a float32 as (bfloat16 under XLA_USE_BF16)."""
    dtype = next(model.parameters()).dtype
    return dtype if dtype != torch.float32 else device.float_dtype
