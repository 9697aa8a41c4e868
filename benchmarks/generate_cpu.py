"""Greedy generation tokens/s on the CPU: megatron-hpc's `generate` against `transformers`' `generate`, on the
same model (issue 17; with --family llama, issue 27's Llama-shaped model).

One process builds our GPT (random init, fp32), maps its weights into a GPT2LMHeadModel exactly as `ckpt convert
--to hf` does (checkpoint/foreign/hf_gpt2.py: hf_config_from_model, state_to_hf), or with --family llama into a
LlamaForCausalLM (llama_state_to_hf below: train_step_cpu.py's Llama shape, 8 heads in 2 query groups, SwiGLU, RMSNorm,
rotary, untied), and checks that both produce the same greedy tokens before timing anything. Then, for batch 1 and
batch 8, each of `--rounds` rounds times one full generation of `--new-tokens` tokens (prefill of a
`--prompt-len`-token prompt included) with each implementation, alternating ours / theirs so machine drift hits both.
Tokens/s = batch x new tokens / seconds; the median round and the best round (the least disturbed on a shared machine)
are printed, with the ratios ours / transformers. Goal: 1.2x.

    python benchmarks/generate_cpu.py --rounds 3
    python benchmarks/generate_cpu.py --rounds 3 --family llama
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

GOAL = 1.2
FAMILIES = {
    # family: the model's defaults (each can be set by its flag)
    "gpt2": {"layers": 6, "hidden": 768, "heads": 12, "vocab": 50257},  # issue 17: GPT-2's vocabulary
    "llama": {"layers": 6, "hidden": 512, "heads": 8, "vocab": 8192},  # issue 27: train_step_cpu.py's Llama shape
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    batch: int
    ours: list[float]
    """tokens/s of each round."""
    theirs: list[float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=tuple(FAMILIES), default="gpt2")
    p.add_argument("--layers", type=int, help="default: the family's (FAMILIES), as --hidden, --heads and --vocab")
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--groups", type=int, default=2, help="llama: key/value heads (query groups)")
    p.add_argument("--ffn", type=int, default=1408, help="llama: the SwiGLU width")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    for name, value in FAMILIES[args.family].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.family == "llama" and args.heads % args.groups:
        p.error(f"--heads {args.heads} is not divisible by --groups {args.groups}")
    if args.prompt_len + args.new_tokens > args.context:
        p.error(f"--prompt-len + --new-tokens ({args.prompt_len + args.new_tokens}) exceed --context {args.context}")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    return args


def ratios(row: Row) -> tuple[float, float]:
    """ours / theirs for the median rounds and for the best rounds."""
    return (statistics.median(row.ours) / statistics.median(row.theirs), max(row.ours) / max(row.theirs))


def table(rows: list[Row]) -> str:
    lines = [f"{'batch':>5}  {'ours tok/s (median, best)':>26}  {'transformers tok/s':>26}  {'ratio median':>12}  "
             f"{'ratio best':>10}  goal {GOAL}x"]
    for row in rows:
        med, best = ratios(row)
        lines.append(f"{row.batch:>5}  {statistics.median(row.ours):>15.1f}, {max(row.ours):>8.1f}  "
                     f"{statistics.median(row.theirs):>15.1f}, {max(row.theirs):>8.1f}  {med:>11.2f}x  {best:>9.2f}x  "
                     f"{'met' if med >= GOAL else 'missed'}")
    return "\n".join(lines)


def _models(args: argparse.Namespace):
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import ModelConfig
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.plan.vocab import padded_vocab_size

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)
    hf_config = None
    if args.family == "llama":
        from train_step_cpu import llama_configs  # the training benchmark's Llama shape

        cfg, hf_config = llama_configs(layers=args.layers, hidden=args.hidden, heads=args.heads, groups=args.groups,
                                       ffn=args.ffn, positions=args.context, vocab=args.vocab)
    else:
        cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                          seq_length=args.context, max_position_embeddings=args.context, vocab_size=args.vocab)
    padded = padded_vocab_size(args.vocab, divisible_by=cfg.make_vocab_size_divisible_by, tensor_parallel=1)
    ours = GPT(cfg, ctx=ctx, padded_vocab=padded, seed=1234).eval()
    theirs = _hf_gpt2(ours, cfg, args) if hf_config is None else _hf_llama(ours, hf_config, args)
    return ours, theirs.eval(), torch


def _hf_gpt2(ours, cfg, args: argparse.Namespace):
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_hpc.checkpoint.foreign.hf_gpt2 import hf_config_from_model, state_to_hf

    model = {"vocab_size": args.vocab, "max_position_embeddings": args.context, "hidden_size": args.hidden,
             "num_layers": args.layers, "num_attention_heads": args.heads, "layernorm_epsilon": cfg.layernorm_epsilon}
    config = GPT2Config(**hf_config_from_model(model))
    config._attn_implementation = "sdpa"
    theirs = GPT2LMHeadModel(config)
    missing, unexpected = theirs.load_state_dict(state_to_hf(ours.state_dict(), model), strict=False)
    assert not unexpected and all("lm_head" in k or "attn.bias" in k for k in missing), (missing, unexpected)
    theirs.tie_weights()
    return theirs


def _hf_llama(ours, config, args: argparse.Namespace):
    from transformers import LlamaForCausalLM

    theirs = LlamaForCausalLM(config)
    theirs.load_state_dict(llama_state_to_hf(ours.state_dict(), args), strict=True)
    return theirs


def llama_state_to_hf(state: dict, args: argparse.Namespace) -> dict:
    """Our Llama-shaped state dict as LlamaForCausalLM's (TP 1): the grouped QKV rows [G, (nh/G queries, key, value),
    hd] split into q/k/v_proj, gate -> gate_proj, fc -> up_proj, the padded vocabulary rows dropped."""
    per_group, hd = args.heads // args.groups, args.hidden // args.heads
    out = {"model.embed_tokens.weight": state["wte.weight"][:args.vocab], "model.norm.weight": state["ln_f.weight"],
           "lm_head.weight": state["lm_head.weight"][:args.vocab]}
    for i in range(args.layers):
        ours, theirs = f"h.{i}.", f"model.layers.{i}."
        qkv = state[ours + "attn.qkv.weight"].view(args.groups, per_group + 2, hd, args.hidden)
        out[theirs + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, args.hidden)
        out[theirs + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, args.hidden)
        out[theirs + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(-1, args.hidden)
        for src, dst in (("attn.proj", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.fc", "mlp.up_proj"),
                         ("mlp.proj", "mlp.down_proj"), ("ln_1", "input_layernorm"),
                         ("ln_2", "post_attention_layernorm")):
            out[f"{theirs}{dst}.weight"] = state[f"{ours}{src}.weight"]
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    ours, theirs, _ = _models(args)
    from transformers import GenerationConfig

    from megatron_hpc.generate.engine import generate
    from megatron_hpc.generate.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=args.new_tokens)  # no stop token: every row runs the full length
    gen_config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)

    def run_ours(prompts: torch.Tensor) -> list[list[int]]:
        return [g.tokens for g in generate(ours, prompts.tolist(), params)]

    def run_theirs(prompts: torch.Tensor) -> list[list[int]]:
        with torch.no_grad():
            out = theirs.generate(prompts, attention_mask=torch.ones_like(prompts), generation_config=gen_config)
        return out[:, prompts.shape[1]:].tolist()

    rows = []
    for batch in args.batches:
        prompts = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch))
        a, b = run_ours(prompts), run_theirs(prompts)  # warm-up, and the same model: the same greedy tokens
        same = sum(x == y for x, y in zip(a, b))
        print(f"batch {batch}: {same}/{batch} rows identical over {args.new_tokens} greedy tokens", flush=True)
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(args.rounds):
            for name, fn in (("ours", run_ours), ("theirs", run_theirs)):
                start = time.perf_counter()
                fn(prompts)
                times[name].append(batch * args.new_tokens / (time.perf_counter() - start))
        rows.append(Row(batch=batch, ours=times["ours"], theirs=times["theirs"]))
        print(f"batch {batch}: ours {[round(t, 1) for t in times['ours']]} tok/s, transformers "
              f"{[round(t, 1) for t in times['theirs']]} tok/s", flush=True)
    llama = f" in {args.groups} query groups, SwiGLU {args.ffn}" if args.family == "llama" else ""
    print(f"config: {args.family}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads{llama}, vocab "
          f"{args.vocab}, fp32, "
          f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens (greedy), {args.threads} threads, "
          f"{args.rounds} rounds")
    print(table(rows))


if __name__ == "__main__":
    main()
