"""GPT with Megatron tensor parallelism: learned or rotary positions, pre-LN blocks, GeLU MLP, tied embeddings; with
model.parallel_residual, rotary positions and an untied output layer it is GPT-NeoX / Pythia; with RMSNorm, SwiGLU,
grouped-query attention, no linear biases, rotary positions (Llama 3.1's scaling optional) and an untied output
layer it is Llama (with a QKV bias, Qwen2).

Shape legend: B batch, S sequence, H hidden, V padded vocabulary, nh heads, hd head dim,
tp the TP size; `/tp` marks the dim sharded across the TP group.

Init follows Megatron: N(0, std) for every weight, std / sqrt(2L) for the two output projections
of each block, zero biases, LayerNorm (1, 0), RMSNorm 1. Every weight is drawn in full from a generator keyed
by its name and then sharded (see parallel/layers.py), so the model is the same at any TP size.

Sequence parallelism (parallel.sequence_parallel, Korthikanti et al. 2022): between the TP linears, i.e. in the
LayerNorms, dropouts and residual adds, hidden states are (B, S/tp, H), split along dim 1 of our batch-first
layout (pipeline stages exchange those shards too). Attention sees the full sequence (the QKV projection
all-gathers it), so rotary uses full positions; learned position embeddings are added to each shard with its
own positions. Every replicated parameter then gets a partial gradient on each TP rank: the model tags them
`sequence_parallel` and the optimizer's reduce_and_clip all-reduces them over TP (parallel/grads.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_hpc.config.schema import ModelConfig
from megatron_hpc.model.rotary import apply_rotary, rotary_dims, rotary_tables, scaling_of
from megatron_hpc.parallel.context import ParallelContext
from megatron_hpc.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    seeded_normal,
)
from megatron_hpc.parallel.mappings import copy_to_tp_region, sequence_gather_linear
from megatron_hpc.plan.checks import check_model_shape
from megatron_hpc.plan.recompute import check_recompute_stages, recompute_groups, resolve_recompute
from megatron_hpc.plan.stages import StageLayout


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, *, ctx: ParallelContext, seed: int, prefix: str, sp: bool = False):
        super().__init__()
        h, tp = cfg.hidden_size, ctx.tp_size
        self.local_heads = cfg.num_attention_heads // tp
        self.local_groups = cfg.query_groups // tp
        self.head_dim = hd = cfg.head_dim
        self.core = AttentionCore(cfg.attention_dropout)
        # Selective recomputation (plan/recompute.py): the attention core keeps nothing for backward and is rerun
        # there; torch's checkpoint restores the RNG state, so attention dropout replays the same mask.
        self.recompute_core = resolve_recompute(cfg).selective
        # Fused QKV in Megatron's grouped layout [G, (nh/G queries, key, value), hd] (with one group per head, the
        # per-head [nh, (q, k, v), hd]): a contiguous row shard then holds whole groups, each with its own keys and
        # values, which is why TP must divide G.
        rows = (cfg.num_attention_heads + 2 * cfg.query_groups) * hd
        self.qkv = ColumnParallelLinear(h, rows, ctx=ctx, bias=cfg.qkv_bias, init_std=cfg.init_method_std,
                                        seed=seed, key=prefix + ".qkv", sequence_parallel=sp)
        self.proj = RowParallelLinear(h, h, ctx=ctx, bias=cfg.add_bias_linear, init_std=_out_std(cfg), seed=seed,
                                      key=prefix + ".proj", sequence_parallel=sp)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QKV projection's output (B, S, rows/tp) as q (B, S, nh/tp, hd) and k, v (B, S, G/tp, hd)."""
        b, s = qkv.shape[:2]
        per_group = self.local_heads // self.local_groups  # queries sharing one key/value head
        grouped = qkv.view(b, s, self.local_groups, per_group + 2, self.head_dim)
        # One query per group (multi-head attention) stays a strided view; several are gathered into one tensor.
        q = grouped[:, :, :, 0] if per_group == 1 else grouped[:, :, :, :per_group].reshape(
            b, s, self.local_heads, self.head_dim)
        return q, grouped[:, :, :, per_group], grouped[:, :, :, per_group + 1]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, S, rows/tp): the full sequence, also under sequence parallelism
        b, s = qkv.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in self.split_qkv(qkv))  # (B, nh/tp, S, hd); k, v (B, G/tp, S, hd)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.recompute_core and self.training:
            y = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)  # (B, S, H/tp)
        return self.proj(y)  # (B, S, H); (B, S/tp, H) with sequence parallelism


