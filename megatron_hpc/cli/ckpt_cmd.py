"""`megatron-hpc ckpt inspect | convert | reshard`: look into a checkpoint (ours, or one of the Neuron reference,
Megatron-LM or megatron-core, torch_dist included), make one of those ours, export it to Hugging Face, megatron-core's
torch_dist or the other file format, or change its TP and PP sizes."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class _IntermixedParser(argparse.ArgumentParser):
    """Positionals may follow options: `convert SRC --to xser OUT` fills the optional OUT (plain argparse would
    leave it unrecognised, having matched OUT's absence right after SRC)."""

    _inner = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inner:  # parse_known_intermixed_args calls back here, twice
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND", required=True,
                                parser_class=_IntermixedParser)
    p = sub.add_parser("inspect", help="iteration, mesh and tensors (name, shape, dtype) of a checkpoint")
    p.add_argument("path", type=Path, help="checkpoint folder (with the tracker), iter_XXXXXXX folder, "
                                           "or a model_optim_rng.pt file (ours or torch_xla's)")
    p.add_argument("--verify", action="store_true", help="check every file's size and checksum (reads all data)")
    p.add_argument("--json", action="store_true", help="print JSON")

    c = sub.add_parser("convert", help="a checkpoint of ours or of the Neuron reference / Megatron-LM / megatron-core "
                                       "(mp_rank_* or torch_dist) as ours (--to torch|xser, optionally at --tp N --pp "
                                       "M), as megatron-core's torch_dist (--to torch_dist), to a Hugging Face "
                                       "folder (--to hf), or a Hugging Face folder (config.json and weights) as ours")
    c.add_argument("path", type=Path, help="checkpoint folder (the tracker picks the iteration), iter_XXXXXXX folder, "
                                           "or a local Hugging Face model folder (config.json and weights)")
    c.add_argument("--to", required=True, choices=("hf", "torch", "xser", "torch_dist"),
                   help="what to write (torch_dist: megatron-core's format, for Megatron-LM's --ckpt-format torch_dist "
                        "--load)")
    c.add_argument("out", type=Path, nargs="?", help="output folder (or --out)")
    c.add_argument("--out", dest="out_option", type=Path, metavar="OUT", help="output folder")
    c.add_argument("--tp", "--tensor-parallel", dest="tp", type=int,
                   help="write at this TP size (default: the source's); not with --to hf")
    c.add_argument("--pp", "--pipeline-parallel", dest="pp", type=int,
                   help="write at this PP size, layers split evenly (default: the source's); not with --to hf")
    c.add_argument("--vocab-size", type=int, help="the tokenizer's true vocabulary, when a checkpoint of another "
                                                  "trainer records only the padded size")
    c.add_argument("--iteration", type=int, help="convert this iteration instead of the tracker's")
    c.add_argument("--distributed-optimizer", action="store_true",
                   help="with --to torch_dist: Adam's state for a run with --use-distributed-optimizer (its "
                        "fully_reshardable form) instead of plain Adam's")
    _add_read_budget(c, "a checkpoint of ours or a torch_dist one")
    _add_workers(c)
    c.add_argument("--shard-size-gb", type=float, metavar="GB",
                   help="with --to hf: the largest weights file, in GB of 10^9 bytes as transformers' max_shard_size; "
                        "a larger model is written in shards with model.safetensors.index.json, and about one shard "
                        "is held in memory (default: 5, transformers 4's)")
    c.add_argument("--json", action="store_true", help="print JSON")

    r = sub.add_parser("reshard", help="the checkpoint at other tensor- and pipeline-parallel sizes (same iteration)")
    r.add_argument("path", type=Path, help="checkpoint folder or iter_XXXXXXX folder")
    r.add_argument("--tp", "--tensor-parallel", dest="tp", type=int, help="the new TP size (default: the checkpoint's)")
    r.add_argument("--pp", "--pipeline-parallel", dest="pp", type=int,
                   help="the new PP size (default: the checkpoint's)")
    r.add_argument("--virtual-pipeline", type=int, help="model chunks per pipeline rank, as parallel.virtual_pipeline "
                                                        "(default: the checkpoint's without --pp, else 1)")
    r.add_argument("--pipeline-first-stage-layers", type=int, help="layers on the first stage, as "
                   "parallel.pipeline_first_stage_layers (default: the checkpoint's without --pp, else 0: even)")
    r.add_argument("--pipeline-last-stage-layers", type=int, help="layers on the last stage, as "
                   "parallel.pipeline_last_stage_layers (default: the checkpoint's without --pp, else 0: even)")
    r.add_argument("--out", type=Path, help="output checkpoint folder (default: <checkpoint folder>-tp<N>[-pp<M>])")
    r.add_argument("--iteration", type=int, help="reshard this iteration instead of the tracker's")
    _add_read_budget(r, "the checkpoint")
    _add_workers(r)
    r.add_argument("--json", action="store_true", help="print JSON")


