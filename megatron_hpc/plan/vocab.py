"""Vocabulary padding. Pure.

Megatron pads the embedding table to a multiple of make_vocab_size_divisible_by * TP so every
TP shard has the same number of rows (shared/reference/megatron-and-launchers.md 4.3:
GPT-2's 50257 becomes 50304 at TP1 and 51200 at TP8).
"""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tensor_parallel: int) -> int:
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple
