"""`ckpt convert` of a Neuron-reference checkpoint (TP 8 -> TP 2) against `cp -r` of the same files (issue 16).

Writes a synthetic checkpoint as the Neuron reference Megatron saves it (`--save-xser` by default, `--format torch`
for plain torch.save): flat args, the model nested as language_model / embedding / encoder, one mp_rank_XX folder
per TP rank, weights random (replicated ones equal on every rank, as the importer checks). Then, one after the other
in one run, each as a child process timed from start until its dirty pages are on the disk (a `sync` inside the
timed region, because our writer fsyncs every file and `cp` does not):

- anchor: `cp -r SRC DST`;
- ours:   `megatron-hpc ckpt convert SRC --to xser --tp 2 --out DIR`.

Page cache: nothing is dropped (that needs root, and must be done for both alike). The source has just been
written, so both read it from memory when it fits (weights only: 2.6 GiB at 1.3B), and both pay the same
`sync` before starting. The convert's peak RSS comes from wait4's rusage of that child alone (the source is
written by another child, so the parent, whose size a child's peak starts from, stays small).

    flock /tmp/mhpc-bench.lock python benchmarks/convert_cpu.py --dir ./convert-bench             # 1.3B, weights
    python benchmarks/convert_cpu.py --dir ./convert-bench --layers 2 --hidden 512 --heads 8      # quick
    python benchmarks/convert_cpu.py --dir ./convert-bench --repeat 3                             # medians of 3

Weights only (bf16, as the reference's model state of a bf16 run) is the default and the safe one on a shared
24 GiB machine: `--optimizer` adds fp32 master weights and Adam's two moments (7x the bytes: about 18 GiB on disk
at 1.3B; the convert holds one output rank's weights and moments, about 7.4 GiB at TP 2).

Goals: convert within 2x of the copy's wall time; its peak memory below two output ranks' shards, not the whole
model. At TP 2 two ranks' shards *are* the whole model, so the table gives one rank's shards too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int

    @property
    def ffn(self) -> int:
        return 4 * self.hidden


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    name: str
    wall_s: float
    peak_rss: int | None
    """Bytes; None where not measured (the copy)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="work folder (emptied first, removed after)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257, help="true vocabulary; padded as the reference pads it")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--from-tp", type=int, default=8)
    p.add_argument("--to-tp", type=int, default=2)
    p.add_argument("--format", choices=("xser", "torch"), default="xser", help="how the source's files are written")
    p.add_argument("--optimizer", action="store_true",
                   help="also fp32 masters and Adam's moments (7x the bytes; mind the disk and memory)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the copy and the convert this many times, alternating; the table gives each one's median")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--write-source-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: give 1 or more runs of each")
    if args.hidden % args.heads or args.heads % args.from_tp or args.heads % args.to_tp:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden} and be divisible by --from-tp "
                f"{args.from_tp} and --to-tp {args.to_tp}")
    return args