def _add_workers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="write the output ranks (--to torch|xser) with N processes side by side, each a run of "
                             "consecutive ranks; each holds its own output rank and read budget, so memory grows "
                             "about N times (default: 1)")


def _workers(args: argparse.Namespace) -> int:
    """--workers, checked before anything is read or written."""
    from megatron_hpc.errors import CheckpointError

    if args.workers < 1:
        raise CheckpointError(f"--workers {args.workers} must be 1 or more; drop it to write one output rank at a "
                              "time, or give up to the number of idle cores")
    return args.workers


def _add_read_budget(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--read-budget-gib", type=float, metavar="GIB",
                        help=f"{what} is read a part at a time, holding about this much of it (plus one layer or "
                             "embedding) at once; parts past it are read again for each output rank or shard that "
                             "needs them (default: 1)")


def format_summary(s: dict[str, Any]) -> str:
    def show(value: Any) -> str:
        return "?" if value is None else str(value)

    lines = [f"checkpoint  {s['path']}"]
    if s.get("family"):
        lines.append(f"written by  {s['family']}" + (f" (checkpoint_version {s['checkpoint_version']})"
                                                     if s.get("checkpoint_version") is not None else ""))
    lines += [f"iteration   {show(s['iteration'])} ({s['format']})",
             f"mesh        tp {show(s['tensor_parallel'])} pp {show(s.get('pipeline_parallel'))}"
             f"{_virtual(s)} dp {show(s['data_parallel'])} world {show(s['world_size'])}"]
    if s.get("files") is not None:
        verified = ", verified" if s.get("verified") else ""
        lines.append(f"files       {s['files']} ({s['bytes']:,} bytes{verified})")
    precision = s.get("precision")
    if precision:
        held = precision.get("weights_hold", "?")
        stored = {r["dtype"] for r in s["tensors"] if r["name"].startswith("model.")}
        note = f", stored as {'/'.join(sorted(stored))}" if stored and stored != {held} else ""
        lines.append(f"precision   {precision.get('train_precision', '?')} (weights hold {held} values{note})")
    rows = s["tensors"]
    width = max((len(r["name"]) for r in rows), default=4)
    lines.append(f"tensors     {len(rows)}")
    staged = (s.get("pipeline_parallel") or 1) > 1
    for r in rows:
        rank = ""
        if "tp_rank" in r:
            rank = f"[tp {r['tp_rank']} pp {r['pp_rank']}] " if staged else f"[tp {r['tp_rank']}] "
        lines.append(f"  {rank}{r['name']:<{width}}  {r['dtype']:<9} {tuple(r['shape'])}")
    return "\n".join(lines)


def _virtual(s: dict[str, Any]) -> str:
    v = s.get("virtual_pipeline")
    return f" (virtual {v})" if v and v > 1 else ""


