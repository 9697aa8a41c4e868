"""Incremental forward of our GPT with a key/value cache: prefill the prompts once, then one token per step.

It reuses the model's own submodules (embeddings, LayerNorms, the TP linears) but not GPT.forward, so the
training path stays exactly as it was. Each TP rank caches the keys and values of its own heads only.

Batched prompts of different lengths are LEFT-padded: every row's next token then sits in the same, last
column, and one step appends one column for all rows. A row's positions count from its first real token
(learned positions and rotary offsets alike), and its padding columns are masked out as keys. A padding
column still attends to itself, so that its (unused) hidden states stay finite: a query with every key
masked would give NaN, and NaN values times a zero attention weight would leak into the real rows.

On XLA every step has the same shapes, so that the prefill compiles one graph and every decode step shares
another, whatever the number of new tokens: the columns a step writes come in as device data (not as constants in
the graph), the keys and values are written with index_copy_, and attention reads the whole preallocated cache with a
mask over all of its columns (the unwritten ones are masked as future keys; they hold zeros, never garbage that
could be NaN). Elsewhere a step reads only the filled columns, which is less work, and a decode step (one new
column) runs through decode_step, cached_forward's arithmetic without its per-step overhead.

Shape legend: B batch, S new tokens this step, L cached length (capacity), H hidden, nh/tp local heads,
hd head dim, V/tp this rank's vocabulary shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_hpc.model.gpt import GPT, MLP, expand_groups
from megatron_hpc.model.rotary import rotate
from megatron_hpc.parallel.layers import RowParallelLinear


@dataclass(kw_only=True, slots=True)
class KVCache:
    keys: list[torch.Tensor]
    """One (B, G/tp, L, hd) buffer per layer, in the model's layer order: one per key/value group (G, the query groups
    of grouped-query attention; the heads otherwise), not per query head."""
    values: list[torch.Tensor]
    pad: torch.Tensor
    """(B,) left-padding columns of each row."""
    key_mask: torch.Tensor | None = None
    """(B, 1, 1, L) bool, True for the real (unpadded) columns; None when no row is padded (no mask needed)."""
    length: int = 0
    """Columns filled so far (padding included)."""

    @classmethod
    def allocate(cls, model: GPT, *, pad: torch.Tensor, capacity: int) -> KVCache:
        blocks = list(model.h.values())
        heads, hd = blocks[0].attn.local_groups, blocks[0].attn.head_dim
        dtype = blocks[0].attn.qkv.weight.dtype
        device = blocks[0].attn.qkv.weight.device
        shape = (pad.shape[0], heads, capacity, hd)
        pad = pad.to(device)
        xla = device.type == "xla"
        key_mask = None
        # decode_step's mask (not used on XLA, where every step reads the whole cache under cached_forward's mask)
        if not xla and bool((pad > 0).any()):  # one host sync per generation, not per step
            key_mask = (torch.arange(capacity, device=device).unsqueeze(0) >= pad.unsqueeze(1))[:, None, None]
        # XLA attends over every column, written or not (module docstring): they must be finite.
        alloc = torch.zeros if xla else torch.empty
        return cls(keys=[alloc(shape, dtype=dtype, device=device) for _ in blocks],
                   values=[alloc(shape, dtype=dtype, device=device) for _ in blocks], pad=pad, key_mask=key_mask)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]


def context_length(model: GPT) -> int:
    """The most positions the model has embeddings (or rotary tables) for."""
    if model.wpe is not None:
        return model.wpe.num_embeddings
    return model.rope_cos.shape[0]


def check_generation_model(model: GPT) -> None:
    if len(model.stages) != 1 or not (model.has_first and model.has_last):
        raise ValueError("generation needs the whole model on each TP rank (no pipeline stages)")
    if model.sequence_parallel:
        raise ValueError("build the model for generation without sequence parallelism")
    if model.training:
        raise ValueError("call model.eval() before generating (dropout would make the output random)")


@torch.no_grad()
def cached_forward(model: GPT, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Run `ids` (B, S), the next S columns, through the model, appending their keys and values to `cache`.
    Returns this rank's logits of the last column, (B, V/tp)."""
    b, s = ids.shape
    start = cache.length
    if start + s > cache.capacity:
        raise ValueError(f"cache holds {cache.capacity} columns; {start} used, {s} more asked")
    fixed = ids.device.type == "xla"  # one graph for every decode step (module docstring)
    span = cache.capacity if fixed else start + s  # K: the key columns attention reads
    # On XLA made on the host and copied: device data, where an arange on the device would be a constant.
    cols = torch.arange(start, start + s).to(ids.device) if fixed else torch.arange(start, start + s, device=ids.device)
    positions = (cols.unsqueeze(0) - cache.pad.unsqueeze(1)).clamp_min(0)  # (B, S)
    keys = torch.arange(span, device=ids.device)  # (K,)
    # Key j is visible to query column c when j <= c and j is a real token of the row (or j is c itself).
    real = keys.unsqueeze(0) >= cache.pad.unsqueeze(1)  # (B, K)
    causal = keys.unsqueeze(0) <= cols.unsqueeze(1)  # (S, K)
    mask = (real.unsqueeze(1) & causal.unsqueeze(0)) | (keys.unsqueeze(0) == cols.unsqueeze(1)).unsqueeze(0)
    mask = mask.unsqueeze(1)  # (B, 1, S, K)
    rope = None
    if model.rope_cos is not None:
        rope = (model.rope_cos[positions].unsqueeze(1), model.rope_sin[positions].unsqueeze(1))  # (B, 1, S, rot)
    x = model.wte(ids)  # (B, S, H)
    if model.wpe is not None:
        x = x + model.wpe(positions)
    for layer, block in enumerate(model.h.values()):
        attn = block.attn
        q, k, v = (t.transpose(1, 2) for t in attn.split_qkv(attn.qkv(block.ln_1(x))))  # (B, nh/tp | G/tp, S, hd)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        if fixed:
            cache.keys[layer].index_copy_(2, cols, k)
            cache.values[layer].index_copy_(2, cols, v)
        else:
            cache.keys[layer][:, :, start:start + s] = k
            cache.values[layer][:, :, start:start + s] = v
        y = _attend(q, cache.keys[layer][:, :, :span], cache.values[layer][:, :, :span], mask)
        y = attn.proj(y.transpose(1, 2).reshape(b, s, attn.local_heads * attn.head_dim))  # (B, S, H)
        if block.parallel_residual:  # GPT-NeoX: the MLP reads the block input too, as in Block.forward
            x = block.mlp(block.ln_2(x)) + y + x
        else:
            x = x + y
            x = x + block.mlp(block.ln_2(x))
    cache.length = start + s
    return output_logits(model, model.ln_f(x[:, -1]))  # only the last column's logits are needed


