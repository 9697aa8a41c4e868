"""Per-request overhead of `megatron-hpc serve` (Megatron's `PUT /api`) against the in-process `engine.generate`
call, for the same tiny request (issue 17). Goal: under 10 ms.

A checkpoint (`--ckpt`, or a 2-layer one trained here for 2 steps at TP 2, as the tests make it) is served by the
real CLI in a subprocess (`megatron-hpc serve CKPT --port P`, the checkpoint merged to TP 1, the same number of
torch threads), and loaded in this process too. Each round times one HTTP round trip (urllib: JSON encode, PUT,
Flask, parse, tokenize, queue lock, generate, detokenize, JSON back) and one in-process `generate` of the same
token ids with the same SamplingParams, alternating so machine drift hits both. The overhead is median(server) -
median(in-process); the script checks first that both gave the same tokens. A third row times a request the
server refuses (a misspelt field) before generating: the fixed cost of HTTP, Flask and JSON alone.

    python benchmarks/serve_latency.py --rounds 50
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.generate.client import put_api

GOAL_MS = 10.0
ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "preprocess"
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
        "model.max_position_embeddings=32", "model.vocab_size=400", "model.make_vocab_size_divisible_by=64",
        "data.source=synthetic", "parallel.tensor=2", "train.num_steps=2", "train.micro_batch_size=4",
        "train.global_batch_size=4", "train.tensorboard=false"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Timings:
    server_ms: list[float]
    engine_ms: list[float]
    refused_ms: list[float]
    """Round trips of a request the server refuses before generating: HTTP, Flask and JSON alone."""

    @property
    def overhead_ms(self) -> float:
        return statistics.median(self.server_ms) - statistics.median(self.engine_ms)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, help="checkpoint to serve (default: train a tiny one in a temp folder)")
    p.add_argument("--vocab-file", type=Path, default=TOKENIZER / "vocab.json")
    p.add_argument("--merge-file", type=Path, default=TOKENIZER / "merges.txt")
    p.add_argument("--prompt", default="The quick brown")
    p.add_argument("--tokens", type=int, default=8, help="tokens_to_generate of the request")
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and of this process")
    p.add_argument("--port", type=int, default=0, help="server port (default 0: the server binds a free one and "
                   "names it)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.tokens < 1:
        p.error(f"--rounds ({args.rounds}) and --tokens ({args.tokens}) must be at least 1")
    return args


def table(t: Timings) -> str:
    def row(name: str, ms: list[float]) -> str:
        return (f"{name:<28} {statistics.median(ms):>9.2f} {min(ms):>9.2f} "
                f"{statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0]:>9.2f}")

    verdict = "met" if t.overhead_ms < GOAL_MS else "missed"
    return "\n".join([f"{'path':<28} {'median ms':>9} {'min ms':>9} {'p90 ms':>9}",
                      row("server round trip (HTTP)", t.server_ms), row("in-process engine.generate", t.engine_ms),
                      row("server 400, no generation", t.refused_ms),
                      f"overhead (median - median): {t.overhead_ms:.2f} ms; goal < {GOAL_MS:.0f} ms: {verdict}"])


def _env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": str(threads)}


def _tiny_checkpoint(folder: Path) -> Path:
    ckpt = folder / "ckpt"
    # --standalone: torchrun's rendezvous store binds a port of the kernel's choosing at once and the workers join
    # it. A fixed port collides with any other torchrun on the machine (the test suite's, beside it), and a port
    # found free and passed as --master_port stays unbound until the store binds it (benchmarks/rendezvous.py).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "megatron_hpc", "train", "--recipe", "tiny"]
    for item in [*TINY, f"checkpoint.save={ckpt}"]:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, capture_output=True, env=_env(1))
    return ckpt


def _listening_port(server: subprocess.Popen[str]) -> int:
    """The port `megatron-hpc serve` names once its socket listens (`PUT http://HOST:PORT/api` on stderr): with
    --port 0 the kernel chose it at bind time, so no other process can hold it. Its stderr is drained from then on, so
    that the pipe never fills."""
    seen = []
    for line in server.stderr:
        seen.append(line)
        found = re.search(r"PUT http://[^ ]+:(\d+)/api$", line.rstrip())
        if found:
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return int(found.group(1))
    raise RuntimeError(f"megatron-hpc serve exited with {server.wait()} before it listened:\n{''.join(seen)[-3000:]}")


def _put(url: str, body: dict) -> dict:
    return put_api(url, body)[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from megatron_hpc.generate.engine import generate
    from megatron_hpc.generate.loading import load_for_generation
    from megatron_hpc.generate.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.ckpt or _tiny_checkpoint(Path(tmp))
        tok_flags = ["--vocab-file", str(args.vocab_file), "--merge-file", str(args.merge_file)]
        server = subprocess.Popen([sys.executable, "-m", "megatron_hpc", "serve", str(ckpt), "--host", "127.0.0.1",
                                   "--port", str(args.port), "--quiet", *tok_flags], env=_env(args.threads),
                                  stderr=subprocess.PIPE, text=True)
        try:
            loaded = load_for_generation(ckpt, vocab_file=args.vocab_file, merge_file=args.merge_file)
            port = _listening_port(server)
            tok = loaded.tokenizer
            ids = tok.encode(args.prompt)
            # what the server makes of the request below: top_k 1 is greedy, the EOD token stops a row
            params = SamplingParams(max_new_tokens=args.tokens, top_k=1, stop_tokens=(tok.vocab["<|endoftext|>"],))
            url = f"http://127.0.0.1:{port}/api"
            body = {"prompts": [args.prompt], "tokens_to_generate": args.tokens, "top_k": 1, "no_log": True}
            served = _put(url, body)
            mine = generate(loaded.model, [ids], params)[0]
            assert served["tokens"][0] == ids + mine.tokens, (served["tokens"], ids + mine.tokens)
            print(f"same tokens from both paths: {len(mine.tokens)} new of {args.tokens} asked", flush=True)
            server_ms, engine_ms, refused_ms = [], [], []
            refused = {**body, "tokens_to_generat": 1}  # a typo: refused with a did-you-mean
            assert "did you mean" in _put(url, refused)["message"]
            for _ in range(args.rounds):
                start = time.perf_counter()
                _put(url, body)
                server_ms.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                generate(loaded.model, [ids], params)
                engine_ms.append((time.perf_counter() - start) * 1e3)
                start = time.perf_counter()
                _put(url, refused)
                refused_ms.append((time.perf_counter() - start) * 1e3)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"request: 1 prompt of {len(ids)} tokens, {args.tokens} new (greedy), {args.threads} torch thread(s) "
          f"each side, {args.rounds} rounds, model 2 layers hidden 64" if args.ckpt is None else
          f"request: 1 prompt of {len(ids)} tokens, {args.tokens} new (greedy), {args.rounds} rounds, {ckpt}")
    print(table(Timings(server_ms=server_ms, engine_ms=engine_ms, refused_ms=refused_ms)))


if __name__ == "__main__":
    main()