def run(args: argparse.Namespace) -> int:
    if args.ckpt_command == "convert":
        import torch

        # A convert only moves bytes (copies, casts, checksums, writes): torch's intra-op threads add a barrier to
        # every copy and gain no bandwidth. One thread was faster in 3 of 3 alternating runs of
        # benchmarks/convert_torch_dist_cpu.py's source (14.3-31.4 s against 18.2-37.1 s, a loaded 2-core VM).
        # Restored after: `ckpt convert` also runs inside other processes (tests, notebooks).
        from megatron_hpc.checkpoint.conversion import reused_memory

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with reused_memory():  # freed blocks reused, not faulted in afresh (host_memory.py)
                return _convert(args)
        finally:
            torch.set_num_threads(threads)
    if args.ckpt_command == "reshard":
        return _reshard(args)
    from megatron_hpc.checkpoint.foreign import is_hf_folder
    from megatron_hpc.checkpoint.summary import summarize
    from megatron_hpc.errors import CheckpointError

    if is_hf_folder(args.path):
        raise CheckpointError(f"{args.path} is a Hugging Face model folder, not a Megatron checkpoint; make it one with"
                              f" megatron-hpc ckpt convert {args.path} --to xser --out DIR")
    summary = summarize(args.path, verify=args.verify)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 0


def _out(args: argparse.Namespace) -> Path:
    from megatron_hpc.errors import CheckpointError

    given = [p for p in (args.out, args.out_option) if p is not None]
    if len(given) != 1:
        raise CheckpointError("say once where to write: ckpt convert SRC --to FORMAT --out DIR (or SRC OUT)")
    return given[0]


@dataclass(frozen=True, slots=True)
class _Source:
    whole: Any
    family: str
    notes: list[str]
    streamed: Any = None
    """stream.Source whose weights (and moments) are read as they are fetched (its whole's are meta)."""
    saved: tuple[int, int] | None = None
    """(tp, pp) a source read whole at TP 1 x PP 1 (torch_dist) was saved at."""
    ours: bool = False


def _budget(args: argparse.Namespace) -> int:
    """--read-budget-gib in bytes (default READ_BUDGET); 0 or less is refused in one line."""
    from megatron_hpc.checkpoint.foreign import READ_BUDGET
    from megatron_hpc.errors import CheckpointError

    if args.read_budget_gib is not None and not args.read_budget_gib > 0:
        raise CheckpointError(f"--read-budget-gib {args.read_budget_gib} must be above 0; drop it for the default "
                              f"{READ_BUDGET / 2**30:g}, or give less on a machine short of memory (each part past "
                              "it is read once per output rank)")
    return READ_BUDGET if args.read_budget_gib is None else int(args.read_budget_gib * 2**30)


def _read_source(args: argparse.Namespace) -> _Source:
    """The source with its weights (and moments) read a part at a time as the writer asks (every kind, every --to):
    a torch_dist folder through torch_dist_stream.py, ours through conversion/lazy.py, a legacy Megatron folder
    mapped (torch.load mmap)."""
    from megatron_hpc.checkpoint.conversion import read_lazy
    from megatron_hpc.checkpoint.foreign import (
        foreign_folder,
        import_foreign,
        import_torch_dist,
        is_torch_dist,
        read_foreign,
    )
    from megatron_hpc.checkpoint.store import iteration_dir
    from megatron_hpc.errors import CheckpointError

    source = args.path
    folder = foreign_folder(source if args.iteration is None else iteration_dir(source, args.iteration))
    if folder is not None and is_torch_dist(folder):
        # Every format reads a part at a time (torch_dist_stream.py), --to hf its weights only.
        dist = import_torch_dist(folder, vocab_size=args.vocab_size, stream_budget=_budget(args),
                                 weights_only=args.to == "hf")
        return _Source(dist.imported.whole, dist.imported.family, list(dist.imported.notes),
                       streamed=dist.imported.source, saved=dist.saved[:2])
    if folder is not None:
        _budget(args)  # its check
        imported = import_foreign(read_foreign(folder, mmap=True), vocab_size=args.vocab_size, lazy=True)
        notes = list(imported.notes)
        if args.read_budget_gib is not None:
            notes.append(f"--read-budget-gib does not apply to {imported.family}'s files: they are mapped (torch.load "
                         "mmap), their bytes are the page cache's, which the kernel drops as needed")
        return _Source(imported.whole, imported.family, notes, streamed=imported.source)
    if args.vocab_size is not None:
        raise CheckpointError("--vocab-size is for checkpoints of other trainers; ours record their vocabulary")
    streamed, _ = read_lazy(source, iteration=args.iteration, budget=_budget(args))
    return _Source(streamed.whole, "megatron-hpc", [], streamed=streamed, ours=True)