class AttentionCore(nn.Module):
    """softmax(QK^T / sqrt(hd)) V with the causal mask and attention dropout: (B, nh/tp, S, hd) in and out. A module
    of its own (no parameters) so that selective recomputation checkpoints exactly this, and tests can see it run."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = expand_groups(q, k), expand_groups(q, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0,
                                              enable_gqa=k.shape[1] != q.shape[1])


def expand_groups(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Keys or values (B, G, S, hd) for queries (B, nh, S', hd): as they are where scaled_dot_product_attention
    shares each group among its nh/G queries itself (enable_gqa), repeated per query on XLA, whose lowering of
    it is not relied on."""
    if kv.shape[1] == q.shape[1] or q.device.type != "xla":
        return kv
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, *, ctx: ParallelContext, seed: int, prefix: str, sp: bool = False):
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.ffn_size, cfg.add_bias_linear
        # SwiGLU's gate: a column-parallel linear of its own, so TP rank r always holds the rows of the gate that
        # match its rows of fc (the up projection); see ModelConfig.swiglu.
        self.gate = ColumnParallelLinear(h, f, ctx=ctx, bias=bias, init_std=cfg.init_method_std, seed=seed,
                                         key=prefix + ".gate", sequence_parallel=sp) if cfg.swiglu else None
        self.fc = ColumnParallelLinear(h, f, ctx=ctx, bias=bias, init_std=cfg.init_method_std, seed=seed,
                                       key=prefix + ".fc", sequence_parallel=sp)
        self.proj = RowParallelLinear(f, h, ctx=ctx, bias=bias, init_std=_out_std(cfg), seed=seed,
                                      key=prefix + ".proj", sequence_parallel=sp)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"  # GPT-2's gelu_new is the tanh one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))  # (B, S, F/tp) inside, (B, S, H) out
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, *, ctx: ParallelContext, seed: int, index: int, sp: bool = False):
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = Attention(cfg, ctx=ctx, seed=seed, prefix=f"h.{index}.attn", sp=sp)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg, ctx=ctx, seed=seed, prefix=f"h.{index}.mlp", sp=sp)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.parallel_residual = cfg.parallel_residual

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.parallel_residual:
            # GPT-NeoX's use_parallel_residual: both branches read the block input (each through its own LayerNorm),
            # in the order HF's GPTNeoXLayer adds them. Under TP each branch still ends in its own all-reduce.
            return self.dropout(self.mlp(self.ln_2(x))) + self.dropout(self.attn(self.ln_1(x), rope)) + x
        x = x + self.dropout(self.attn(self.ln_1(x), rope))
        return x + self.dropout(self.mlp(self.ln_2(x)))


def norm(cfg: ModelConfig) -> nn.Module:
    """The model's normalization: LayerNorm (weight 1, bias 0) or RMSNorm (weight 1, no bias)."""
    if cfg.normalization == "rmsnorm":
        return nn.RMSNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)


def _out_std(cfg: ModelConfig) -> float:
    # Megatron's scaled_init_method_normal: residual outputs shrink with depth.
    return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)


