"""`ckpt convert` of a megatron-core torch_dist checkpoint against `cp -r` of the same files (issue 27).

Writes a synthetic GPT checkpoint as megatron-core's torch_dist format stores it (megatron-core 0.16.1; what
tests/fixtures/megatron_core_torch_dist holds at toy size): the model's sharded keys with decoder layers stacked on a
leading axis and Transformer Engine's fused norm names, bf16 weights, the .distcp data written by
torch.distributed.checkpoint's own writer in several files (`--files`, as several saving ranks and threads make),
common.pt with Megatron-LM's args, metadata.json; with `--optimizer`, plain Adam's model-space state beside it
(fp32 master, exp_avg, exp_avg_sq: 7x the bytes). Then, one after the other in one run, each as a child process
timed from start until its dirty pages are on the disk (a `sync` inside the timed region, as benchmarks/convert_cpu.py
times them):

- anchor: `cp -r SRC DST`;
- ours:   `megatron-hpc ckpt convert SRC --to torch --tp N --out DIR` (one file per output rank);
- ours:   the same `--to xser` (one file per tensor, the trainer's default format);
- ours:   the same `--to torch_dist` (read and written back in megatron-core's format);
- ours:   `--to hf` (weights only, at TP 1: save_pretrained's safetensors shards; `--shard-size-gb`).

    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench                       # 12 layers, hidden 1024
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --repeat 3            # medians of 3
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --layers 24 --hidden 2048 --optimizer
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --optimizer --read-budget-gib 0.25   # bounded
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --dp-reshardable   # distributed optimizer buckets
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --optimizer --to hf --read-budget-gib 0.25 \
        --shard-size-gb 0.1
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --optimizer --ours xser --ours-pp 2 \
        --to torch hf torch_dist --baseline ../main     # a checkpoint of ours, against main's code side by side
    python benchmarks/convert_torch_dist_cpu.py --dir ./td-bench --optimizer --to torch --repeat 3 \
        --baseline /path/to/main/tree --source ./td-src   # main's converts beside ours, on a kept source

Goal: each convert within 2x of the copy's wall time. Peak RSS is reported: `--to torch|xser` reads the source a
unit (one layer of every stacked key, or one key with its moments) at a time, holding at most `--read-budget-gib`
of it plus one unit besides the output rank being made, `--to hf` the same plus one output shard; `--to
torch_dist` reads and writes a unit at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import convert_cpu
from convert_cpu import GIB, Row, Shape, du, median_row, padded_vocab, ratio, run_child


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="work folder (emptied first, removed after)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257, help="true vocabulary; padded as Megatron pads it")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--from-tp", type=int, default=2, help="the TP size the source's args record")
    p.add_argument("--to-tp", type=int, default=2)
    p.add_argument("--files", type=int, default=4, help=".distcp files the source's data is spread over")
    p.add_argument("--optimizer", action="store_true", help="also plain Adam's fp32 masters and moments")
    p.add_argument("--dp-reshardable", action="store_true",
                   help="the optimizer state as the distributed optimizer saves it by default (Megatron-LM's "
                        "dp_reshardable flat buffers, one chunk per parameter); implies --optimizer")
    p.add_argument("--to", nargs="+", choices=("torch", "xser", "torch_dist", "hf"),
                   default=["torch", "xser", "torch_dist"])
    p.add_argument("--read-budget-gib", type=float, help="passed to each convert (default: its own, 1)")
    p.add_argument("--shard-size-gb", type=float, help="passed to --to hf (default: its own, 5)")
    p.add_argument("--workers", type=int, nargs="+", default=[1],
                   help="each --to torch|xser convert once per value, with --workers N (default: 1 only); the peak "
                        "RSS of a run with workers is its largest process's, not their sum")
    p.add_argument("--repeat", type=int, default=1, help="runs of each, alternating; the table gives medians")
    p.add_argument("--ours", choices=("xser", "torch"),
                   help="convert the source once (untimed) into a checkpoint of ours in this format at --from-tp x "
                        "--ours-pp, and time the converts of that instead (read a tensor at a time)")
    p.add_argument("--ours-pp", type=int, default=1, help="with --ours: its pipeline size")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--baseline", type=Path,
                   help="a source tree (holding megatron_hpc/) whose converts run beside this tree's, alternating")
    p.add_argument("--source", type=Path,
                   help="the source checkpoint's root: written there when missing, kept after (default: in --dir)")
    p.add_argument("--write-source-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.optimizer = args.optimizer or args.dp_reshardable
    if args.hidden % args.heads or args.heads % args.from_tp or args.heads % args.to_tp:
        p.error(f"--heads {args.heads} must divide --hidden {args.hidden} and be divisible by --from-tp and --to-tp")
    if args.repeat < 1 or args.files < 1:
        p.error("--repeat and --files take 1 or more")
    return args


def write_source(root: Path, shape: Shape, *, tp: int, files: int, optimizer: bool, dp_reshardable: bool = False
                 ) -> None:
    """The torch_dist checkpoint under `root` (tracker + iter_0000100), as megatron-core lays it out."""
    import argparse as ap
    import json
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    g = torch.Generator().manual_seed(1)
    h, f, n = shape.hidden, shape.ffn, shape.layers
    padded = padded_vocab(shape.vocab, tp=tp)

    def w(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * 0.02).to(torch.bfloat16)

    layer = "decoder.layers."
    model = {"embedding.word_embeddings.weight": w(padded, h), "embedding.position_embeddings.weight": w(shape.seq, h),
             layer + "self_attention.linear_qkv.layer_norm_weight": w(n, h),
             layer + "self_attention.linear_qkv.layer_norm_bias": w(n, h),
             layer + "self_attention.linear_qkv.weight": w(n, 3 * h, h),
             layer + "self_attention.linear_qkv.bias": w(n, 3 * h),
             layer + "self_attention.linear_proj.weight": w(n, h, h),
             layer + "self_attention.linear_proj.bias": w(n, h),
             layer + "mlp.linear_fc1.layer_norm_weight": w(n, h), layer + "mlp.linear_fc1.layer_norm_bias": w(n, h),
             layer + "mlp.linear_fc1.weight": w(n, f, h), layer + "mlp.linear_fc1.bias": w(n, f),
             layer + "mlp.linear_fc2.weight": w(n, h, f), layer + "mlp.linear_fc2.bias": w(n, h),
             "decoder.final_layernorm.weight": w(h), "decoder.final_layernorm.bias": w(h)}
    state: dict[str, object] = dict(model)
    common: dict[str, object] = {"checkpoint_version": 3.0, "iteration": 100,
                                 "content_metadata": {"singleton_local_shards": False,
                                                      "chained_optim_avoid_prefix": True}}
    flats: dict[str, tuple[str, tuple[int, ...], object]] = {}
    if dp_reshardable:
        flats, common["optimizer"] = _flat_buckets(model, tp=tp), {"param_state_sharding_type": "dp_reshardable"}
    elif optimizer:
        for key, t in model.items():
            state[f"optimizer.state.fp32_param.{key}"] = t.float()
            state[f"optimizer.state.exp_avg.{key}"] = t.float() * 0.1
            state[f"optimizer.state.exp_avg_sq.{key}"] = t.float().square()
        group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "lr": 1e-4,
                 "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        common["optimizer"] = {"state": {"common_step": torch.tensor(100.0)},
                               "param_groups": [group, {**group, "wd_mult": 0.0, "weight_decay": 0.0}]}
    if optimizer:
        common["opt_param_scheduler"] = {"max_lr": 1e-4, "lr_warmup_steps": 80, "num_steps": 800,
                                         "lr_decay_style": "cosine", "lr_decay_steps": 8000, "min_lr": 1e-5,
                                         "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
                                         "wd_incr_steps": 8000}
    common["args"] = ap.Namespace(
        num_layers=n, hidden_size=h, ffn_hidden_size=f, num_attention_heads=shape.heads, seq_length=shape.seq,
        max_position_embeddings=shape.seq, padded_vocab_size=padded, vocab_size=shape.vocab,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        data_parallel_size=1, position_embedding_type="learned_absolute", normalization="LayerNorm",
        swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=False,
        tokenizer_type="GPT2BPETokenizer",
        global_batch_size=8, micro_batch_size=1, train_iters=1000, consumed_train_samples=800, lr=1e-4, min_lr=1e-5,
        lr_warmup_iters=10, lr_decay_iters=1000, lr_decay_style="cosine", weight_decay=0.1, clip_grad=1.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=True, ckpt_format="torch_dist")
    folder = root / "iter_0000100"
    folder.mkdir(parents=True)
    chunks, placed = _chunked(state, tp=tp)
    for name, (key, offsets, value) in flats.items():
        chunks[name], placed[name] = value, (key, offsets)
    if dp_reshardable:
        chunks["optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"] = _groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(chunks, storage_writer=FileSystemWriter(str(folder), thread_count=files),
                 planner=DefaultSavePlanner(flatten_state_dict=False), no_dist=True)
    _merge_index(folder / ".metadata", {**state, **{k: v for k, _, v in _flat_wholes(flats)}}, placed)
    torch.save(common, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    (root / "latest_checkpointed_iteration.txt").write_text("100")


def _flat_buckets(model: dict[str, object], *, tp: int) -> dict[str, tuple[str, tuple[int, ...], object]]:
    """The distributed optimizer's dp_reshardable state of `model` at DP 1: per TP rank one bucket whose flat param
    (fp32 master), exp_avg and exp_avg_sq hold the rank's parameters in reverse module order, each at a multiple of
    64 from the bucket's start (megatron-core 0.16.1 param_and_grad_buffer.py), saved one chunk per parameter as
    its dp_reshardable sharded_state_dict does. Returns chunk key -> (flat key, offsets, piece)."""
    import torch

    from megatron_hpc.checkpoint.foreign import torch_dist_optim as optim

    tensors = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
    layers = next(v.shape[0] for k, v in tensors.items() if k.startswith("decoder.layers."))
    out: dict[str, tuple[str, tuple[int, ...], object]] = {}
    for t in range(tp):
        prefix = f"optimizer.distributed.dp_group_idx_{t}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0."
        params = optim.rank_params(tensors, optim.LAYER_ORDERS[0], range(layers), first=True, last=True, pp=1)
        used = 0
        for key, layer in reversed(params):
            full = tensors[key] if layer is None else tensors[key][layer]
            index = optim.index_of(optim.local_ranges(key, full.shape, tp=tp, rank=t, swiglu=False))
            local = (full if index is None else full.index_select(index[0], index[1])).float().reshape(-1)
            start = -(-used // 64) * 64
            for what, value in (("param", local), ("exp_avg", local * 0.1), ("exp_avg_sq", local.square())):
                out[f"{prefix}{what}/chunk_{t}_{start}"] = (prefix + what, (start,), value.contiguous())
            used = start + local.numel()
    return out


def _flat_wholes(flats: dict[str, tuple[str, tuple[int, ...], object]]) -> list[tuple[str, None, object]]:
    """Each flat key's global tensor as a meta stand-in (only its shape and dtype go into the index)."""
    import torch

    ends: dict[str, int] = {}
    for key, (start,), value in flats.values():
        ends[key] = max(ends.get(key, 0), start + value.numel())  # type: ignore[attr-defined]
    return [(k, None, torch.empty(n, dtype=torch.float32, device="meta")) for k, n in ends.items()]