def _convert(args: argparse.Namespace) -> int:
    from megatron_hpc.errors import CheckpointError

    source, out = args.path, _out(args)
    if args.distributed_optimizer and args.to != "torch_dist":
        raise CheckpointError("--distributed-optimizer chooses the optimizer layout of --to torch_dist; drop it")
    if args.to == "hf" and (args.tp is not None or args.pp is not None):
        raise CheckpointError("--tp and --pp choose the layout of a Megatron checkpoint; a Hugging Face folder has "
                              "none, drop them")
    if args.shard_size_gb is not None and (args.to != "hf" or not args.shard_size_gb > 0):
        raise CheckpointError(f"--shard-size-gb {args.shard_size_gb} sets the file size of --to hf and must be above "
                              "0; drop it for the default 5, or give it with --to hf")
    _workers(args)
    from megatron_hpc.checkpoint.foreign import is_hf_folder

    if is_hf_folder(source):
        return _import_hf(args, out)
    src = _read_source(args)
    whole, notes = src.whole, src.notes
    if args.workers > 1 and args.to in ("hf", "torch_dist"):
        notes.append(f"--workers applies to --to torch and xser (output ranks side by side); --to {args.to} is "
                     "written by one process")
    if args.to == "hf":  # a Hugging Face folder never holds Adam or RNG state: what a resumed run lacks is moot
        notes = [n for n in notes if "a resumed run" not in n]
    # A torch_dist source is read whole at TP 1 x PP 1 and written at the sizes it was saved at unless told.
    from_tp, from_pp = src.saved or (whole.tensor_parallel, whole.pipeline_parallel)
    tp, pp = from_tp if args.tp is None else args.tp, from_pp if args.pp is None else args.pp
    report = {"source": str(whole.found.folder), "family": src.family, "iteration": whole.iteration, "to": args.to,
              "out": str(out), "from_tp": from_tp, "from_pp": from_pp}
    if args.to != "hf":  # the export writes fp32 whatever the source held
        report["weights_dtype"] = _weights_dtype(whole)
    from megatron_hpc.checkpoint.conversion import stream
    from megatron_hpc.checkpoint.foreign import SHARD_BYTES, export_torch_dist

    if args.to in ("torch_dist", "hf"):
        # The exports take the model whole (TP 1 x PP 1): a source at other sizes is put together a tensor at a
        # time as they fetch it, a part (a decoder layer, or one other key) at a time.
        one = stream.merged(src.streamed)
        whole = one.whole
    if args.to == "torch_dist":
        # Written a part at a time as it is read (torch_dist_write.py).
        exported = export_torch_dist(whole, out, tp=tp, pp=pp, distributed=args.distributed_optimizer, source=one)
        written, report["optimizer"] = exported.folder, exported.optimizer
        notes += exported.notes
    elif args.to == "hf":
        shard = SHARD_BYTES if args.shard_size_gb is None else int(args.shard_size_gb * 10**9)
        written, report["tokenizer"] = _export_hf(whole, out, source=one, max_shard_bytes=shard)
        tp, pp = src.whole.tensor_parallel, src.whole.pipeline_parallel
    elif src.ours and args.tp is None and args.pp is None:
        from megatron_hpc.checkpoint.conversion import convert_lazy

        written = convert_lazy(src.streamed, to=args.to, out=out)
        if args.workers > 1:
            notes.append("--workers applies where the sizes change (--tp or --pp); a change of format alone is "
                         "written by one process")
    else:
        # One output rank at a time; the source's weights are fetched as they are needed and released after.
        result = stream.reshard(src.streamed, tp=tp, pp=pp, out=out, fmt=args.to, workers=args.workers)
        written, report["optimizer"] = result.folder, result.optimizer
        if result.note and not any("Adam" in n for n in notes):
            notes.append(result.note)
    report.update(tensor_parallel=tp, pipeline_parallel=pp, written=str(written), notes=notes)
    _print_converted(args, report)
    return 0


