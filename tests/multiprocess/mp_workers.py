"""Worker functions for the multiprocess tests: run in separate processes over gloo on the CPU.

Each worker writes its results with torch.save to <out_dir>/rank<r>.pt; the test process loads
and compares them, so assertion messages show the numbers.

The processes come from a fork server (multiprocessing's `forkserver` start method): one clean process that
imports torch, torch.distributed and the trainer's modules once (FORKSERVER_PRELOAD) and forks a worker per
rank. Each worker is still a new process with its own interpreter state and its own process group, started
from that clean state, never from the test process's; what it saves from the import of torch and our modules
(about 2-3 s of CPU a process on this 2-core machine) was most of a spawn's cost.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_hpc.config.schema import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig


def tiny_config(*, tp: int = 1, micro_batch_size: int = 2, global_batch_size: int = 8,
                num_steps: int = 20) -> RunConfig:
    return RunConfig(
        name="tiny",
        model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                          max_position_embeddings=32, vocab_size=500),
        train=TrainConfig(num_steps=num_steps, micro_batch_size=micro_batch_size,
                          global_batch_size=global_batch_size, log_interval=1),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, lr_warmup_iters=2),
        parallel=ParallelConfig(tensor=tp),
    )


def model_for(cfg: RunConfig, ctx: Any) -> Any:
    """The trainer's model for `cfg` at ctx's TP size (the padded vocabulary from the planner's one function)."""
    from megatron_hpc.plan.vocab import padded_vocab_size
    from megatron_hpc.train.loop import build_model

    padded = padded_vocab_size(cfg.model.vocab_size, divisible_by=cfg.model.make_vocab_size_divisible_by,
                               tensor_parallel=ctx.tp_size)
    return build_model(cfg.model, ctx, padded_vocab=padded, seed=cfg.train.seed, device=torch.device("cpu"))


def free_ports(n: int) -> list[int]:
    """n distinct ports free now, from below the kernel's ephemeral range: a spawn uses its ports one run after
    another, and gloo's own listeners (kernel-assigned, ephemeral) of an earlier run must not take a later run's."""
    import random

    low, _ = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


FORKSERVER_PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.pipelining", "pytest",
                      "megatron_hpc.train.entry", "megatron_hpc.evaluate.scoring", "megatron_hpc.evaluate.pipelined",
                      "megatron_hpc.generate.engine", "megatron_hpc.checkpoint.conversion"]
"""What the fork server imports once for every worker (only imports: it runs no torch op, so it starts no thread
pool that a fork could copy half-held). The test modules themselves load in each worker, from its sys.path."""

# The fork server skips a name it cannot import without a word: a module renamed would quietly cost every worker
# its import again, so a missing one fails here.
assert all(importlib.util.find_spec(name) for name in FORKSERVER_PRELOAD), (
    f"FORKSERVER_PRELOAD names a module that does not exist: "
    f"{[name for name in FORKSERVER_PRELOAD if not importlib.util.find_spec(name)]}")
mp.set_forkserver_preload(FORKSERVER_PRELOAD)


def _entry(rank: int, world: int, ports: list[int], fn: Callable[..., Any], args: tuple, out_dir: str,
           environ: dict[str, str]) -> None:
    # The fork server's environment is the test process's when the server started (an earlier test's): take the
    # test process's of now, as a spawned process would (each test's own compile cache folder, for one).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    result = fn(rank, world, ports, *args)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def spawn(fn: Callable[..., Any], *, world: int, out_dir: Path, args: tuple = (), num_ports: int = 1) -> list[Any]:
    """Run fn(rank, world, ports, *args) in `world` new processes (from the fork server); return each rank's
    result."""
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_entry, args=(world, free_ports(num_ports), fn, args, str(out_dir), dict(os.environ)),
                       nprocs=world, join=True, start_method="forkserver")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ---------------------------------------------------------------------------------------------
# Workers


def metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, one per logged iteration."""
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_runs(rank: int, world: int, ports: list[int], configs: list[RunConfig], run_root: str) -> None:
    """run_training once per config (a fresh process group each, on its own port)."""
    from megatron_hpc.train.entry import plan_for_torchrun, run_training

    for i, cfg in enumerate(configs):
        os.environ["MASTER_PORT"] = str(ports[i])
        assert run_training(plan_for_torchrun(cfg), run_dir=Path(run_root) / f"run{i}") == 0


def cli_runs(rank: int, world: int, ports: list[int], commands: list[list[str]]) -> list[tuple[int, str, str]]:
    """Each command through the CLI's main() on every rank, as torchrun starts it (_entry set RANK, WORLD_SIZE and
    MASTER_ADDR; each command its own MASTER_PORT, as it joins and leaves its own process group): (exit status,
    stdout, stderr) of each, without torchrun's new interpreters."""
    import contextlib
    import io

    from megatron_hpc.cli.main import main

    out = []
    for port, args in zip(ports, commands):
        os.environ["MASTER_PORT"] = str(port)
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(args)
        out.append((code, stdout.getvalue(), stderr.getvalue()))
    return out


def gathered_tp_logits(ctx: Any, ckpt: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of our GPT loaded from this TP rank's shard of `ckpt` (the model config its resolved one), gathered over
    the TP group and cut to the real vocabulary: what every rank of an imported checkpoint computes together."""
    from megatron_hpc.checkpoint.conversion import locate
    from megatron_hpc.checkpoint.store import read_shard
    from megatron_hpc.config.loader import from_dict
    from megatron_hpc.model.gpt import GPT

    state = read_shard(locate(Path(ckpt)), tp_rank=ctx.tp_rank)
    cfg = from_dict(ModelConfig, state["resolved_config"]["model"], where="model")
    model = GPT(cfg, ctx=ctx, padded_vocab=state["padded_vocab_size"], seed=1)
    model.load_state_dict(state["model"])
    with torch.no_grad():
        local = model.eval()(tokens)
    parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=-1)[..., :cfg.vocab_size]


def _init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")


def _full_param(param: torch.Tensor, ref_shape: torch.Size, group: dist.ProcessGroup) -> torch.Tensor:
    """Gather a TP shard along the dim where its shape differs from the dense reference."""
    if param.shape == ref_shape:
        return param.detach()
    dim = next(d for d in range(param.ndim) if param.shape[d] != ref_shape[d])
    parts = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def tp_layers(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    """TP=2 against a TP=1 model built in the same processes: weights, logits, loss, grads."""
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy
    from megatron_hpc.parallel.mappings import gather_from_tp_region
    from megatron_hpc.plan.mesh import Mesh
    _init(rank, world, ports[0])
    cfg = tiny_config(tp=2)
    ctx2 = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=2, tensor_parallel=2), rank=rank)
    ctx1 = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=2, tensor_parallel=1), rank=rank)
    model2, model1 = model_for(cfg, ctx2), model_for(cfg, ctx1)
    padded2, padded1 = model2.wte.per_rank * ctx2.tp_size, model1.wte.per_rank * ctx1.tp_size
    ref = dict(model1.named_parameters())
    weights = {name: (_full_param(p, ref[name].shape, ctx2.tp_group), ref[name].detach())
               for name, p in model2.named_parameters()}

    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=gen)  # all of the vocab, both shards
    logits2 = model2(ids[:, :-1])
    logits1 = model1(ids[:, :-1])
    loss2 = vocab_parallel_cross_entropy(logits2, ids[:, 1:], group=ctx2.tp_group).mean()
    loss1 = vocab_parallel_cross_entropy(logits1, ids[:, 1:], group=ctx1.tp_group).mean()
    loss2.backward()
    loss1.backward()
    grads = {name: (_full_param(p.grad, ref[name].shape, ctx2.tp_group), ref[name].grad)
             for name, p in model2.named_parameters()}
    result = {"padded": (padded2, padded1), "weights": weights, "grads": grads,
              "logits": (gather_from_tp_region(logits2, ctx2.tp_group).detach(), logits1.detach()),
              "loss": (loss2.item(), loss1.item())}
    dist.destroy_process_group()
    return result


def cross_entropy(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    """vocab_parallel_cross_entropy on each rank's shard against torch on the full logits."""
    from megatron_hpc.parallel.cross_entropy import vocab_parallel_cross_entropy

    _init(rank, world, ports[0])
    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(3, 5, 64, generator=gen) * 4.0  # large logits exercise the max shift
    target = torch.randint(0, 64, (3, 5), generator=gen)
    weight = torch.rand(3, 5, generator=gen)  # a non-uniform upstream gradient
    shard = full.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, group=group)
    (loss * weight).sum().backward()
    dense = full.clone().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(dense.reshape(-1, 64), target.reshape(-1), reduction="none")
    (ref.view(3, 5) * weight).sum().backward()
    result = {"loss": (loss.detach(), ref.detach().view(3, 5)),
              "grad": (shard.grad, dense.grad.chunk(world, dim=-1)[rank])}
    dist.destroy_process_group()
    return result


_DIMS = {"last": -1, "sequence": 1}
"""A mapping docstring's `dim:` as a tensor dim (the sequence is dim 1 of batch-first (B, S, H))."""


def _expected(op: str, per_rank: list[torch.Tensor], rank: int, *, dim: int) -> torch.Tensor:
    """What a docstring operation means, computed densely from every rank's tensor."""
    world = len(per_rank)
    if op == "identity":
        return per_rank[rank]
    if op == "all-reduce":
        return torch.stack(per_rank).sum(0)
    if op == "split":
        return per_rank[rank].chunk(world, dim=dim)[rank]
    if op == "all-gather":
        return torch.cat(per_rank, dim=dim)
    if op == "reduce-scatter":
        return torch.stack(per_rank).sum(0).chunk(world, dim=dim)[rank]
    raise ValueError(f"unknown docstring op {op!r}")


TP_MAPPINGS = ("copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region")
SEQUENCE_MAPPINGS = ("scatter_to_sequence_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region")


def mappings(rank: int, world: int, ports: list[int], names: tuple[str, ...] = TP_MAPPINGS) -> dict[str, Any]:
    """Each mapping's fwd and bwd against what its docstring says, over a group of `world`, on (B, S, H) tensors."""
    from megatron_hpc.parallel import mappings as mod

    _init(rank, world, ports[0])
    group = dist.new_group(list(range(world)))
    out: dict[str, Any] = {}
    for name in names:
        fn = getattr(mod, name)
        spec = dict(part.strip().split(": ") for part in inspect.getdoc(fn).split("|"))
        dim = _DIMS[spec["dim"]]
        inputs = [torch.randn(2, 4 * world, 2 * world, generator=torch.Generator().manual_seed(100 + r))
                  for r in range(world)]
        x = inputs[rank].clone().requires_grad_(True)
        y = fn(x, group)
        grads = [torch.randn(y.shape, generator=torch.Generator().manual_seed(200 + r)) for r in range(world)]
        y.backward(grads[rank])
        out[name] = {"fwd": (y.detach(), _expected(spec["fwd"], inputs, rank, dim=dim)),
                     "bwd": (x.grad, _expected(spec["bwd"], grads, rank, dim=dim)), "spec": spec}
    dist.destroy_process_group()
    return out


def pipeline_config(*, tp: int = 1, pp: int = 1, virtual: int = 1, schedule: str = "1f1b", first: int = 0,
                    last: int = 0, tied: bool = True, rope: bool = False) -> RunConfig:
    """tiny_config with 4 layers (2 stages x 2 virtual, or 4 stages) and the pipeline keys."""
    import dataclasses

    cfg = tiny_config(tp=tp)
    model = dataclasses.replace(cfg.model, num_layers=4, tie_embeddings=tied,
                                position_embedding="rope" if rope else "learned")
    parallel = dataclasses.replace(cfg.parallel, pipeline=pp, virtual_pipeline=virtual, pipeline_schedule=schedule,
                                   pipeline_first_stage_layers=first, pipeline_last_stage_layers=last)
    return dataclasses.replace(cfg, model=model, parallel=parallel)


def _break(fault: str) -> None:
    """Deliberate bugs a proof must catch, and code-path variants (applied in this worker process only)."""
    from megatron_hpc.parallel import pipeline
    from megatron_hpc.train import distributed_optimizer, optim

    if fault == "no_embedding_allreduce":
        pipeline.PipelineRunner.sync_embedding_grads = lambda self: None
    elif fault == "misordered_micro_batch":
        # The last stage takes its labels in another order than the first stage feeds the ids: micro-batch 0's
        # activations are scored against micro-batch 1's labels and the other way round.
        original = pipeline.PipelineRunner._run

        def misordered(self: Any, micro_batches: Any, *, train: bool) -> torch.Tensor:
            if self.last and not self.first:
                micro_batches = [micro_batches[1], micro_batches[0], *micro_batches[2:]]
            return original(self, micro_batches, train=train)

        pipeline.PipelineRunner._run = misordered
    elif fault == "no_sp_grad_allreduce":
        # The TP all-reduce of the sequence-parallel replicated params' grads (the plain optimizer's).
        optim.all_reduce_sequence_parallel_grads = lambda params, *, group: None
    elif fault == "no_param_allgather":
        # The distributed optimizer updates its slice but never gathers the others' slices: each DP rank's weights
        # outside its own slice stay as they were.
        distributed_optimizer.DistributedOptimizer.step = lambda self: self.optimizer.step()
    elif fault == "scatter_collectives":
        # Not a bug: the distributed optimizer's NCCL collectives (reduce-scatter, all-gather), run on gloo.
        distributed_optimizer.DistributedOptimizer.ALL_REDUCE_ON_GLOO = False
    elif fault in ("ungrouped_qkv", "swapped_gate"):
        _break_tp_split(fault)
    elif fault:
        raise ValueError(f"unknown fault {fault!r}")


