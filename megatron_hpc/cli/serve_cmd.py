"""`megatron-hpc serve CKPT --port N`: Megatron-LM's text generation API (`PUT /api`) on a checkpoint.

Alone it loads the checkpoint at TP 1 on the CPU. Under torchrun (`torchrun --nproc_per_node T -m megatron_hpc
serve ...`) it loads at TP T: rank 0 serves, the other ranks follow. `serve --client URL --prompt TEXT` sends one
request and prints the response, as Megatron's tools/text_generation_cli.py does.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, nargs="?",
                        help="checkpoint folder (the tracker picks the iteration) or iter_XXXXXXX")
    parser.add_argument("--port", type=int, default=5000, help="port of the HTTP server (default 5000)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)")
    parser.add_argument("--vocab-file", type=Path, help="GPT-2 vocab.json, when the run's is missing or gone")
    parser.add_argument("--merge-file", type=Path, help="GPT-2 merges.txt, with --vocab-file")
    parser.add_argument("--iteration", type=int, help="use this iteration instead of the tracker's")
    parser.add_argument("--quiet", action="store_true", help="do not log requests to stderr (ours and Werkzeug's)")
    client = parser.add_argument_group("client (instead of serving)")
    client.add_argument("--client", metavar="URL", help="send one request to a running server, e.g. "
                        "http://node:5000/api, and print the JSON response")
    client.add_argument("--prompt", action="append", default=[], help="text to continue (repeat for a batch)")
    client.add_argument("--tokens-to-generate", type=int, default=64, help="tokens to generate (default 64)")
    client.add_argument("--request", metavar="JSON", help="more request fields as a JSON object, e.g. "
                        "'{\"top_k\": 1, \"logprobs\": true}'")


def _client(args: argparse.Namespace) -> int:
    from urllib.error import URLError

    from megatron_hpc.errors import GenerationError
    from megatron_hpc.generate.client import put_api

    if not args.prompt:
        raise GenerationError("nothing to send: pass --prompt TEXT with --client")
    try:
        extra = json.loads(args.request) if args.request else {}
    except json.JSONDecodeError as exc:
        raise GenerationError(f"--request is not JSON ({exc.msg}); e.g. '{{\"top_k\": 1}}'") from None
    if not isinstance(extra, dict):
        raise GenerationError(f"--request must be a JSON object, not {type(extra).__name__}; e.g. '{{\"top_k\": 1}}'")
    body: dict[str, Any] = {"prompts": args.prompt, "tokens_to_generate": args.tokens_to_generate, **extra}
    try:
        status, reply = put_api(args.client, body)
    except URLError as exc:
        raise GenerationError(f"cannot reach {args.client} ({exc.reason}); is `megatron-hpc serve` running "
                              "there, and is the URL http://HOST:PORT/api?") from None
    if status != 200:
        raise GenerationError(f"the server refused the request ({status}): {reply.get('message', reply)}")
    print(json.dumps(reply, indent=1))
    return 0


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SLURM's scancel and torchrun send SIGTERM: stop the server and the followers cleanly


def run(args: argparse.Namespace) -> int:
    if args.client:
        return _client(args)
    from megatron_hpc.errors import GenerationError
    from megatron_hpc.generate.loading import TOKENIZER_FLAGS, end_of_text, load_for_generation, torchrun_context
    from megatron_hpc.generate.serving import Service, follow, start

    if args.path is None:
        raise GenerationError("serve needs a checkpoint: megatron-hpc serve CKPT --port N (or --client URL)")
    ctx = torchrun_context()
    loaded = load_for_generation(args.path, iteration=args.iteration, vocab_file=args.vocab_file,
                                 merge_file=args.merge_file, ctx=ctx)
    if loaded.tokenizer is None:
        raise GenerationError(f"the API takes text prompts and {args.path} has no tokenizer "
                              f"({loaded.no_tokenizer}); pass {TOKENIZER_FLAGS}")
    if ctx is not None and ctx.tp_rank != 0:
        follow(loaded.model)
        return 0
    tok = loaded.tokenizer
    # A run's GPT-2 BPE has a vocab; an imported Llama's or Qwen's tokenizer.json or tokenizer.model has an eod.
    service = Service(model=loaded.model, tokenizer=tok, eod=end_of_text(tok), log=not args.quiet)
    if args.quiet:
        import logging

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = start(service, host=args.host, port=args.port)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    print(f"megatron-hpc serve: iteration {loaded.iteration} at TP {loaded.model.tp_size}, "
          f"PUT http://{args.host}:{server.server_port}/api", file=sys.stderr, flush=True)
    try:
        server.serve_forever()  # Werkzeug's returns on KeyboardInterrupt (Ctrl-C, or SIGTERM above)
    finally:
        print("megatron-hpc serve: stopping", file=sys.stderr)
        server.server_close()
        service.stop_followers()
    return 0
