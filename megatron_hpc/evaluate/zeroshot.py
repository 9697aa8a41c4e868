"""Megatron's zero-shot tasks end to end (tasks/zeroshot_gpt/evaluate.py, Megatron-LM fb13c1de21^): a file, a
tokenizer and a whole model in, the task's figures out.

WikiText: avg loss = loss sum / (tokens - 1), token PPL = exp(avg loss); word PPL ("adjusted ppl") =
exp(loss sum / (words - 1)), i.e. avg loss times the token ratio (tokens - 1) / (words - 1). Both exponents are
capped at 20 as Megatron caps them. LAMBADA: an example is correct when every target token is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.data.tokenizer import GPT2BPETokenizer
from megatron_hpc.evaluate.detokenize import wikitext_detokenize
from megatron_hpc.evaluate.perplexity import capped_ppl
from megatron_hpc.evaluate.scoring import Scorer, cloze_hits, windowed_loss_sum
from megatron_hpc.evaluate.tasks import lm_windows, read_cloze_examples, read_lm_document


@dataclass(frozen=True, kw_only=True, slots=True)
class WikitextResult:
    loss_sum: float
    tokens: int
    """Tokens of the detokenized text (Megatron's num_tokenized_tokens); tokens - 1 are scored."""
    words: int
    """Space-separated words of the raw text (Megatron's num_original_tokens)."""
    stride: int

    @property
    def avg_loss(self) -> float:
        return self.loss_sum / (self.tokens - 1)

    @property
    def token_ppl(self) -> float:
        return capped_ppl(self.avg_loss)

    @property
    def word_loss(self) -> float:
        """The loss per word: avg loss times the token ratio (tokens - 1) / (words - 1)."""
        return self.loss_sum / max(self.words - 1, 1)

    @property
    def word_ppl(self) -> float:
        return capped_ppl(self.word_loss)


@dataclass(frozen=True, kw_only=True, slots=True)
class LambadaResult:
    correct: int
    total: int
    strict: bool

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


def evaluate_wikitext(model: Scorer, tokenizer: GPT2BPETokenizer, path: Path, *, seq_length: int,
                      stride: int | None, batch_size: int) -> WikitextResult:
    """Windowed perplexity of a WikiText-style file; `stride` None is seq_length (Megatron's default)."""
    stride = seq_length if stride is None else stride
    doc = read_lm_document(path, encode=tokenizer.encode, detokenize=wikitext_detokenize)
    windows = lm_windows(len(doc.tokens), seq_length=seq_length, stride=stride)
    loss_sum, scored = windowed_loss_sum(model, doc.tokens, windows, batch_size=batch_size)
    assert scored == len(doc.tokens) - 1, f"windows scored {scored} of {len(doc.tokens) - 1} targets"
    return WikitextResult(loss_sum=loss_sum, tokens=len(doc.tokens), words=doc.num_words, stride=stride)


def evaluate_lambada(model: Scorer, tokenizer: GPT2BPETokenizer, path: Path, *, seq_length: int, strict: bool,
                     batch_size: int) -> LambadaResult:
    """Last-word accuracy over a LAMBADA-style JSON lines file."""
    examples = read_cloze_examples(path, encode=tokenizer.encode, strict=strict, seq_length=seq_length)
    hits = cloze_hits(model, examples, batch_size=batch_size)
    return LambadaResult(correct=sum(hits), total=len(hits), strict=strict)