def faulty_shard(fault: str, full: torch.Tensor, *, key: str, tp: int, rank: int) -> torch.Tensor | None:
    """Rank `rank`'s rows of the full column-parallel weight `full` as a sharder that ignores the layout would cut
    them (None: not the faulted weight), on tiny_config's 4 heads with LLAMA's groups. At TP 1 each is the whole
    weight in its own order, so only a split can go wrong. ungrouped_qkv: the rank's QKV rows are its contiguous
    share of [all queries; all keys; all values] (the order before grouping, Hugging Face's q/k/v_proj stacked), read
    as its nh/tp queries, G/tp keys and G/tp values, instead of its whole groups. swapped_gate: rank r holds the gate
    rows of rank tp-1-r, so its gate and up halves come from different hidden units."""
    if fault == "swapped_gate" and key.endswith(".mlp.gate"):
        return full.chunk(tp)[tp - 1 - rank]
    if fault != "ungrouped_qkv" or not key.endswith(".attn.qkv"):
        return None
    heads, groups, h = 4, LLAMA["num_query_groups"], full.shape[1]
    hd = h // heads
    assert full.shape[0] == (heads + 2 * groups) * hd, full.shape
    grouped = full.view(groups, heads // groups + 2, hd, h)  # Megatron's [G, (nh/G queries, key, value), hd, H]
    ungrouped = torch.cat([grouped[:, :-2].reshape(-1, h), grouped[:, -2].reshape(-1, h),
                           grouped[:, -1].reshape(-1, h)])
    q, k, v = ungrouped.chunk(tp)[rank].split([heads // tp * hd, groups // tp * hd, groups // tp * hd])
    per_rank = groups // tp
    return torch.cat([q.view(per_rank, -1, hd, h), k.view(per_rank, 1, hd, h), v.view(per_rank, 1, hd, h)],
                     dim=1).reshape(-1, h)


def _break_tp_split(fault: str) -> None:
    """Column-parallel layers built with faulty_shard's rows for `fault`."""
    from megatron_hpc.parallel import layers

    original = layers.ColumnParallelLinear.__init__

    def init(self: Any, in_features: int, out_features: int, *, ctx: Any, init_std: float, seed: int, key: str,
             **kwargs: Any) -> None:
        original(self, in_features, out_features, ctx=ctx, init_std=init_std, seed=seed, key=key, **kwargs)
        full = layers.seeded_normal((out_features, in_features), std=init_std, seed=seed, key=key)
        shard = faulty_shard(fault, full, key=key, tp=ctx.tp_size, rank=ctx.tp_rank)
        if shard is not None:
            with torch.no_grad():
                self.weight.copy_(shard)

    layers.ColumnParallelLinear.__init__ = init


def _breakable() -> list[tuple[Any, str]]:
    """(owner, attribute) of everything _break may replace."""
    from megatron_hpc.parallel import layers, pipeline
    from megatron_hpc.train import distributed_optimizer, optim

    return [(pipeline.PipelineRunner, "sync_embedding_grads"), (pipeline.PipelineRunner, "_run"),
            (optim, "all_reduce_sequence_parallel_grads"), (distributed_optimizer.DistributedOptimizer, "step"),
            (distributed_optimizer.DistributedOptimizer, "ALL_REDUCE_ON_GLOO"),
            (layers.ColumnParallelLinear, "__init__")]


def fault_runs(rank: int, world: int, ports: list[int], configs: list[RunConfig], faults: list[str],
               run_root: str) -> None:
    """run_training once per config, with `faults[i]` broken in run i ('' for none; see _break)."""
    sized_runs(rank, world, ports, [(world, cfg, f"run{i}", fault) for i, (cfg, fault) in enumerate(zip(configs,
                                                                                                          faults))],
               run_root)


def sized_runs(rank: int, world: int, ports: list[int], plan: list[tuple[Any, ...]], run_root: str) -> None:
    """run_training for each (world size, config, name[, fault]): entries of world 1 run on rank 0 alone (its own
    world), the others on every rank; a fault (see _break) is applied for its entry only."""
    from megatron_hpc.train.entry import plan_for_torchrun, run_training

    intact = [(owner, attr, getattr(owner, attr)) for owner, attr in _breakable()]
    for i, (size, cfg, name, *fault) in enumerate(plan):
        for owner, attr, value in intact:
            setattr(owner, attr, value)
        _break(fault[0] if fault else "")
        if size == 1:
            if rank == 0:
                env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
                assert run_training(plan_for_torchrun(cfg), run_dir=Path(run_root) / name) == 0
                os.environ.update(env)
            continue
        assert size == world, f"{name}: a world of {size} in a spawn of {world}"
        os.environ["MASTER_PORT"] = str(ports[i])
        assert run_training(plan_for_torchrun(cfg), run_dir=Path(run_root) / name) == 0


def sequence_parallel(cfg: RunConfig) -> RunConfig:
    """`cfg` with parallel.sequence_parallel on."""
    import dataclasses

    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True))


def neox(cfg: RunConfig, **model: Any) -> RunConfig:
    """`cfg` as GPT-NeoX / Pythia: parallel residual, rotary on a quarter of each head, untied output layer."""
    import dataclasses

    return dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, parallel_residual=True, position_embedding="rope", rotary_percent=0.25, tie_embeddings=False,
        **model))


LLAMA = {"normalization": "rmsnorm", "swiglu": True, "num_query_groups": 2, "add_bias_linear": False,
         "tie_embeddings": False, "position_embedding": "rope", "rope_scaling": "llama3", "ffn_hidden_size": 128}
"""The Llama keys on tiny_config's 4 heads: 2 key/value groups (so TP 2 splits the groups, one per rank, and each
group is shared by 2 queries), SwiGLU at 2 x hidden, RMSNorm, no linear biases, untied output layer, Llama 3.1's
RoPE scaling (with head_dim 16 and base 10000 its three bands all occur: kept, interpolated, divided)."""


LLAMA_LR = 2e-3
"""The Llama runs' peak LR. At tiny_config's 3e-3 this model's loss spikes make its grad norm depend on the order of
summation at the 1e-5 level (two micro-batchings of one process: up to 1.5e-5 apart, the RTOL of the proofs); at
2e-3 they are 2e-7 apart, as GPT's are at 3e-3, and it still learns (loss 6.2 -> 4.3 in 20 steps)."""


def llama(cfg: RunConfig, *, qkv_bias: bool = False, **model: Any) -> RunConfig:
    """`cfg` as a tiny Llama (LLAMA, at LLAMA_LR); with qkv_bias as Qwen2 (a bias on the QKV projection only)."""
    import dataclasses

    model = {**LLAMA, "add_qkv_bias": qkv_bias, **model}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model),
                               optim=dataclasses.replace(cfg.optim, lr=LLAMA_LR, min_lr=LLAMA_LR / 10))


def distributed_optimizer(cfg: RunConfig) -> RunConfig:
    """`cfg` with parallel.distributed_optimizer on."""
    import dataclasses

    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, distributed_optimizer=True))


