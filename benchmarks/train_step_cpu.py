"""CPU training-step throughput: megatron-hpc's GPT against Hugging Face GPT2LMHeadModel (sdpa), or (--family llama)
our Llama-shaped GPT against LlamaForCausalLM (sdpa).

Issue 4's figure: one training step (forward, backward, AdamW) on the same config, fp32,
dropout 0, 2 threads: 6 layers, hidden 512, 8 heads, seq 512, batch 8, vocab 8192. Each
measurement is its own process (so peak RSS is the process's own), and the two implementations
alternate A B A B ... in one run so machine drift hits both. Every step is timed on its own: on a
shared machine the other users' load comes and goes within a process, so besides the median
tokens/s over all steps the report gives the best step of each implementation (the step least
disturbed by others). Prints both, peak memory medians, and the ratios ours / HF.

Ours runs with the trainer's CPU process setup (megatron_hpc.parallel.device.keep_freed_memory, which the
trainer calls at start on CPU). So that the gain of the allocator setting is not mistaken for the model's, a
third contender runs HF with the same setting ("hf-kept"); "hf" is HF as its users run it.

    python benchmarks/train_step_cpu.py --rounds 5
    python benchmarks/train_step_cpu.py --rounds 5 --family llama   # issue 27's figure (see Shape)
    python benchmarks/train_step_cpu.py --rounds 1 --steps 1 --warmup 0 --layers 1 --hidden 32 --heads 2 \
        --seq 16 --batch 1 --vocab 64      # smoke test (the suite runs it): the script, not the figure
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """The model and batch both implementations train (the defaults are issue 4's figure; with family llama, issue
    27's: the same sizes with RMSNorm, SwiGLU, grouped-query attention, rotary positions, no biases, untied)."""

    family: str = "gpt2"
    layers: int = 6
    hidden: int = 512
    heads: int = 8
    groups: int = 2
    """Key/value heads (query groups) of the llama family: 8 heads in 2 groups is issue 27's GQA 8:2."""
    ffn: int = 1408
    """The llama family's SwiGLU width (Llama's 8/3 x hidden rounded up to a multiple of 64)."""
    seq: int = 512
    batch: int = 8
    vocab: int = 8192


FAMILIES = ("gpt2", "llama")


def llama_configs(*, layers: int, hidden: int, heads: int, groups: int, ffn: int, positions: int, vocab: int):
    """Our ModelConfig and transformers' LlamaConfig of one Llama-shaped model (also generate_cpu.py's)."""
    from transformers import LlamaConfig

    from megatron_hpc.config.schema import ModelConfig

    ours = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                       ffn_hidden_size=ffn, seq_length=positions, max_position_embeddings=positions, vocab_size=vocab,
                       position_embedding="rope", normalization="rmsnorm", swiglu=True, add_bias_linear=False,
                       tie_embeddings=False, layernorm_epsilon=1e-5)
    theirs = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=groups, intermediate_size=ffn, max_position_embeddings=positions,
                         vocab_size=vocab, rms_norm_eps=ours.layernorm_epsilon, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": ours.rotary_base},
                         bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    theirs._attn_implementation = "sdpa"  # transformers 5 takes the choice from the config
    return ours, theirs


def _model_config(shape: Shape):
    from megatron_hpc.config.schema import ModelConfig

    if shape.family == "llama":
        return llama_configs(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, groups=shape.groups,
                             ffn=shape.ffn, positions=shape.seq, vocab=shape.vocab)[0]
    return ModelConfig(num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                       seq_length=shape.seq, max_position_embeddings=shape.seq, vocab_size=shape.vocab)


def _ours(shape: Shape):
    import torch
    import torch.distributed as dist

    from megatron_hpc.config.schema import OptimConfig
    from megatron_hpc.model.gpt import GPT
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh
    from megatron_hpc.train.optim import PlainOptimizer
    from megatron_hpc.train.step import MicroBatches, train_step

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=1, tensor_parallel=1), rank=0)
    model = GPT(_model_config(shape), ctx=ctx, padded_vocab=shape.vocab, seed=1234)
    optimizer = PlainOptimizer(model, optim=OptimConfig(lr=1e-4), ctx=ctx, device_kind="cpu")
    forward_backward = MicroBatches(model, ctx=ctx, autocast_dtype=None, device_type="cpu")
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        train_step(forward_backward, optimizer, [tokens])

    return step


