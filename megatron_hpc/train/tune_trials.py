"""The trainer side of a `megatron-hpc tune` job (`train --phase tune`): short trials and micro-benchmarks.

Every rank of the job reads the run folder's tune-candidates.json (written by launch/tune_job.py), then, in one process
group: trains each candidate layout for compile.num_steps steps with the trainer's own trial path (train(...,
phase="compile"), no checkpoints) and a fresh ParallelContext for its mesh, times all-reduce, all-gather and
send/receive of a few sizes over the whole world, and times every candidate's matrix products (plan/gemm_shapes.py) on
every device at once, as the trials run them, and a chain of small operators with autograd, forward and backward, for
the fixed cost of one operator outside the GEMMs (plan/op_counts.py). A candidate's timed steps are the time per step of
its logged intervals after the warm-up (train/metrics.py WARMUP_STEPS), each the slowest rank's: each step on CPU,
blocks of steps with one host sync at each end on CUDA and XLA (launch/tune_job.py trial_log_interval); the fit takes
their median (plan/calibration_fit.py trial_time). Each trial also measures the share of its node's CPU that other
processes took (a trial disturbed by other work is named, not trusted). A collective's or a product's time is the median
of its repetitions, the slowest rank's. Rank 0 writes what was measured to tune-measured.json, and the node script's
end-of-phase step fits it (launch/tune_job.py finish_tune_run: tune.json, the winner's --set overlay and the calibration
kept in the shared cache).

On Trainium the node script runs this job twice (docs/planning.md#tune): first under neuron_parallel_compile,
which sets NEURON_EXTRACT_GRAPHS_ONLY and makes every execution a stub returning zeros (shared/reference/
neuron-xla.md 2.5): that pass only extracts the graphs and keeps no times; the second runs them compiled, timed.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hpc.errors import PlanError
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.device import (
    DeviceInfo,
    init_method,
    node_devices,
    resolve_device,
    set_cpu_threads,
    step_barrier,
)
from megatron_hpc.plan.calibration_fit import node_mismatch, other_work_share
from megatron_hpc.plan.planner import check_torchrun_world
from megatron_hpc.plan.spec import RunSpec
from megatron_hpc.run_folder import TUNE_CANDIDATES_FILE, TUNE_MEASURED_FILE, read_json, write_json
from megatron_hpc.train.entry import DistEnv, read_dist_env
from megatron_hpc.train.loop import train

GEMM_REPEATS = 5
"""Timed repetitions of each matrix product, after one untimed: the products of a small model's candidates take about
a second in all on a CPU core."""
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

OP_CHAIN_REPEATS = 15
"""Timed repetitions of the operator chain, after one untimed (counted): a few milliseconds each on CPU."""
OP_CHAIN_LINKS = 8
OP_CHAIN_SHAPE = (8, 64)
"""Small enough that each operator's work is negligible beside its fixed cost, as the benchmark means to time."""

BENCH_REPEATS = 15
"""Timed repetitions of each collective, after one untimed: about a millisecond each on CPU. With 5, a tune on a
loaded 2-core machine measured the 512 KiB all-reduce at 3.4 ms and the 2 MiB one at 1.4 ms."""


def run_tune(run_dir: Path) -> int:
    """This rank's share of the tune job; rank 0 writes the results. Returns 0."""
    request = read_json(run_dir / TUNE_CANDIDATES_FILE)
    specs = [RunSpec.from_json(c["config"], c["plan"], where=str(run_dir)) for c in request["candidates"]]
    env = read_dist_env()
    for spec in specs:
        check_torchrun_world(spec.plan, world_size=env.world_size, local_world_size=env.local_world_size)
    first = specs[0]
    device = resolve_device(first.plan.backend, local_rank=env.local_rank)
    _check_node(request["hardware"], device=device)
    if device.kind == "cpu":
        set_cpu_threads(local_world_size=env.local_world_size)
    timeout = timedelta(seconds=first.config.launch.collective_timeout_s)
    ranks = {} if device.kind == "xla" else {"rank": env.rank, "world_size": env.world_size}
    dist.init_process_group(device.backend, init_method=init_method(device.kind, master_addr=env.master_addr,
                                                                    master_port=env.master_port),
                            timeout=timeout, **ranks)
    try:
        measured, others = [], []
        for spec in specs:
            clock = _NodeClock(env=env, device=device)
            measured.append(_trial(spec, rank=env.rank, device=device, timeout=timeout))
            others.append(clock.other_work_share())
        samples = [_bench(op, nbytes, device=device) for op, nbytes in request["benchmark"]]
        gemm = _gemm_bench(request.get("gemm_benchmark", []), dtype=_DTYPES[request.get("gemm_precision", "fp32")],
                           device=device)
        op_s = _op_bench(device) if request.get("op_benchmark") else None
    finally:
        dist.destroy_process_group()
    if graphs_only_pass():
        return 0  # stub executions: these times are not the trials'; the timed pass follows
    if env.rank == 0:  # the launcher fits them once the job succeeded (launch/tune_job.py finish_tune_run)
        write_json(run_dir / TUNE_MEASURED_FILE, {"steps_s": measured, "bench_s": samples, "gemm_s": gemm,
                                                  "op_s": op_s,
                                                  "other_cpu_share": others, "finished_at_s": time.time()})
    return 0


def graphs_only_pass() -> bool:
    """True in the run under neuron_parallel_compile, which extracts graphs and executes stubs (neuron-xla.md 2.5:
    the variable "can be checked in the training script to prevent checking of bad outputs during trial run")."""
    return bool(os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY"))


def _check_node(hardware: dict, *, device: DeviceInfo) -> None:
    """PlanError (not requeued) when this node is not the platform the calibration would be kept for."""
    found = node_devices(device)
    if found is None:
        return
    problem = node_mismatch(hardware=hardware["name"], workers_per_node=hardware["platform_workers_per_node"],
                            memory_gib=hardware["memory_per_worker_gib"], found_workers=found[0],
                            found_memory_gib=found[1])
    if problem:
        raise PlanError(problem)


class _NodeClock:
    """CPU time of this rank's node, its workers' own and the wall clock, from its creation: what share of the
    node's CPU other processes took during a trial (plan/calibration_fit.py other_work_share). The host's CPUs,
    read from Linux's /proc/stat; None where that cannot be read."""

    def __init__(self, *, env: DistEnv, device: DeviceInfo):
        self.env, self.device = env, device
        self.wall, self.own, self.busy = time.perf_counter(), time.process_time(), _node_busy_s()

    def other_work_share(self) -> float | None:
        """The largest share over the job's nodes (a collective: every rank calls it)."""
        nodes = self.env.world_size // self.env.local_world_size
        node = self.env.rank // self.env.local_world_size  # torchrun numbers each node's workers contiguously
        busy = _node_busy_s()
        table = torch.zeros(3 * nodes, dtype=torch.float64 if self.device.kind == "cpu" else torch.float32,
                            device=self.device.device)
        table[node] = time.process_time() - self.own  # summed over the node's workers below
        if self.env.local_rank == 0:  # one reading of the node's counters
            readable = busy is not None and self.busy is not None
            table[nodes + node] = busy - self.busy if readable else 0.0
            table[2 * nodes + node] = 1.0 if readable else 0.0
        dist.all_reduce(table)
        step_barrier(self.device)
        values = table.tolist()  # host sync: numbers for tune.json
        wall, cores = time.perf_counter() - self.wall, os.cpu_count() or 1
        shares = [other_work_share(busy_s=values[nodes + n], own_s=values[n], wall_s=wall, cores=cores)
                  for n in range(nodes) if values[2 * nodes + n]]
        return max(shares) if shares else None


def _node_busy_s() -> float | None:
    """Seconds every CPU of this host has been busy since boot (/proc/stat's first line: all but idle and iowait)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _trial(spec: RunSpec, *, rank: int, device: DeviceInfo, timeout: timedelta) -> list[float]:
    """The candidate's time per step in each of its timed intervals (single steps, or blocks where reading a step
    waits for the device), each the slowest rank's: a step ends when its last rank is done."""
    ctx = ParallelContext.build(spec.plan.mesh, rank=rank, kind=device.kind, timeout=timeout)
    out = None if ctx.is_first_rank else io.StringIO()  # one banner and iteration lines per trial, in the log
    summary = train(spec, ctx, device=device, phase="compile", run_dir=None, checkpoints=False, out=out)
    timed = [r.elapsed_ms / 1e3 for r in summary.records if not r.warmup]
    if not timed:  # fewer steps than the warm-up: the CLI refuses that, so a short run is a bug
        raise RuntimeError(f"trial of {spec.plan.mesh} logged no step after its warm-up")
    return _slowest(timed, device=device)