def _print_converted(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        out, tp, pp = report["out"], report["tensor_parallel"], report["pipeline_parallel"]
        sets = "" if args.to == "hf" else (f"; continue from it with checkpoint.load={out} parallel.tensor={tp} "
                                          f"parallel.pipeline={pp}")
        if args.to == "torch_dist":
            sets = (f"; continue from it with Megatron-LM's --ckpt-format torch_dist --load {out} "
                    f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}")
        at = "" if args.to == "hf" else f" at tp {tp} x pp {pp}"
        kept = "" if args.to == "hf" else f", weights in {report['weights_dtype']}"
        print(f"converted {report['source']} ({report['family']}, iteration {report['iteration']}, tp "
              f"{report['from_tp']} x pp {report['from_pp']}) to {args.to}{at}{kept}: {report['written']}{sets}")
    for note in report["notes"]:
        print(f"megatron-hpc: warning: {note}", file=sys.stderr)


def _weights_dtype(whole: Any) -> str:
    """The dtype(s) the written weights keep: a source's fp32 masters where it has them, else its own weights'."""
    kinds = {str(w.dtype).removeprefix("torch.") for row in whole.grid for s in row for w in s["model"].values()}
    return ",".join(sorted(kinds))


def _import_hf(args: argparse.Namespace, out: Path) -> int:
    """A Hugging Face model folder as our checkpoint at --tp x --pp (default 1 x 1), weights only, iteration 0."""
    from megatron_hpc.checkpoint.conversion import stream
    from megatron_hpc.checkpoint.foreign import copy_tokenizer, import_hf
    from megatron_hpc.errors import CheckpointError

    source = args.path
    if args.to == "hf":
        raise CheckpointError(f"{source} is already a Hugging Face folder; convert it --to xser or --to torch")
    for flag, value in (("--iteration", args.iteration), ("--vocab-size", args.vocab_size)):
        if value is not None:
            raise CheckpointError(f"{flag} is for Megatron checkpoints; {source} is a Hugging Face folder, whose "
                                  "config.json says both, drop it")
    imported = import_hf(source, out=out, fmt=args.to)
    tp, pp = (1 if v is None else v for v in (args.tp, args.pp))
    # One output rank at a time; the weights are released as they are used (not read again).
    result = stream.reshard(stream.in_memory(imported.whole), tp=tp, pp=pp, out=out, fmt=args.to,
                            workers=args.workers)
    tokenizer = copy_tokenizer(imported.tokenizer, out)
    resolved = imported.whole.first["resolved_config"]
    model = resolved["model"]
    # Every key a run needs to take it as it is, pasted after `submit --recipe R`: the model, the mesh and the
    # tokenizer files copied beside it.
    # Absolute, as the tokenizer's path is: the line is pasted where the user is then, not necessarily here.
    sets = [f"checkpoint.load={Path(out).absolute()}", "checkpoint.finetune=true", f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}",
            # The Llama and Qwen recipes turn sequence parallelism on, which needs TP above 1: at TP 1 (and any MQA
            # model, whose one group TP cannot split) the line would not plan after them.
            *(["parallel.sequence_parallel=false"] if tp == 1 else []),
            *(f"model.{k}={v}" for k, v in model.items() if v is not None),
            *(f"data.{k}={v}" for k, v in resolved["data"].items())]
    report = {"source": str(source), "family": "huggingface", "architecture": imported.architecture, "iteration": 0,
              "to": args.to, "out": str(out), "tensor_parallel": tp, "pipeline_parallel": pp,
              "written": str(result.folder), "weights": [str(p) for p in imported.weights],
              "tokenizer": [str(p) for p in tokenizer] or None, "model": model, "sets": sets,
              "notes": imported.notes}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"imported {source} ({imported.architecture}) to {args.to} at tp {tp} x pp {pp}: {result.folder}; "
              f"fine-tune from it with {' '.join(f'--set {shlex.quote(s)}' for s in sets)}")
    for note in imported.notes:
        print(f"megatron-hpc: warning: {note}", file=sys.stderr)
    return 0