def padded_vocab(vocab: int, *, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: up to a multiple of divisible_by x TP."""
    step = divisible_by * tp
    return -(-vocab // step) * step


def num_params(shape: Shape, *, padded: int) -> int:
    h, f = shape.hidden, shape.ffn
    per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h)
    return padded * h + shape.seq * h + shape.layers * per_layer + 2 * h


def ratio(ours: float, anchor: float) -> float:
    return ours / anchor if anchor > 0 else float("inf")


def median_row(rows: list[Row]) -> Row:
    """The run of median wall time (the upper one of an even count), with its own peak RSS."""
    ranked = sorted(rows, key=lambda r: r.wall_s)
    return ranked[len(ranked) // 2]


def table(rows: list[Row], sizes: dict[str, int]) -> str:
    """The timing rows (each against the first, the anchor) and the sizes the peak RSS is read against."""
    anchor = rows[0].wall_s
    lines = ["| run | wall s | x copy | peak RSS GiB |", "| --- | --- | --- | --- |"]
    for r in rows:
        rss = "-" if r.peak_rss is None else f"{r.peak_rss / GIB:.2f}"
        lines.append(f"| {r.name} | {r.wall_s:.2f} | {ratio(r.wall_s, anchor):.2f} | {rss} |")
    lines += ["", "| size | GiB |", "| --- | --- |"]
    lines += [f"| {name} | {n / GIB:.2f} |" for name, n in sizes.items()]
    return "\n".join(lines)


def verdict(ours: Row, anchor: Row, *, two_ranks: int) -> str:
    time_ok = ratio(ours.wall_s, anchor.wall_s) <= 2.0
    mem_ok = ours.peak_rss is not None and ours.peak_rss < two_ranks
    return (f"time goal (<= 2x copy): {'met' if time_ok else 'NOT met'}; "
            f"memory goal (< two output ranks' shards): {'met' if mem_ok else 'NOT met'}")


# ---- the synthetic checkpoint (side effects below) ----

def _rank_state(shape: Shape, *, tp: int, rank: int, padded: int, optimizer: bool) -> dict[str, Any]:
    """One TP rank's state dict as the Neuron reference saves it (bf16 model; fp32 masters and Adam with
    `optimizer`). Split weights are drawn per rank, replicated ones from one seed, so every rank holds equal copies."""
    import torch

    split_g = torch.Generator().manual_seed(1000 + rank)
    same_g = torch.Generator().manual_seed(1)
    h, f = shape.hidden, shape.ffn

    def split(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=split_g) * 0.02).to(torch.bfloat16)

    def same(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=same_g) * 0.02).to(torch.bfloat16)

    encoder: dict[str, torch.Tensor] = {}
    for i in range(shape.layers):
        pre = f"layers.{i}."
        encoder.update({
            pre + "input_layernorm.weight": same(h), pre + "input_layernorm.bias": same(h),
            pre + "self_attention.query_key_value.weight": split(3 * h // tp, h),
            pre + "self_attention.query_key_value.bias": split(3 * h // tp),
            pre + "self_attention.dense.weight": split(h, h // tp), pre + "self_attention.dense.bias": same(h),
            pre + "post_attention_layernorm.weight": same(h), pre + "post_attention_layernorm.bias": same(h),
            pre + "mlp.dense_h_to_4h.weight": split(f // tp, h), pre + "mlp.dense_h_to_4h.bias": split(f // tp),
            pre + "mlp.dense_4h_to_h.weight": split(h, f // tp), pre + "mlp.dense_4h_to_h.bias": same(h)})
    encoder.update({"final_layernorm.weight": same(h), "final_layernorm.bias": same(h)})
    model = {"language_model": {"embedding": {"word_embeddings": {"weight": split(padded // tp, h)},
                                              "position_embeddings": {"weight": same(shape.seq, h)}},
                                "encoder": encoder}}
    state: dict[str, Any] = {
        "num_layers": shape.layers, "hidden_size": h, "num_attention_heads": shape.heads,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "max_position_embeddings": shape.seq,
        "make_vocab_size_divisible_by": 128, "padded_vocab_size": padded, "tokenizer_type": "GPT2BPETokenizer",
        "checkpoint_version": 3.0, "iteration": 100, "consumed_train_samples": 100 * 8,
        "consumed_valid_samples": 0, "model": model}
    if optimizer:
        state["optimizer"] = _optimizer(_flat(model))
    return state


def _flat(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _flat(v)]
    return [tree]


def _optimizer(params: list[Any]) -> dict[str, Any]:
    """Float16OptimizerWithFloat16Params' state: AdamW groups (matrices, then vectors), fp32 masters."""
    import torch

    groups = [[i for i, p in enumerate(params) if p.dim() >= 2], [i for i, p in enumerate(params) if p.dim() < 2]]
    order = [i for g in groups for i in g]
    state = {pos: {"step": torch.tensor(100.0), "exp_avg": params[i].float() * 0.1,
                   "exp_avg_sq": params[i].float().square()} for pos, i in enumerate(order)}
    start, param_groups = 0, []
    for g, wd in zip(groups, (0.1, 0.0)):
        param_groups.append({"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd,
                             "params": list(range(start, start + len(g)))})
        start += len(g)
    return {"optimizer": {"state": state, "param_groups": param_groups},
            "grad_scaler": {"scale": torch.tensor(1.0), "growth_tracker": 0},
            "fp32_from_fp16_params": [[params[i].float() for i in g] for g in groups]}


