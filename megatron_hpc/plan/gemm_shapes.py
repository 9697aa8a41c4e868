"""The matrix products one TP rank runs for one micro-batch: what the step-time model's compute term costs and what
`megatron-hpc tune`'s GEMM micro-benchmark times. Pure.

Legend: T = b*s tokens of a micro-batch, h hidden, f FFN width, q the fused QKV rows, w = heads x head dim, t TP,
V padded vocabulary, n_h attention heads, d head dim. A product (batch, m, k, n) multiplies (m, k) by (k, n),
`batch` times, in 2*batch*m*k*n FLOPs.

Forward, per layer: QKV (T, h) x (h, q/t); attention output projection (T, w/t) x (w/t, h); the MLP's up (and
SwiGLU's gate) (T, h) x (h, f/t) and down (T, f/t) x (f/t, h); the attention core's scores (b*n_h/t batches of
(s, d) x (d, s)) and their product with the values ((s, s) x (s, d)). The last stage's output layer
(T, h) x (h, V/t). The backward of a product (m, k, n) runs its input gradient (m, n) x (n, k) and its weight
gradient (k, m) x (m, n): twice its FLOPs, as the model counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.plan.model_math import mlp_matrices, qkv_rows


@dataclass(frozen=True, slots=True, order=True)
class GemmShape:
    """One matrix product: `batch` products of (m, k) by (k, n)."""

    batch: int
    m: int
    k: int
    n: int

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.k * self.n


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGemms:
    """One micro-batch's forward products on one TP rank."""

    linears: tuple[GemmShape, ...]
    """One layer's projections: QKV, attention output, MLP up (and gate), MLP down."""
    core: tuple[GemmShape, ...]
    """One layer's attention core: scores, then scores by values."""
    output: GemmShape
    """The last stage's output layer."""

    def all(self) -> tuple[GemmShape, ...]:
        return (*self.linears, *self.core, self.output)


def rank_gemms(model: ModelConfig, *, micro_batch: int, tensor_parallel: int, padded_vocab: int) -> RankGemms:
    """The forward products of one micro-batch on one rank of a TP group of `tensor_parallel` (module docstring)."""
    t, h, s = tensor_parallel, model.hidden_size, model.seq_length
    tokens, width, ffn = micro_batch * s, model.num_attention_heads * model.head_dim // t, model.ffn_size // t
    up = [GemmShape(1, tokens, h, ffn)] * (mlp_matrices(model) - 1)  # up, and SwiGLU's gate
    linears = (GemmShape(1, tokens, h, qkv_rows(model) // t), GemmShape(1, tokens, width, h), *up,
               GemmShape(1, tokens, ffn, h))
    heads = micro_batch * model.num_attention_heads // t
    core = (GemmShape(heads, s, model.head_dim, s), GemmShape(heads, s, s, model.head_dim))
    return RankGemms(linears=linears, core=core, output=GemmShape(1, tokens, h, padded_vocab // t))


def backward_of(shape: GemmShape) -> tuple[GemmShape, GemmShape]:
    """The input-gradient and weight-gradient products of `shape`'s backward (module docstring)."""
    return (GemmShape(shape.batch, shape.m, shape.n, shape.k), GemmShape(shape.batch, shape.k, shape.m, shape.n))


def benchmark_shapes(per_candidate: list[RankGemms]) -> list[GemmShape]:
    """Every distinct product, forward and backward, of the candidates: what tune's GEMM micro-benchmark times."""
    found = set()
    for gemms in per_candidate:
        for shape in gemms.all():
            found.update((shape, *backward_of(shape)))
    return sorted(found)
