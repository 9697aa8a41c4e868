"""Where a greedy decode step's time goes on the CPU (issue 17): the memory-bandwidth floor against our step and
transformers' step, on generate_cpu.py's model.

Per batch size it times, alternating within each round so that machine drift hits all of them:
- floor: only the weight matmuls of one token (every layer's weights with their biases: four, five with SwiGLU's gate;
  and the output layer; each in the form ours computes it, kv_cache.inference_linear), i.e. the bytes every
  implementation must read per step;
- ours: one `decode_step` plus the greedy choice (the path `generate` runs);
- ours (plain): one `cached_forward` of one column plus the same choice (the general path, before the fast path);
- transformers: one GPT2LMHeadModel (or LlamaForCausalLM) forward with its DynamicCache (cropped back after each
  step) plus argmax, i.e. the model alone, without `generate`'s per-step logits processors and stopping criteria.
It also prints the machine's copy bandwidth (a 256 MiB tensor copy) and what the floor reads per step.

    python benchmarks/generate_floor.py --rounds 20
    python benchmarks/generate_floor.py --rounds 1 --batches 1 --cached 4 --copy-mib 1 --layers 1 --hidden 64 \
        --heads 4 --vocab 300 --context 16 --prompt-len 1 --new-tokens 1   # smoke test (the suite runs it)

Flags it does not know go to generate_cpu.py's parser: the model (--layers, --hidden, ...) is that script's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import generate_cpu


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--cached", type=int, default=96, help="columns already in the KV cache (prompt 32 + half of 128)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--copy-mib", type=int, default=256, help="size of the tensor copied to measure the bandwidth")
    args, model_args = p.parse_known_args(argv)
    args.model = generate_cpu.parse_args(model_args)
    import torch

    torch.set_num_threads(args.threads)
    ours, theirs, _ = generate_cpu._models(args.model)

    src = torch.ones(args.copy_mib * 2**18)  # float32: 4 bytes each
    dst = torch.empty_like(src)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - start)
    gbs = 2 * src.numel() * 4 / min(copies) / 1e9
    print(f"copy bandwidth ({args.copy_mib} MiB read + written, best of 5): {gbs:.1f} GB/s", flush=True)

    weights = [(m.weight, m.bias) for block in ours.h.values()
               for m in (block.attn.qkv, block.attn.proj, block.mlp.gate, block.mlp.fc, block.mlp.proj)
               if m is not None]  # mlp.gate: SwiGLU's (--family llama)
    output = ours.wte if ours.lm_head is None else ours.lm_head
    weights.append((output.weight, None))
    nbytes = sum(w.numel() * 4 + (0 if b is None else b.numel() * 4) for w, b in weights)
    print(f"weights read per step: {nbytes / 1e6:.0f} MB -> floor at that bandwidth {nbytes / gbs / 1e6:.1f} ms")

    with torch.inference_mode():
        for batch in args.batches:
            _time_batch(ours, theirs, batch, weights, nbytes, args)


def _time_batch(ours, theirs, batch: int, weights: list, nbytes: int, args: argparse.Namespace) -> None:
    import torch

    from megatron_hpc.generate.engine import vocab_shard
    from megatron_hpc.generate.kv_cache import KVCache, cached_forward, decode_step, inference_linear, output_logits
    from megatron_hpc.generate.sampling import SamplingParams, next_tokens

    shard, params = vocab_shard(ours), SamplingParams(max_new_tokens=1)
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1]) for w, _ in weights}
    prompts = torch.randint(0, args.model.vocab, (batch, args.cached))
    tokens = torch.zeros(batch, dtype=torch.long)
    fast = KVCache.allocate(ours, pad=torch.zeros(batch, dtype=torch.long), capacity=args.cached + 1)
    plain = KVCache.allocate(ours, pad=torch.zeros(batch, dtype=torch.long), capacity=args.cached + 1)
    cached_forward(ours, prompts, fast)
    cached_forward(ours, prompts, plain)
    hf_cache = theirs(prompts, use_cache=True).past_key_values
    mask = torch.ones(batch, args.cached + 1, dtype=torch.long)

    def floor() -> None:
        for w, b in weights[:-1]:
            inference_linear(inputs[w.shape[1]], w, b)  # the matmuls in the form decode_step runs them
        output_logits(ours, inputs[weights[-1][0].shape[1]])  # the output layer as ours runs it

    def step_ours() -> None:
        next_tokens(decode_step(ours, tokens, fast), params, shard, None)
        fast.length -= 1

    def step_plain() -> None:
        next_tokens(cached_forward(ours, tokens[:, None], plain), params, shard, None)
        plain.length -= 1

    def step_theirs() -> None:
        theirs(tokens[:, None], past_key_values=hf_cache, attention_mask=mask, use_cache=True).logits[:, -1].argmax(-1)
        hf_cache.crop(-1)

    runs = {"floor": floor, "ours": step_ours, "ours (plain)": step_plain, "transformers": step_theirs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    best_floor = min(times["floor"])
    for name, ts in times.items():
        print(f"batch {batch:>2} {name:>13}: best {min(ts):7.2f} ms  median {statistics.median(ts):7.2f} ms"
              f"  best / floor {min(ts) / best_floor:5.2f}  ({nbytes / min(ts) / 1e6:.1f} GB/s of weights)", flush=True)

if __name__ == "__main__":
    main()
