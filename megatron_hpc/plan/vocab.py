"""Vocabulary padding. Pure.

Megatron pads the embedding table to a multiple of make_vocab_size_divisible_by * TP so every
TP shard has the same number of rows (shared/reference/megatron-and-launchers.md 4.3:
GPT-2's 50257 becomes 50304 at TP1 and 51200 at TP8).

GPT-NeoX pads the same way (megatron/tokenizer/tokenizer.py::_vocab_size_with_padding: round up to a multiple of
make_vocab_size_divisible_by * model-parallel size). Its released checkpoints therefore already hold padded rows:
Pythia 6.9B and NeoX 20B, trained at TP 2 with the default 128, ship 50432 rows for the tokenizer's 50277 ids. The
NeoX recipes (pythia_6.9b, neox_20b) take those 50432 rows as vocab_size with a divisor of 32, so that TP 8 pads
nothing more (8 x 32 = 256 divides 50432) and the checkpoints load row for row.
"""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tensor_parallel: int) -> int:
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple
