"""JSONL -> Megatron `.bin/.idx`, byte for byte what Megatron's tools/preprocess_data.py writes.

Behaviour matched (tools/preprocess_data.py at core_v0.16.1, shared/reference/megatron-and-launchers.md 1.2, 1.5):
one JSON line is one document; a string value is one sequence, a list of strings is one
sequence per non-empty string; `--append-eod` appends the EOD id to the last sequence of every
non-empty document; an empty document is still written (a document with no sequences); the
token dtype is uint16 below 65500 vocab entries, else int32; outputs are
`{prefix}_{key}_document.{bin,idx}`. Lines are read as Megatron reads them (jsonl.py). The tokenizer is any of
text_tokenizers.py (GPT-2 BPE, Hugging Face tokenizer.json, SentencePiece), with Megatron's vocabulary size and EOD.

`split_sentences` (sentences.py) makes every sentence of a text one sequence and names the outputs
`{prefix}_{key}_sentence`, as Megatron does. Megatron's tool needs two runs for that (the first writes
`{input}_ss.jsonl` next to the input and stops; the second encodes it); this writes the same output in one run and
nothing next to the input. A list of strings is split string by string (Megatron's tool stops on a list there).

Where Megatron crashes (a blank line, bad JSON or UTF-8, a missing key, a value that is not
text), we skip the whole line for every key, report its line number, and `strict=True` makes
it fatal instead.

Speed: with `workers` > 1, that many processes parse and tokenize batches of about BATCH_CHARS
characters while this one reads, hands out and writes. Tokens come from the word-caching encoder of
fast_encode.py (the ids of the `tokenizers` pipeline, several times faster), and each batch comes back
as one bytes object per key plus its sequence lengths, written with one call per batch and key.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from megatron_hpc.data.indexed import IndexedDatasetWriter, optimal_dtype
from megatron_hpc.data.jsonl import open_jsonl
from megatron_hpc.data.text_tokenizers import (
    BulkEncoder,
    TextTokenizer,
    TokenizerSpec,
    build_tokenizer,
    tokenizer_spec,
)
from megatron_hpc.errors import DataError

BATCH_CHARS = 1 << 19
"""Characters of input per batch handed to a worker (large enough to amortise the hand-over, small enough that
the workers finish together)."""
BATCH_LINES = 4096
_BAD_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that surrogateescape could not decode
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_REPORTED = 20


def output_prefix_for(output_prefix: str | os.PathLike[str], key: str, *, split_sentences: bool = False) -> str:
    """Megatron's output name without extension: `{prefix}_{key}_document` (`_sentence` when split)."""
    return f"{os.fspath(output_prefix)}_{key}_{'sentence' if split_sentences else 'document'}"


def _parse(line: str, keys: Sequence[str]) -> dict[str, list[str]] | str:
    """Sentences per key, or why the line is skipped. isascii() is O(1) and spares most lines the scans."""
    if line.isspace() or not line:
        return "blank line"
    if not line.isascii() and _BAD_UTF8.search(line):
        return "not valid UTF-8"
    try:
        data = json.loads(line)
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    if not isinstance(data, dict):
        return f"not a JSON object (a {type(data).__name__})"
    out = {}
    for key in keys:
        if key not in data:
            return f"has no key {key!r} (keys: {', '.join(map(str, list(data)[:8]))})"
        value = data[key]
        sentences = value if isinstance(value, list) else [value]
        if not all(isinstance(s, str) for s in sentences):
            return f"{key!r} is a {type(value).__name__}, expected a string or a list of strings"
        if any(not s.isascii() and _SURROGATE.search(s) for s in sentences):
            return f"{key!r} holds a lone surrogate escape, which is not valid Unicode"
        out[key] = sentences
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitOptions:
    """--split-sentences with its --lang and --keep-newlines."""

    lang: str = "english"
    keep_newlines: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class _Job:
    tokenizer: TokenizerSpec
    keys: tuple[str, ...]
    append_eod: bool
    dtype: str
    split: SplitOptions | None = None

    def encoder(self, tokenizer: TextTokenizer | None = None) -> _Encoder:
        """What this process encodes with (a pool worker builds its own tokenizer; the main process passes its)."""
        tokenizer = tokenizer or build_tokenizer(self.tokenizer)
        eod = np.asarray([tokenizer.eod], dtype=self.dtype).tobytes() if self.append_eod else None
        splitter = None
        if self.split is not None:
            from megatron_hpc.data.sentences import sentence_splitter

            splitter = sentence_splitter(lang=self.split.lang, keep_newlines=self.split.keep_newlines)
        return _Encoder(tokenizer.bulk_encoder(np.dtype(self.dtype)), eod, splitter)


@dataclass(frozen=True, slots=True)
class _Encoder:
    tokens: BulkEncoder
    eod: bytes | None
    """The EOD id as token bytes when --append-eod."""
    split: Callable[[str], list[str]] | None


