"""Checks of a recipe's data made before anything is queued (every prefix of the blend opens), and the summary
of what a run will train on that `plan` and `submit` print.

Opening an IndexedDataset validates the whole index against the .bin size (a few milliseconds
for millions of documents), so a missing, truncated or foreign file fails at `submit` time
instead of after the job waited in the queue. numpy only; no torch. numpy and the readers are imported where
files are read, so `plan` and `submit` of a run without .bin/.idx files never import them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_hpc.config.schema import DataConfig
from megatron_hpc.errors import DataError

DEMO_DIR = Path("~/.cache/megatron-hpc/demo")


def check_data(data: DataConfig, *, source: str) -> None:
    """Raise DataError with a fix when the data of an indexed run (the plan's data_source) cannot be read."""
    if source != "indexed":
        return
    if not data.path:
        raise DataError("data.source is indexed but data.path is not set; use --set data.path=PREFIX "
                        "(the .bin/.idx prefix) or --set data.source=synthetic")
    from megatron_hpc.data.blending import parse_blend
    from megatron_hpc.data.indexed import IndexedDataset

    blend = parse_blend(data.path)
    for prefix in blend.prefixes:
        try:
            IndexedDataset(prefix)
        except DataError as exc:
            if Path(prefix).expanduser().parent == DEMO_DIR.expanduser():
                raise DataError(f"{exc}. Build the demo data first: megatron-hpc data demo") from None
            raise


def check_tokenizer_vocabulary(data: DataConfig, *, vocab_size: int) -> str | None:
    """Refuse a model.vocab_size smaller than the vocabulary of the tokenizer data.* names (DataError, one line).

    Returns why nothing was checked when the recipe names tokenizer files that cannot be read here (None when it
    names none, or when the vocabulary fits). Building the tokenizer reads its files only (milliseconds).
    """
    from megatron_hpc.data.text_tokenizers import build_tokenizer, tokenizer_spec

    if not (data.vocab_file or data.tokenizer_model):
        return None
    try:
        spec = tokenizer_spec(data.tokenizer_type, vocab_file=data.vocab_file, merge_file=data.merge_file,
                              model=data.tokenizer_model)
        tokenizer = build_tokenizer(spec)
    except DataError as exc:
        return f"the tokenizer of data.* was not checked against model.vocab_size: {exc}"
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"model.vocab_size {vocab_size} is smaller than the {tokenizer.vocab_size} ids of the "
                        f"tokenizer {spec.describe()}: its ids past {vocab_size - 1} would have no embedding row; "
                        f"use --set model.vocab_size={tokenizer.vocab_size} (the planner pads it)")
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSummary:
    """What a run will train on, for the `data` line of `plan` and `submit` (and their --json)."""

    source: str
    """indexed, synthetic or missing (the plan's data_source)."""
    path: str | None = None
    """data.path as given (a prefix or a blend)."""
    tokens: int | None = None
    """Tokens in every prefix of the blend together."""
    train_tokens: int | None = None
    """Tokens in the train split (data.split) of every prefix together."""
    tokens_needed: int = 0
    """Tokens the run phase reads: train.num_steps x global batch x seq_length."""
    epochs: float | None = None
    """Passes over the train split (the most of any prefix of a blend)."""

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def line(self) -> str:
        need = f"the run reads {_count(self.tokens_needed)} tokens"
        if self.source == "synthetic":
            return f"SYNTHETIC tokens (data.source=synthetic), not real data; {need}"
        if self.source == "missing":
            return "none: no data.path (submit refuses; set --set data.path=PREFIX or data.source=synthetic)"
        if self.tokens is None:
            return f"indexed {self.path} (not readable here); {need}"
        return (f"indexed {self.path}: {_count(self.tokens)} tokens, {_count(self.train_tokens or 0)} in the train "
                f"split; {need}, {self.epochs:.2f} epoch(s)")


def _count(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def summarize_data(data: DataConfig, *, source: str, seq_length: int, num_samples: int) -> DataSummary:
    """The data line's numbers; tokens stay None when the files cannot be read here (check_data says why)."""
    needed = num_samples * seq_length
    if source != "indexed" or not data.path:
        return DataSummary(source=source, path=data.path, tokens_needed=needed)
    import numpy as np

    from megatron_hpc.data.blending import normalize, parse_blend
    from megatron_hpc.data.gpt_dataset import split_matrix, split_sequences
    from megatron_hpc.data.indexed import IndexedDataset

    blend = parse_blend(data.path)
    bookend = split_matrix(data.split)[0]
    totals, trains = [], []
    try:
        for prefix in blend.prefixes:
            dataset = IndexedDataset(prefix)
            totals.append(dataset.num_tokens)
            train = split_sequences(len(dataset), bookend) if bookend is not None else np.zeros(0, dtype=np.int32)
            trains.append(int(dataset.sequence_lengths[train].sum(dtype=np.int64)))
    except DataError:
        return DataSummary(source=source, path=data.path, tokens_needed=needed)
    # A weighted blend draws each prefix by its weight; an unweighted one by its size, which is one epoch rate.
    weights = normalize(blend.weights) if blend.weights is not None else [t / max(1, sum(trains)) for t in trains]
    epochs = max((w * needed / t if t else math.inf) for w, t in zip(weights, trains)) if trains else None
    return DataSummary(source=source, path=data.path, tokens=sum(totals), train_tokens=sum(trains),
                       tokens_needed=needed, epochs=epochs)