def _export_hf(whole: Any, out: Path, **weights: Any) -> tuple[Path, list[str] | None]:
    """The model, and the run's tokenizer when it has one (else a note on stderr): the weights file (or the shards'
    index) and the tokenizer files written (None without a tokenizer). `weights`: export_hf's source and
    max_shard_bytes."""
    from megatron_hpc.checkpoint.conversion import hf_tokenizer_files, tokenizer_files
    from megatron_hpc.checkpoint.foreign import export_hf
    from megatron_hpc.data.tokenizer import EOD_TOKEN, GPT2BPETokenizer
    from megatron_hpc.errors import DataError

    files = tokenizer_files(whole)
    model = whole.first["resolved_config"]["model"]
    tok = None
    if not isinstance(files, str):
        try:
            tok = GPT2BPETokenizer(*files)
        except DataError as exc:
            files = str(exc)
        else:
            if tok.vocab_size > model["vocab_size"]:
                files = f"{files[0]} has {tok.vocab_size} tokens but the model only {model['vocab_size']}"
    if isinstance(files, str) and hf_tokenizer_files(whole):
        return _export_hf_with_tokenizer_json(whole, out, **weights)
    if isinstance(files, str) or tok is None:
        written = export_hf(whole, out, **weights)  # first: a failed export is one error line, without the note
        # GPT-2's files fit a GPT2LMHeadModel only; a Llama or Qwen2 export wants its own tokenizer's files
        gpt2 = json.loads((out / "config.json").read_text()).get("model_type") == "gpt2"
        add = ("GPT-2 vocab.json and merges.txt" if gpt2 else
               "the model's tokenizer files (tokenizer.json and tokenizer_config.json, or tokenizer.model)")
        print(f"megatron-hpc: note: no tokenizer files written: {files}; {out} holds the model only (add {add} to "
              "it for transformers.AutoTokenizer)", file=sys.stderr)
        return written, None
    written = export_hf(whole, out, eos_token_id=tok.vocab.get(EOD_TOKEN), **weights)
    return written, [str(p) for p in tok.save_hf(out, model_max_length=model["max_position_embeddings"])]


def _export_hf_with_tokenizer_json(whole: Any, out: Path, **weights: Any) -> tuple[Path, list[str]]:
    """The model with the run's tokenizer.json (HuggingFaceTokenizer) and its settings, or Llama 2's
    tokenizer.model (Llama2Tokenizer), copied as they are."""
    import shutil

    from megatron_hpc.checkpoint.conversion import hf_tokenizer_files
    from megatron_hpc.checkpoint.foreign import export_hf
    from megatron_hpc.data.hf_tokenizer import HuggingFaceTokenizer
    from megatron_hpc.data.text_tokenizers import build_tokenizer, tokenizer_spec
    from megatron_hpc.errors import CheckpointError, DataError

    files = hf_tokenizer_files(whole)
    model = whole.first["resolved_config"]["model"]
    try:
        if files[0].name == "tokenizer.model":  # SentencePiece: transformers' LlamaTokenizer reads it alone
            tok: Any = build_tokenizer(tokenizer_spec("Llama2Tokenizer", model=str(files[0])))
        else:
            tok = HuggingFaceTokenizer(files[0].parent if len(files) > 1 else files[0])
    except DataError as exc:
        raise CheckpointError(f"the run's tokenizer cannot be exported ({exc})") from None
    try:
        eod: int | None = tok.eod
    except DataError:  # no EOS token: config.json then names the last id, as without a tokenizer
        eod = None
    if tok.vocab_size > model["vocab_size"]:
        raise CheckpointError(f"the run's {files[0]} has {tok.vocab_size} tokens but the model only "
                              f"{model['vocab_size']}; it is not this model's tokenizer")
    written = export_hf(whole, out, eos_token_id=eod, token_ids=_generation_ids(files), **weights)
    return written, [shutil.copyfile(p, out / p.name) for p in files]