def _slowest(seconds: list[float], *, device: DeviceInfo) -> list[float]:
    """Each value's maximum over the ranks (every rank holds as many)."""
    value = torch.tensor(seconds, dtype=torch.float64 if device.kind == "cpu" else torch.float32,
                         device=device.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    step_barrier(device)
    return value.tolist()  # host sync: the results are numbers for the fit


def _bench(op: str, nbytes: int, *, device: DeviceInfo) -> float:
    """Median seconds of one collective of `nbytes` (float32) over the world, the slowest rank's. send_recv pairs
    rank 2i with 2i+1 (an odd last rank idles), one hand-over each way timed as two."""
    world, rank = dist.get_world_size(), dist.get_rank()
    numel = max(1, nbytes // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=device.device)
    gathered = torch.empty(numel * world, dtype=torch.float32, device=device.device)
    chunk = buf[: max(1, numel // world)]
    peer = rank + 1 if rank % 2 == 0 else rank - 1

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(buf)
        elif op == "all_gather":
            dist.all_gather(list(gathered[: chunk.numel() * world].chunk(world)), chunk)
        elif peer < world:
            first, second = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)
            first(buf, peer)
            second(buf, peer)
        step_barrier(device)

    times = []
    for i in range(BENCH_REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        once()
        # Host sync: on CUDA the collective is queued, not done, when the call returns; reading a value waits.
        (gathered if op == "all_gather" else buf)[0].item()
        if i:
            times.append(time.perf_counter() - start)
    per_op = statistics.median(times) / (2 if op == "send_recv" else 1)
    return _slowest([per_op], device=device)[0]


def _gemm_bench(shapes: list[list[int]], *, dtype: torch.dtype, device: DeviceInfo) -> list[float]:
    """Median seconds of each (batch, m, k, n) product on this device, the slowest rank's. Every rank runs the same
    product at the same time, as a trial's ranks do (on CPU they share the node's cores and memory bandwidth)."""
    times = []
    for batch, m, k, n in shapes:
        a = torch.randn(batch, m, k, dtype=dtype, device=device.device)
        b = torch.randn(batch, k, n, dtype=dtype, device=device.device)
        dist.barrier()
        runs = []
        for i in range(GEMM_REPEATS + 1):
            start = time.perf_counter()
            out = torch.bmm(a, b)
            step_barrier(device)  # XLA: cut and run the graph of this one product
            out[0, 0, 0].item()  # host sync: on CUDA and XLA the product is queued, not done, when bmm returns
            if i:
                runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
    return _slowest(times, device=device) if times else []


class _OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside it, as plan/op_counts.py counts a layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _op_bench(device: DeviceInfo) -> list[float]:
    """[seconds per operator, operators per chain] of a chain of small operators with autograd (norm, activation,
    residual add, views; forward and backward, as a layer's non-GEMM work runs), every rank at once, the median of
    its repetitions, the slowest rank's. The chain's operators are counted on its untimed first run."""
    x = torch.randn(*OP_CHAIN_SHAPE, device=device.device, requires_grad=True)
    w = torch.ones(OP_CHAIN_SHAPE[-1], device=device.device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(OP_CHAIN_LINKS):
            y = F.gelu(F.layer_norm(y, (y.shape[-1],), w)) + y
            y = y.view(-1, y.shape[-1]).t().t()
        y.sum().backward()
        step_barrier(device)  # XLA: cut and run the chain's graph
        x.grad[0, 0].item()  # host sync: the backward is queued, not done, on CUDA and XLA
        x.grad = w.grad = None

    counter = _OpCount()
    with counter:
        chain()
    dist.barrier()
    runs = []
    for _ in range(OP_CHAIN_REPEATS):
        start = time.perf_counter()
        chain()
        runs.append(time.perf_counter() - start)
    return [_slowest([statistics.median(runs) / counter.count], device=device)[0], float(counter.count)]