def _groups() -> object:
    """The rank's param groups as the dp_reshardable save keeps them: a ShardedObject, which
    torch.distributed.checkpoint pickles (torch.save) as a list of its shards' data."""
    group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "lr": 1e-4,
             "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "step": 100.0}
    return [{"param_groups": [group, {**group, "wd_mult": 0.0, "weight_decay": 0.0}]}]


def _chunked(state: dict[str, object], *, tp: int) -> tuple[dict[str, object], dict[str, tuple[str, tuple[int, ...]]]]:
    """Each tensor as megatron-core's ranks save it: one chunk per decoder layer and TP shard (its sharded_state_dict
    makes each layer of each rank a ShardedTensor at its global offset). Saved under a key of its own each, then
    merged into one key per tensor by _merge_index. Returns (chunks by their own key, chunk key -> (key, offsets))."""
    import torch

    from megatron_hpc.checkpoint.foreign.torch_dist_keys import optimizer_key, tp_split_dim

    chunks: dict[str, object] = {}
    placed: dict[str, tuple[str, tuple[int, ...]]] = {}
    for key, value in state.items():
        assert isinstance(value, torch.Tensor)
        model_key = (optimizer_key(key) or ("", key))[1]
        stacked = model_key.startswith("decoder.layers.")
        dim = tp_split_dim(model_key)
        for layer in range(value.shape[0]) if stacked else [None]:
            part = value[layer] if layer is not None else value
            pieces = part.chunk(tp, dim=dim) if dim is not None else [part]
            for t, piece in enumerate(pieces):
                offsets = [0] * part.ndim
                if dim is not None:
                    offsets[dim] = t * pieces[0].shape[dim]
                if layer is not None:
                    offsets = [layer, *offsets]
                name = f"{key}/chunk_{len(placed)}"
                chunks[name] = piece.unsqueeze(0).contiguous() if layer is not None else piece.contiguous()
                placed[name] = (key, tuple(offsets))
    return chunks, placed