def _save_reference_xser(state: dict[str, Any], main: Path) -> None:
    """As torch_xla's xser.save: tensors become TensorReference(tid), each in tensors/tensor_<tid>.pt."""
    import torch

    from megatron_hpc.checkpoint.store import xser
    from megatron_hpc.checkpoint.store.file_io import write_torch_file

    folder = main.with_name(main.name + ".tensors")
    folder.mkdir(parents=True)
    count = 0

    def walk(value: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.Tensor):
            torch.save(value.clone(), folder / f"tensor_{count}.pt")
            count += 1
            return xser.TensorReference(count - 1)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        return value

    write_torch_file(main, walk(state), pickle_module=xser.PICKLE_MODULE)


def write_source(root: Path, shape: Shape, *, tp: int, fmt: str, optimizer: bool) -> None:
    """The reference checkpoint under `root` (tracker + iter_0000100)."""
    import torch

    padded = padded_vocab(shape.vocab, tp=tp)
    for rank in range(tp):
        state = _rank_state(shape, tp=tp, rank=rank, padded=padded, optimizer=optimizer)
        main = root / "iter_0000100" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        main.parent.mkdir(parents=True)
        if fmt == "xser":
            _save_reference_xser(state, main)
        else:
            torch.save(state, main)
        del state
    (root / "latest_checkpointed_iteration.txt").write_text("100")


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_child(name: str, cmd: list[str]) -> Row:
    """Wall time of cmd until its writes are on the disk, and its own peak RSS (wait4's rusage)."""
    os.sync()  # the previous run's dirty pages are not this one's
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): {err.strip()[-400:]}")
    return Row(name=name, wall_s=wall, peak_rss=usage.ru_maxrss * 1024)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = Shape(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq)
    work = args.dir
    src, copy, out = work / "ref", work / "copy", work / "ours"
    if args.write_source_only:
        write_source(src, shape, tp=args.from_tp, fmt=args.format, optimizer=args.optimizer)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    # In a child: a child's peak RSS starts from its parent's at the fork, so this process stays small (no torch).
    subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--write-source-only"],
                   check=True)
    params = num_params(shape, padded=padded_vocab(shape.vocab, tp=args.from_tp))
    print(f"source: {params / 1e9:.3f} B parameters, tp {args.from_tp}, {args.format}, "
          f"{'with' if args.optimizer else 'without'} optimizer, {du(src) / GIB:.2f} GiB, written in "
          f"{time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    cli = [sys.executable, "-m", "megatron_hpc", "ckpt", "convert", str(src), "--to", "xser", "--tp",
           str(args.to_tp), "--out", str(out)]
    runs: dict[str, list[Row]] = {"cp -r": [], f"ckpt convert tp {args.from_tp} -> {args.to_tp}": []}
    for i in range(args.repeat):  # alternating, so a change in the machine's load falls on both alike
        for (name, done), cmd, dst in zip(runs.items(), (["cp", "-r", str(src), str(copy)], cli), (copy, out)):
            shutil.rmtree(dst, ignore_errors=True)
            done.append(run_child(name, cmd))
            print(f"  run {i + 1}: {name}: {done[-1].wall_s:.2f} s", flush=True)
    rows = [median_row(done) for done in runs.values()]
    ranks = sorted((du(d) for d in out.rglob("mp_rank_*") if d.is_dir()), reverse=True)
    sizes = {"source (all ranks)": du(src), f"output, one rank (of {args.to_tp})": ranks[0],
             "output, two ranks": sum(ranks[:2]), "output, whole model": du(out)}
    print(table(rows, sizes))
    print(verdict(rows[1], rows[0], two_ranks=sizes["output, two ranks"]))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