def _hf(shape: Shape):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    if shape.family == "llama":
        model = LlamaForCausalLM(llama_configs(layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                                               groups=shape.groups, ffn=shape.ffn, positions=shape.seq,
                                               vocab=shape.vocab)[1])
    else:
        config = GPT2Config(n_layer=shape.layers, n_embd=shape.hidden, n_head=shape.heads, n_positions=shape.seq,
                            vocab_size=shape.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=shape.vocab - 1, eos_token_id=shape.vocab - 1)
        config._attn_implementation = "sdpa"  # transformers 5 takes the choice from the config
        model = GPT2LMHeadModel(config)
    assert model.config._attn_implementation == "sdpa"
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=torch.Generator().manual_seed(0))

    def step():
        optimizer.zero_grad(set_to_none=True)
        out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


IMPLS = ("ours", "hf", "hf-kept")


def labels(family: str) -> dict[str, str]:
    hf = "HF LlamaForCausalLM (sdpa)" if family == "llama" else "HF GPT2LMHeadModel (sdpa)"
    ours = "megatron-hpc GPT, Llama-shaped" if family == "llama" else "megatron-hpc GPT"
    return {"ours": ours, "hf": hf, "hf-kept": "HF + keep_freed_memory"}


def worker(impl: str, *, shape: Shape, steps: int, warmup: int, threads: int) -> None:
    import torch

    from megatron_hpc.parallel.device import keep_freed_memory

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    if impl in ("ours", "hf-kept") and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() did not apply (not glibc?)")
    step = _ours(shape) if impl == "ours" else _hf(shape)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    tokens = shape.batch * shape.seq
    print(json.dumps({"impl": impl, "tokens_per_s": tokens * steps / sum(times),
                      "step_tokens_per_s": [tokens / t for t in times]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=IMPLS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    for name, value in asdict(Shape()).items():
        parser.add_argument(f"--{name}", type=type(value), default=value,
                            **({"choices": FAMILIES} if name == "family" else {}))
    args = parser.parse_args()
    args.shape = Shape(**{name: getattr(args, name) for name in asdict(Shape())})
    if args.worker:
        worker(args.worker, shape=args.shape, steps=args.steps, warmup=args.warmup, threads=args.threads)
        return
    results: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            results[impl].append(measure(impl, args))
    report(results, args)


def measure(impl: str, args: argparse.Namespace) -> dict:
    """One child process; its own peak RSS comes from wait4, not the cumulative children figure."""
    cmd = [sys.executable, __file__, "--worker", impl, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), *(f"--{k}={v}" for k, v in asdict(args.shape).items())]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    read, write = os.pipe()
    pid = os.posix_spawn(cmd[0], cmd, env, file_actions=[(os.POSIX_SPAWN_DUP2, write, 1)])
    os.close(write)
    _, status, usage = os.wait4(pid, 0)
    with os.fdopen(read) as fh:
        out = fh.read()
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{impl} worker failed:\n{out}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
    return result


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    med = {impl: {"tokens_per_s": statistics.median(t for r in rows for t in r["step_tokens_per_s"]),
                  "best": max(t for r in rows for t in r["step_tokens_per_s"]),
                  "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rows)}
           for impl, rows in results.items()}
    s = args.shape
    llama = ""
    if s.family == "llama":
        llama = f" in {s.groups} query groups, SwiGLU {s.ffn}, RMSNorm, rotary, no biases, untied"
    print(f"config: {s.family}, {s.layers} layers, hidden {s.hidden}, {s.heads} heads{llama}, seq {s.seq}, batch "
          f"{s.batch}, vocab {s.vocab}, fp32, {args.threads} threads; {args.rounds} rounds x {args.steps} timed steps "
          f"(+{args.warmup} warm-up)")
    for impl, label in labels(s.family).items():
        rows = results[impl]
        tps = [round(r["tokens_per_s"]) for r in rows]
        print(f"{label:<30} tokens/s median step {med[impl]['tokens_per_s']:6.0f}, best step "
              f"{med[impl]['best']:6.0f} (per process {tps}); peak RSS median {med[impl]['peak_rss_mib']:6.0f} MiB")
    for other in ("hf", "hf-kept"):
        print(f"ratio ours/{other}: throughput {med['ours']['tokens_per_s'] / med[other]['tokens_per_s']:.2f}x "
              f"(median steps), {med['ours']['best'] / med[other]['best']:.2f}x (best steps), "
              f"peak memory {med['ours']['peak_rss_mib'] / med[other]['peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