def _merge_index(path: Path, state: dict[str, object], placed: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """torch.distributed.checkpoint's index of the chunk keys rewritten as one key per tensor with its chunks at their
    global offsets (what a multi-rank save writes); the data files are left as they are."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    with path.open("rb") as fh:
        metadata = pickle.load(fh)
    records, storage = {}, {}
    for name, (key, offsets) in placed.items():
        saved = metadata.state_dict_metadata[name]
        value = state[key]
        assert isinstance(value, torch.Tensor)
        record = records.setdefault(key, TensorStorageMetadata(properties=saved.properties, size=value.shape,
                                                               chunks=[]))
        record.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=saved.size))
        info = next(v for k, v in metadata.storage_data.items() if k.fqn == name)
        storage[MetadataIndex(key, torch.Size(offsets), len(record.chunks) - 1)] = info
    kept = {k: v for k, v in metadata.state_dict_metadata.items() if k not in placed}  # ShardedObjects
    storage.update({i: v for i, v in metadata.storage_data.items() if i.fqn in kept})
    metadata.state_dict_metadata, metadata.storage_data = {**records, **kept}, storage
    with path.open("wb") as fh:
        pickle.dump(metadata, fh)


def _ours(src: Path, out: Path, *, fmt: str, tp: int, pp: int) -> Path:
    """`src` converted once into a checkpoint of ours (what `--ours` then times the converts of)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatron_hpc", "ckpt", "convert", str(src), "--to", fmt, "--tp", str(tp),
                    "--pp", str(pp), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(src)
    print(f"source of ours: {fmt} at tp {tp} x pp {pp}, {du(out) / GIB:.2f} GiB, made in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = Shape(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq)
    work = args.dir
    src, copy = args.source or work / "src", work / "copy"
    if args.write_source_only:
        write_source(src, shape, tp=args.from_tp, files=args.files, optimizer=args.optimizer,
                     dp_reshardable=args.dp_reshardable)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    # In a child: a child's peak RSS starts from its parent's at the fork, so this process stays small (no torch).
    if not (src / "latest_checkpointed_iteration.txt").is_file():
        subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                        "--write-source-only"], check=True)
    params = convert_cpu.num_params(shape, padded=padded_vocab(shape.vocab, tp=args.from_tp))
    print(f"source: {params / 1e9:.3f} B parameters, torch_dist in {args.files} .distcp files, "
          f"{'with' if args.optimizer else 'without'} optimizer{' (dp_reshardable)' * args.dp_reshardable}, "
          f"{du(src) / GIB:.2f} GiB, written in "
          f"{time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    if args.ours:
        src = _ours(src, work / "ours-src", fmt=args.ours, tp=args.from_tp, pp=args.ours_pp)
    commands = {"cp -r": (["cp", "-r", str(src), str(copy)], copy)}
    # -P: megatron_hpc comes from PYTHONPATH's tree, not from the working folder or an installed copy.
    trees = {"": Path(__file__).resolve().parents[1], **({" (baseline)": args.baseline.resolve()}
                                                            if args.baseline else {})}
    for to in args.to:
        for tag, tree in trees.items():
            for workers in args.workers if to in ("torch", "xser") else [1]:
                more = ["--workers", str(workers)] if workers > 1 else []
                out = work / f"ours-{to}{'-baseline' * bool(tag)}{f'-w{workers}' * bool(more)}"
                sizes = ["--tp", str(args.to_tp)] if to != "hf" else (
                    ["--shard-size-gb", str(args.shard_size_gb)] if args.shard_size_gb else [])
                budget = ["--read-budget-gib", str(args.read_budget_gib)] if args.read_budget_gib else []
                commands[f"convert --to {to} {' '.join(sizes[:2] + more)}".strip() + tag] = (
                    ["env", f"PYTHONPATH={tree}", sys.executable, "-P", "-m", "megatron_hpc", "ckpt", "convert",
                     str(src), "--to", to, *sizes, "--out", str(out), *budget, *more], out)
    runs: dict[str, list[Row]] = {name: [] for name in commands}
    for i in range(args.repeat):  # alternating, so a change in the machine's load falls on all alike
        for name, (cmd, dst) in commands.items():
            shutil.rmtree(dst, ignore_errors=True)
            runs[name].append(run_child(name, cmd))
            print(f"  run {i + 1}: {name}: {runs[name][-1].wall_s:.2f} s", flush=True)
    rows = [median_row(done) for done in runs.values()]
    sizes = {"source": du(src), **{f"output {n}": du(dst) for n, (_, dst) in commands.items() if n != "cp -r"}}
    print(convert_cpu.table(rows, sizes))
    worst = max(ratio(r.wall_s, rows[0].wall_s) for r in rows[1:] if not r.name.endswith("(baseline)"))
    print(f"time goal (each convert <= 2x copy): {'met' if worst <= 2.0 else 'NOT met'}; worst {worst:.2f}x; "
          f"convert peak RSS / source {max(r.peak_rss or 0 for r in rows[1:]) / du(src):.2f}x")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)  # a --source outside --dir stays


if __name__ == "__main__":
    main()