class GPT(nn.Module):
    """Decoder-only transformer, whole or the pipeline stages of one rank.

    Whole (stages None): forward(ids) returns vocab-sharded logits (B, S, V/tp). With `stages` (this pipeline
    rank's virtual stages, plan/stages.py) it holds only their layers, keyed by global layer index, plus the
    embedding when it runs the first stage and the final norm and output layer when it runs the last. With tied
    embeddings the last stage keeps its own copy of the word embeddings under the same name (Megatron's
    word_embeddings_for_head): initialised identically, kept equal by all-reducing its gradient with the first
    stage's (parallel/pipeline.py). `stage_forward` runs one stage; `chunks()` gives one module per stage for
    torch.distributed.pipelining.
    """

    def __init__(self, cfg: ModelConfig, *, ctx: ParallelContext, padded_vocab: int, seed: int,
                 stages: Sequence[StageLayout] | None = None, sequence_parallel: bool = False):
        super().__init__()
        check_model_shape(cfg, tensor_parallel=ctx.tp_size)  # the planner ran it too; tools build models directly
        self.group = ctx.tp_group
        # With one TP rank there is nothing to split: plain TP code paths (the planner refuses SP at TP 1 anyway).
        sp = self.sequence_parallel = sequence_parallel and ctx.tp_size > 1
        self.tp_size, self.tp_rank = ctx.tp_size, ctx.tp_rank
        self.recompute = resolve_recompute(cfg)
        self.stages = list(stages) if stages is not None else [
            StageLayout(index=0, pp_rank=0, chunk=0, layers=range(cfg.num_layers), first=True, last=True)]
        self.has_first = any(s.first for s in self.stages)
        self.has_last = any(s.last for s in self.stages)
        self.tied = cfg.tie_embeddings
        self.vocab_size = cfg.vocab_size  # the real rows of the (padded) output layer, for generation
        h, std = cfg.hidden_size, cfg.init_method_std
        self.wte: VocabParallelEmbedding | None = None
        if self.has_first or (self.has_last and cfg.tie_embeddings):
            self.wte = VocabParallelEmbedding(padded_vocab, h, ctx=ctx, vocab_size=cfg.vocab_size,
                                              init_std=std, seed=seed, key="wte", sequence_parallel=sp)
        self.wpe: nn.Embedding | None = None
        if cfg.position_embedding == "learned":
            if self.has_first:
                self.wpe = nn.Embedding(cfg.max_position_embeddings, h)
                with torch.no_grad():
                    self.wpe.weight.copy_(seeded_normal(tuple(self.wpe.weight.shape), std=std, seed=seed,
                                                        key="wpe"))
            self.rope_cos = self.rope_sin = None
        else:
            rot = rotary_dims(h // cfg.num_attention_heads, rotary_percent=cfg.rotary_percent)
            cos, sin = rotary_tables(rot, max_positions=cfg.max_position_embeddings, base=cfg.rotary_base,
                                     scaling=scaling_of(cfg))
            # Not persistent: derived from the config, so checkpoints hold only trained weights.
            self.register_buffer("rope_cos", cos, persistent=False)  # (P, rot)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.hidden_dropout)
        # Keyed by the global layer index, so every stage's state dict names a layer as the whole model does.
        self.h = nn.ModuleDict({str(i): Block(cfg, ctx=ctx, seed=seed, index=i, sp=sp)
                                for stage in self.stages for i in stage.layers})
        check_recompute_stages(cfg, [len(stage.layers) for stage in self.stages])
        if self.wte is not None and not self.has_first:
            # The last stage's copy of the tied table: the gradient norm counts it once, on the first stage.
            self.wte.weight.pipeline_duplicate = True
        self.ln_f: nn.Module | None = None
        self.lm_head: ColumnParallelLinear | None = None
        if self.has_last:
            self.ln_f = norm(cfg)
            if not cfg.tie_embeddings:
                self.lm_head = ColumnParallelLinear(h, padded_vocab, ctx=ctx, bias=False, init_std=std,
                                                    seed=seed, key="lm_head", sequence_parallel=sp)
        if sp:
            # LayerNorms, row-parallel biases and position embeddings see one sequence shard per TP rank.
            for p in self.parameters():
                if not getattr(p, "tensor_parallel", False):
                    p.sequence_parallel = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if len(self.stages) != 1 or not (self.has_first and self.has_last):
            raise RuntimeError("this GPT holds pipeline stages: run it through its chunks() and a schedule")
        return self.stage_forward(ids, self.stages[0])

    def stage_forward(self, x: torch.Tensor, stage: StageLayout) -> torch.Tensor:
        """Token ids (B, S) on the first stage, else hidden states (B, S, H) ((B, S/tp, H) with sequence
        parallelism); logits (B, S, V/tp) on the last stage, else hidden states."""
        s = x.shape[1] if stage.first or not self.sequence_parallel else x.shape[1] * self.tp_size
        rope = None if self.rope_cos is None else (self.rope_cos[:s], self.rope_sin[:s])  # (S, rot) each
        if stage.first:
            ids = x
            x = self.wte(ids)  # (B, S, H); (B, S/tp, H) with sequence parallelism
            if self.wpe is not None:
                shard = x.shape[1]  # this rank's positions: its slice of the sequence
                start = self.tp_rank * shard if self.sequence_parallel else 0
                x = x + self.wpe(torch.arange(start, start + shard, device=ids.device))
            x = self.drop(x)
        for layers, checkpointed in recompute_groups(stage.layers, self.recompute):
            if checkpointed and self.training:
                # Only the group's input is saved; its layers rerun in backward (same dropout masks: the RNG
                # state is restored by torch's checkpoint).
                x = checkpoint(self._run_layers, x, rope, layers, use_reentrant=False)
            else:
                x = self._run_layers(x, rope, layers)
        if not stage.last:
            return x
        x = self.ln_f(x)
        if self.lm_head is not None:
            return self.lm_head(x)  # gathers the sequence itself under sequence parallelism
        # Tied output layer: the vocab-sharded embedding table is the column-parallel weight.
        if self.sequence_parallel:
            return sequence_gather_linear(x, self.wte.weight, None, self.group)  # (B, S, V/tp)
        return F.linear(copy_to_tp_region(x, self.group), self.wte.weight)  # (B, S, V/tp)

    def _run_layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                    layers: Sequence[int]) -> torch.Tensor:
        for i in layers:
            x = self.h[str(i)](x, rope)
        return x

    def chunks(self) -> list[nn.Module]:
        """One module per stage this rank runs (chunk order), sharing this model's parameters."""
        return [StageChunk(self, stage) for stage in self.stages]

    def shared_embedding(self) -> nn.Parameter | None:
        """The word-embedding table when this rank holds it on the first or the last stage of a tied pipeline
        (the parameter the embedding group keeps equal), else None."""
        if self.wte is None or not self.tied or (self.has_first and self.has_last):
            return None
        return self.wte.weight

    def num_params(self, *, ctx: ParallelContext) -> int:
        """Parameters this rank's stages hold, sharded ones counted over the whole TP group."""
        total = 0
        for p in self.parameters():
            total += p.numel() * (ctx.tp_size if getattr(p, "tensor_parallel", False) else 1)
        return total


class StageChunk(nn.Module):
    """One pipeline stage of a GPT, as the module a torch.distributed.pipelining stage runs.

    It registers the very submodules its stage uses, so its parameters() are that stage's (the same Parameter
    objects as the GPT's, which the rank's optimizer and checkpoint keep using); the GPT itself is held as a
    plain attribute so that its other stages' parameters are not counted twice.
    """

    def __init__(self, model: GPT, stage: StageLayout):
        super().__init__()
        self.__dict__["model"] = model  # not registered: see the class docstring
        self.stage = stage
        self.blocks = nn.ModuleList(model.h[str(i)] for i in stage.layers)
        if stage.first:
            self.wte, self.wpe = model.wte, model.wpe
        if stage.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            if model.lm_head is None:
                self.wte = model.wte

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.stage_forward(x, self.stage)