def decode_step(model: GPT, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One new column: `tokens` (B,) through the model, their keys and values appended to `cache`; this rank's logits
    (B, V/tp). The same arithmetic as cached_forward with S = 1, minus its per-step overhead (measured in
    benchmarks/RESULTS.md, issues 17 and 27): 2-D (B, H) activations, q/k/v as strided views of the QKV output (no
    transposes), queries and keys rotated in one pass, each key/value group's queries attending as rows of their own
    (no grouped-query kernel), the key mask sliced from the cache instead of rebuilt, and the linears as
    inference_linear's matmuls (the column-parallel ones' forward is the identity on the input, and the autograd wrapper
    only costs time here)."""
    b = tokens.shape[0]
    start = cache.length
    if start + 1 > cache.capacity:
        raise ValueError(f"cache holds {cache.capacity} columns, all used")
    mask = None if cache.key_mask is None else cache.key_mask[..., :start + 1]  # (B, 1, 1, start + 1)
    # A decoded column is past every row's padding, so the position is simply column - pad.
    positions = start - cache.pad  # (B,)
    rope = None
    if model.rope_cos is not None:
        rope = (model.rope_cos[positions][:, None, None], model.rope_sin[positions][:, None, None])  # (B, 1, 1, rot)
    x = model.wte(tokens)  # (B, H)
    if model.wpe is not None:
        x = x + model.wpe(positions)
    for layer, block in enumerate(model.h.values()):
        attn = block.attn
        qkv = inference_linear(block.ln_1(x), attn.qkv.weight, attn.qkv.bias)  # (B, rows/tp)
        per_group = attn.local_heads // attn.local_groups
        # Megatron's grouped [G, (nh/G queries, key, value), hd] layout (per head [nh, (q, k, v), hd] without groups).
        # A group's queries and key are adjacent, so one rotation turns them all (B, G/tp, nh/G + 1, hd).
        grouped = qkv.view(b, attn.local_groups, per_group + 2, attn.head_dim)
        turned = grouped[:, :, :per_group + 1] if rope is None else rotate(grouped[:, :, :per_group + 1], *rope)
        keys, values = cache.keys[layer], cache.values[layer]
        keys[:, :, start] = turned[:, :, per_group]
        values[:, :, start] = grouped[:, :, per_group + 1]
        # Each group's nh/G queries as nh/G query rows against the group's keys (transformers' pack_gqa): plain
        # attention, where enable_gqa's kernel took about 3x as long at batch 8 (benchmarks/RESULTS.md, issue 27).
        # One column attends to every cached one, so no causal mask; a padding mask (B, 1, 1, L) broadcasts.
        y = F.scaled_dot_product_attention(turned[:, :, :per_group], keys[:, :, :start + 1], values[:, :, :start + 1],
                                           attn_mask=mask)  # (B, G/tp, nh/G, hd)
        y = _row_parallel(attn.proj, y.reshape(b, attn.local_heads * attn.head_dim))  # (B, H), the model's head order
        mlp = block.mlp
        if block.parallel_residual:
            x = _row_parallel(mlp.proj, _mlp_hidden(mlp, block.ln_2(x))) + y + x
        else:
            x = x + y
            x = x + _row_parallel(mlp.proj, _mlp_hidden(mlp, block.ln_2(x)))
    cache.length = start + 1
    return output_logits(model, model.ln_f(x))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q (B, nh/tp, S, hd) over the cached k, v (B, G/tp, K, hd), each group shared by its queries."""
    k, v = expand_groups(q, k), expand_groups(q, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _mlp_hidden(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP's activation (B, F/tp) before its output projection, with plain matmuls (see decode_step)."""
    up = inference_linear(x, mlp.fc.weight, mlp.fc.bias)
    if mlp.gate is not None:  # SwiGLU
        return F.silu(inference_linear(x, mlp.gate.weight, mlp.gate.bias)) * up
    return F.gelu(up, approximate=mlp.approximate)


def _row_parallel(layer: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """A row-parallel linear of (B, K/tp) rows: inference_linear at TP 1, else the layer (partial sums all-reduced)."""
    return inference_linear(x, layer.weight, layer.bias) if layer.tp_size == 1 else layer(x)


def inference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, K) @ weight (N, K)^T (+ bias) for a decode step's few rows, in the form the CPU's BLAS ran fastest
    (benchmarks/RESULTS.md, issues 17 and 27; the same dot products, rounded in another order):
    - one row on the CPU: the weight's rows split in p blocks, one batched product (bmm) of them; 2.5-3.5x faster than
      the matrix-vector product F.linear makes (about 12 GB/s of weights there, 36 GB/s here, on 2 cores), and a
      decode step at batch 1 is mostly these reads;
    - a few rows against a widening weight (N > K: QKV, gate, up, fc, the output layer): weight @ x^T, returned as a
      transposed view (the views and element-wise ops after it read it as it is); on every device, as output_logits
      did before (on XLA, cached_forward's output layer is the only caller);
    - otherwise F.linear."""
    n, k = weight.shape
    if x.shape[0] == 1:
        p = math.gcd(n, max(2, torch.get_num_threads()))  # blocks for every thread, whole rows each
        if x.device.type != "cpu" or p == 1 or not weight.is_contiguous():
            return F.linear(x, weight, bias)  # a matrix-vector product (on the GPU or XLA, the BLAS's choice)
        y = torch.bmm(weight.view(p, n // p, k), x.t().expand(p, k, 1)).view(1, n)
    elif n > k:
        y = torch.mm(weight, x.t()).t()
    else:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


def output_logits(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """This rank's logits (B, V/tp) of final hidden states (B, H), for inference only (no autograd wrappers: the
    column-parallel output layer's forward is the identity on its input)."""
    weight = model.wte.weight if model.lm_head is None else model.lm_head.weight  # (V/tp, H)
    # For a few rows as table @ x^T: the BLAS ran it about 1.5-1.9x faster than x @ table^T at 8 rows against the
    # 50304 x 768 fp32 table (benchmarks/RESULTS.md, issue 17); the output layer can be half of a step's bytes.
    return inference_linear(x, weight).contiguous()