def _generation_ids(files: list[Path]) -> dict[str, Any]:
    """bos_token_id and eos_token_id of an imported model's generation_config.json among `files`, for its
    config.json (transformers' generate reads either); empty without one or when it cannot be read."""
    for path in files:
        if path.name == "generation_config.json":
            try:
                given = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                return {}
            keys = ("bos_token_id", "eos_token_id")
            return {k: given[k] for k in keys if isinstance(given, dict) and given.get(k) is not None}
    return {}


def _reshard(args: argparse.Namespace) -> int:
    from megatron_hpc.checkpoint.conversion import read_lazy, stream
    from megatron_hpc.checkpoint.store import PipelineLayout, reshard_out
    from megatron_hpc.errors import CheckpointError

    if args.tp is None and args.pp is None:
        raise CheckpointError("say what to reshard to: --tp N and/or --pp M (an omitted one keeps the checkpoint's)")
    workers = _workers(args)
    # Read a tensor at a time as the output ranks need it (conversion/lazy.py), --read-budget-gib held at most.
    source, _ = read_lazy(args.path, iteration=args.iteration, budget=_budget(args))
    whole = source.whole
    # Without --pp the checkpoint's pipeline layout is kept; with it, the stages split evenly unless told otherwise.
    keep = whole.layout if args.pp is None else PipelineLayout(pipeline=args.pp)
    given = (args.virtual_pipeline, args.pipeline_first_stage_layers, args.pipeline_last_stage_layers)
    virtual, first, last = (keep_value if value is None else value for value, keep_value in
                            zip(given, (keep.virtual, keep.first_stage_layers, keep.last_stage_layers)))
    layout = PipelineLayout(pipeline=keep.pipeline, virtual=virtual, first_stage_layers=first, last_stage_layers=last)
    tp = whole.tensor_parallel if args.tp is None else args.tp
    out = args.out or reshard_out(whole.found.folder, tensor_parallel=tp, layout=layout)
    # One output rank at a time; the source's weights are released after their last use.
    result = stream.reshard(source, tp=tp, pp=layout.pipeline, virtual=layout.virtual,
                            first_stage_layers=layout.first_stage_layers, last_stage_layers=layout.last_stage_layers,
                            out=out, workers=workers)
    report = {"source": str(whole.found.folder), "iteration": whole.iteration, "from_tp": result.from_tp,
              "to_tp": result.to_tp, "from_pp": result.from_pp, "to_pp": result.to_pp,
              "virtual_pipeline": layout.virtual, "out": str(out), "optimizer": result.optimizer}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        sets = f"parallel.tensor={tp} parallel.pipeline={layout.pipeline}"
        if layout.virtual > 1:
            sets += f" parallel.virtual_pipeline={layout.virtual}"
        if layout.first_stage_layers:
            sets += f" parallel.pipeline_first_stage_layers={layout.first_stage_layers}"
        if layout.last_stage_layers:
            sets += f" parallel.pipeline_last_stage_layers={layout.last_stage_layers}"
        print(f"resharded {whole.found.folder} from tp {result.from_tp} x pp {result.from_pp} to tp {result.to_tp} x "
              f"{layout.describe()}: {result.folder} (optimizer {result.optimizer}); resume with "
              f"checkpoint.load={out} and {sets}")
    if result.note:
        print(f"megatron-hpc: warning: {result.note}", file=sys.stderr)
    return 0