@dataclass(frozen=True, slots=True)
class _Encoded:
    """One batch of lines, encoded: per key, the tokens of all its documents back to back."""

    skipped: list[tuple[int, str]]
    num_documents: int
    tokens: dict[str, bytes]
    sequence_lengths: dict[str, list[int]]
    sequences_per_document: dict[str, list[int]]


_WORKER: tuple[_Job, _Encoder] | None = None  # per worker process, set by _init_worker


def _init_worker(job: _Job) -> None:
    global _WORKER
    # A forked worker inherits the parent's Python signal handlers (a trainer's stop handler, say); a handler
    # that only sets a flag would keep it waiting for work after Pool.terminate() and hang the parent.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # N processes already; no threads inside each
    _WORKER = (job, job.encoder())


def _encode_in_worker(first_line: int, lines: list[str]) -> _Encoded:
    assert _WORKER is not None, "worker not initialised"
    return _encode_batch(*_WORKER, first_line, lines)


def _encode_batch(job: _Job, encoder: _Encoder, first_line: int, lines: list[str]) -> _Encoded:
    """Lines first_line, first_line + 1, ... parsed, tokenized and laid out as Megatron's tool writes them."""
    skipped: list[tuple[int, str]] = []
    documents: list[dict[str, list[str]]] = []
    for number, line in enumerate(lines, start=first_line):
        parsed = _parse(line, job.keys)
        if isinstance(parsed, str):
            skipped.append((number, parsed))
        else:
            documents.append(parsed if encoder.split is None else _split(parsed, encoder.split))
    texts = [s for doc in documents for key in job.keys for s in doc[key]]
    encoded = iter(encoder.tokens.encode(texts))
    eod = encoder.eod
    itemsize = np.dtype(job.dtype).itemsize
    parts: dict[str, list[bytes]] = {key: [] for key in job.keys}
    lengths: dict[str, list[int]] = {key: [] for key in job.keys}
    counts: dict[str, list[int]] = {key: [] for key in job.keys}
    for doc in documents:
        for key in job.keys:
            doc_parts, doc_lengths, before = parts[key], lengths[key], len(lengths[key])
            for _ in doc[key]:
                sentence = next(encoded)
                if sentence:  # Megatron drops sentences that tokenize to nothing
                    doc_parts.append(sentence)
                    doc_lengths.append(len(sentence) // itemsize)
            if eod is not None and len(doc_lengths) > before:  # EOD ends every non-empty document
                doc_parts.append(eod)
                doc_lengths[-1] += 1
            counts[key].append(len(doc_lengths) - before)
    return _Encoded(skipped, len(documents), {key: b"".join(p) for key, p in parts.items()}, lengths, counts)


def _split(document: dict[str, list[str]], split: Callable[[str], list[str]]) -> dict[str, list[str]]:
    return {key: [s for text in texts for s in split(text)] for key, texts in document.items()}


@dataclass(kw_only=True, slots=True)
class PreprocessResult:
    prefixes: dict[str, str]
    """json key -> output prefix (no extension)."""
    num_documents: int = 0
    num_tokens: int = 0
    num_empty: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason) of every skipped line."""
    seconds: float = 0.0
    workers: int = 1


class _Progress:
    def __init__(self, stream: TextIO | None, total_bytes: int, interval: float):
        self.stream, self.total, self.interval = stream, total_bytes, interval
        self.start = self.last = time.monotonic()

    def line(self, result: PreprocessResult, done_bytes: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not final and now - self.last < self.interval):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        frac = done_bytes / self.total if self.total else 1.0
        eta = "done" if final else (f"ETA {_hms(elapsed * (1 - frac) / frac)}" if frac > 0 else "ETA ?")
        print(f"preprocess: {result.num_documents:,} docs ({result.num_documents / elapsed:,.0f} docs/s), "
              f"{result.num_tokens:,} tokens ({result.num_tokens / elapsed:,.0f} tokens/s), "
              f"{done_bytes / 2**20:.1f} of {self.total / 2**20:.1f} MiB ({100 * frac:.0f}%), {eta}",
              file=self.stream, flush=True)


def _hms(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _batches(lines: TextIO, raw: object) -> Iterator[tuple[int, list[str], int]]:
    """(number of the first line, lines, input bytes read so far), about BATCH_CHARS characters at a time."""
    batch: list[str] = []
    first = size = 0
    for number, line in enumerate(lines, start=1):
        if not batch:
            first = number
        batch.append(line)
        size += len(line)
        if size >= BATCH_CHARS or len(batch) == BATCH_LINES:
            yield first, batch, raw.tell()
            batch, size = [], 0
    if batch:
        yield first, batch, raw.tell()


def _pool(workers: int, job: _Job):
    if workers <= 1:
        return None
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    return ctx.Pool(workers, initializer=_init_worker, initargs=(job,))


@contextlib.contextmanager
def _pool_closing(pool) -> Iterator[None]:
    """Workers stop after their last batch when the block ends normally (close, join); on an error they are
    terminated, as Pool's own context manager does in both cases."""
    try:
        yield
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


def preprocess(
    input_path: str | os.PathLike[str],
    *,
    output_prefix: str | os.PathLike[str],
    tokenizer: TokenizerSpec | None = None,
    vocab_file: str | os.PathLike[str] | None = None,
    merge_file: str | os.PathLike[str] | None = None,
    tokenizer_type: str = "GPT2BPETokenizer",
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    strict: bool = False,
    progress: TextIO | None = None,
    progress_interval: float = 1.0,
    split: SplitOptions | None = None,
) -> PreprocessResult:
    """Tokenize a JSONL corpus into one `.bin/.idx` pair per key; see the module docstring.

    `workers` > 1 tokenizes in that many processes while this one reads and writes; with 1 everything runs
    here. `progress` (e.g. sys.stderr) gets a rate/ETA line every `progress_interval` seconds and the line
    numbers of skipped lines. `tokenizer` names any tokenizer (text_tokenizers.tokenizer_spec); without it,
    GPT-2 BPE from `vocab_file` and `merge_file`. `split` splits every text into sentences (sentences.py).
    """
    if workers < 1:
        raise DataError(f"--workers {workers}: need at least 1")
    spec = tokenizer or tokenizer_spec(tokenizer_type, vocab_file=vocab_file, merge_file=merge_file)
    keys = tuple(dict.fromkeys(json_keys))
    built = build_tokenizer(spec)
    dtype = optimal_dtype(built.vocab_size)
    job = _Job(tokenizer=spec, keys=keys, append_eod=append_eod, dtype=dtype.str, split=split)
    local = job.encoder(built)  # here too with workers: fails early without an EOD id, nltk or its data
    result = PreprocessResult(prefixes={k: output_prefix_for(output_prefix, k, split_sentences=split is not None)
                                        for k in keys}, workers=workers)
    Path(os.fspath(output_prefix)).parent.mkdir(parents=True, exist_ok=True)
    input_size = Path(input_path).stat().st_size if Path(input_path).is_file() else 0
    meter = _Progress(progress, input_size, progress_interval)
    with contextlib.ExitStack() as stack:
        lines, raw = stack.enter_context(open_jsonl(input_path))
        writers = {k: stack.enter_context(IndexedDatasetWriter(p, dtype=dtype)) for k, p in result.prefixes.items()}
        pool = _pool(workers, job)
        if pool is not None:
            stack.enter_context(_pool_closing(pool))
        pending: collections.deque = collections.deque()

        def drain(limit: int) -> None:
            while len(pending) > limit:
                handle, done_bytes = pending.popleft()
                _write(handle.get() if pool is not None else handle, writers, result, strict=strict,
                       progress=progress)
                meter.line(result, done_bytes)

        for first, batch, done_bytes in _batches(lines, raw):
            if pool is not None:
                handle = pool.apply_async(_encode_in_worker, (first, batch))
            else:
                handle = _encode_batch(job, local, first, batch)
            pending.append((handle, done_bytes))
            drain(2 * workers)
        drain(0)
        if result.num_documents == 0 and any(r.startswith("has no key") for _, r in result.skipped):
            example = next(f"line {n} {r}" for n, r in result.skipped if r.startswith("has no key"))
            missing = next(k for k in keys if any(r.startswith(f"has no key {k!r}") for _, r in result.skipped))
            raise DataError(f"no line of {input_path} has the key {missing!r} ({example}); "
                            f"pass --json-keys with keys the documents have")
        result.seconds = time.monotonic() - meter.start
        meter.line(result, input_size, final=True)
    _report_skipped(result, progress)
    return result


def _write(encoded: _Encoded, writers: dict[str, IndexedDatasetWriter], result: PreprocessResult, *,
           strict: bool, progress: TextIO | None) -> None:
    if encoded.skipped and strict:
        number, reason = encoded.skipped[0]
        raise DataError(f"line {number}: {reason}; fix or remove it, or drop --strict to skip such lines")
    for number, reason in encoded.skipped:
        result.skipped.append((number, reason))
        if progress is not None and len(result.skipped) <= _MAX_REPORTED:
            print(f"preprocess: line {number} skipped: {reason}", file=progress)
    result.num_documents += encoded.num_documents
    for key, writer in writers.items():
        tokens = np.frombuffer(encoded.tokens[key], dtype=writer.dtype)
        writer.add_documents(tokens, encoded.sequence_lengths[key],
                             sequences_per_document=encoded.sequences_per_document[key])
        result.num_tokens += len(tokens)
        result.num_empty += encoded.sequences_per_document[key].count(0)


def _report_skipped(result: PreprocessResult, progress: TextIO | None) -> None:
    if progress is None or not result.skipped:
        return
    numbers = ", ".join(str(n) for n, _ in result.skipped[:50])
    more = f" and {len(result.skipped) - 50} more" if len(result.skipped) > 50 else ""
    print(f"preprocess: warning: skipped {len(result.skipped)} line(s): {numbers}{more} "
          f"(use --strict to stop at the first)", file=progress)