def memory_measure(rank: int, world: int, ports: list[int], cases: list[tuple[str, RunConfig]]) -> dict[str, Any]:
    """For each (name, config) at this world size: the bytes of this rank's weights, gradients and Adam moments
    after one real step, what autograd saves during one micro-batch's forward through the rank's stages (seen
    with saved-tensor hooks, each storage once, parameters left out), and the planner's estimate for the rank."""
    import dataclasses

    from megatron_hpc.config.platforms import get_platform
    from megatron_hpc.model.saved_activations import saved_activation_bytes
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.parallel.pipeline import PipelineRunner
    from megatron_hpc.plan.memory import GIB, PipelineShape, estimate_ranks
    from megatron_hpc.plan.planner import make_plan
    from megatron_hpc.train.distributed_optimizer import DistributedOptimizer
    from megatron_hpc.train.loop import build_model, pipeline_stages
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.step import MicroBatches, PipelineSchedule, train_step

    out: dict[str, Any] = {}
    for i, (name, cfg) in enumerate(cases):
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, workers_per_node=world))
        plan = make_plan(cfg, num_nodes=1, platform=get_platform("cpu"))
        _init(rank, world, ports[i])
        ctx = ParallelContext.build(plan.mesh, rank=rank)
        sp = cfg.parallel.sequence_parallel
        model = build_model(cfg.model, ctx, padded_vocab=plan.padded_vocab_size, seed=cfg.train.seed,
                            device=torch.device("cpu"), stages=pipeline_stages(plan, ctx), sequence_parallel=sp)
        dist_opt = cfg.parallel.distributed_optimizer
        optimizer = (DistributedOptimizer(model, optim=cfg.optim, ctx=ctx) if dist_opt
                     else PlainOptimizer(model, optim=cfg.optim, ctx=ctx, device_kind="cpu"))
        if ctx.pp_size > 1:
            runner = PipelineRunner(model, ctx, num_micro_batches=plan.num_micro_batches,
                                    schedule=plan.pipeline_schedule, device=torch.device("cpu"))
            forward_backward = PipelineSchedule(runner, autocast_dtype=None, device_type="cpu")
        else:
            forward_backward = MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu")
        gen = torch.Generator().manual_seed(rank)
        s, b, h = cfg.model.seq_length, plan.micro_batch_size, cfg.model.hidden_size
        batches = [torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen)
                   for _ in range(plan.num_micro_batches)]
        train_step(forward_backward, optimizer, batches)

        params = list(model.parameters())
        if dist_opt:
            weights = optimizer.param_buffer.numel() * optimizer.param_buffer.element_size()
            grads = optimizer.grad_buffer.numel() * optimizer.grad_buffer.element_size()
            states = optimizer.optimizer.state.values()
        else:
            weights = sum(p.numel() * p.element_size() for p in params)
            grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
            states = optimizer.optimizer.state.values()
        moments = sum(v.numel() * v.element_size() for st in states for k, v in st.items() if k != "step")

        rows = s // ctx.tp_size if sp else s  # a later stage's input: this rank's sequence shard under SP
        inputs = [batches[0][:, :-1] if stage.first else torch.randn(b, rows, h, generator=gen, requires_grad=True)
                  for stage in model.stages]
        saved = saved_activation_bytes(model, inputs)

        shape = PipelineShape(stage_layers=tuple(stop - start for start, stop in plan.stage_layers),
                              pipeline=plan.pipeline_parallel, virtual=plan.virtual_pipeline,
                              schedule=plan.pipeline_schedule, num_micro_batches=plan.num_micro_batches)
        est = estimate_ranks(cfg.model, padded_vocab=plan.padded_vocab_size, tensor_parallel=ctx.tp_size,
                             micro_batch=b, precision=cfg.train.precision, backend=plan.backend, pipeline=shape,
                             sequence_parallel=sp, optimizer_shards=ctx.dp_size if dist_opt else 1)[ctx.pp_rank]
        out[name] = {"weights": weights, "grads": grads, "optimizer": moments, "activations": saved,
                     "params": sum(p.numel() for p in params),
                     "est": {"weights": est.weights_gib * GIB, "grads": est.grads_gib * GIB,
                             "optimizer": est.optimizer_gib * GIB,
                             "activations": est.micro_batch_activations_gib * GIB},
                     "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank}
        dist.destroy_process_group()
    return out



def failing_run(rank: int, world: int, ports: list[int], cfg: RunConfig, run_root: str) -> str:
    """run_training that must fail: the CheckpointError message this rank raised ('' when the run succeeded)."""
    from megatron_hpc.errors import CheckpointError
    from megatron_hpc.train.entry import plan_for_torchrun, run_training

    os.environ["MASTER_PORT"] = str(ports[0])
    try:
        run_training(plan_for_torchrun(cfg), run_dir=Path(run_root))
    except CheckpointError as exc:
        return str(exc)
    return ""


def hang_timeout_check(rank: int, world: int, ports: list[int], timeout_s: float, slow_s: float) -> str:
    """Two ranks' pulses, rank 1 slowed past `timeout_s` and rank 0 not: what each rank's hang-timeout check said
    at the first timed step ("" when it let the step pass)."""
    from megatron_hpc.errors import ConfigError
    from megatron_hpc.parallel.device import DeviceInfo
    from megatron_hpc.train.loop import world_max_over_ranks
    from megatron_hpc.train.pulse import Pulse, SlowdownForTests

    _init(rank, world, ports[0])
    try:
        cpu = DeviceInfo(kind="cpu", device=torch.device("cpu"), backend="gloo")
        pulse = Pulse(None, rank=rank, device=torch.device("cpu"), hang_timeout_s=timeout_s,
                      slowdown=SlowdownForTests(rank=1, seconds=slow_s), world_max=world_max_over_ranks(cpu))
        try:
            for iteration in range(1, pulse.first_timed + 1):
                pulse.step_begins(iteration)
                pulse.compute_done()
                pulse.step_ends()
        except ConfigError as err:
            return str(err)
        return ""
    finally:
        dist.destroy_process_group()
