"""`megatron-hpc serve`: Megatron's `PUT /api` on rank 0, one generation at a time, the other TP ranks following.

Flask answers each request on its own thread (Werkzeug's threaded server): parsing, tokenizing and the checks
that give a 400 run there, concurrently. The generations queue (first in, first out) for one long-lived worker
thread, so under TP the collectives of two requests never interleave, and torch's per-thread state stays warm
(a fresh thread per generation cost about 2 ms more on the 2-core VM). Rank 0 broadcasts each Job (token ids and
SamplingParams) to the TP group before running it; the followers run the same `run_job` and meet it in every
collective. A None broadcast (the server stopping) ends the followers.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from flask import Flask, jsonify, request
from werkzeug.serving import BaseWSGIServer, make_server

from megatron_hpc.errors import GenerationError
from megatron_hpc.generate.api import Job, Tokenizer, parse_request, response
from megatron_hpc.generate.engine import check_prompts, generate, prompt_logprobs
from megatron_hpc.generate.kv_cache import context_length
from megatron_hpc.model.gpt import GPT


@dataclass(frozen=True, kw_only=True, slots=True)
class JobResult:
    new_tokens: list[list[int]]
    new_logprobs: list[list[float]]
    prompt_logprobs: list[list[float]] | None


def check_job(model: GPT, job: Job) -> None:
    """The checks `generate` would make, run before any rank is told about the job."""
    check_prompts(job.prompts, context=context_length(model), vocab_size=model.vocab_size,
                  max_new_tokens=job.params.max_new_tokens if job.params else 0)


def run_job(model: GPT, job: Job) -> JobResult:
    """What every rank of the TP group runs for one request (all of them, with the same job)."""
    new, logps = [[] for _ in job.prompts], [[] for _ in job.prompts]
    if job.params is not None:
        gens = generate(model, job.prompts, job.params)
        new, logps = [g.tokens for g in gens], [g.logprobs for g in gens]
    return JobResult(new_tokens=new, new_logprobs=logps,
                     prompt_logprobs=prompt_logprobs(model, job.prompts) if job.logprobs else None)


def _broadcast(job: Job | None, model: GPT) -> Job | None:
    box = [job]
    dist.broadcast_object_list(box, src=dist.get_global_rank(model.group, 0), group=model.group)
    return box[0]


def follow(model: GPT) -> int:
    """A following rank's loop: run every job rank 0 broadcasts until it says stop. Returns the jobs run."""
    done = 0
    while (job := _broadcast(None, model)) is not None:
        try:
            run_job(model, job)
        except GenerationError as exc:  # rank 0 meets the same error in the same place and answers it
            print(f"megatron-hpc serve: rank {model.tp_rank}: {exc}", file=sys.stderr)
        done += 1
    return done


@dataclass(kw_only=True)
class Service:
    """Rank 0's side: requests in, Megatron's responses out, generations one at a time on one worker thread."""
    model: GPT
    tokenizer: Tokenizer
    eod: int | None
    log: bool = True
    queue: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="generate"))

    @property
    def leads(self) -> bool:
        return self.model.tp_size > 1

    def _run(self, job: Job) -> JobResult:
        if self.leads:
            _broadcast(job, self.model)
        return run_job(self.model, job)

    def handle(self, body: Any) -> dict[str, Any]:
        job = parse_request(body, self.tokenizer, eod=self.eod)
        check_job(self.model, job)  # a 400 here never reaches the followers
        if self.log and not (isinstance(body, dict) and body.get("no_log")):
            print(f"megatron-hpc serve: {len(job.prompts)} prompt(s), "
                  f"{job.params.max_new_tokens if job.params else 0} tokens", file=sys.stderr, flush=True)
        result = self.queue.submit(self._run, job).result()
        return response(job, result.new_tokens, result.prompt_logprobs, result.new_logprobs, self.tokenizer)

    def _stop(self) -> None:
        try:
            _broadcast(None, self.model)
        except RuntimeError:  # torchrun and scancel signal every rank: the followers may be gone already
            print("megatron-hpc serve: the following ranks had already stopped", file=sys.stderr)

    def stop_followers(self) -> None:
        """After the queued generations, tell the followers to stop; then end the worker thread."""
        if self.leads:
            self.queue.submit(self._stop).result()
        self.queue.shutdown()


def make_app(service: Service) -> Flask:
    app = Flask("megatron_hpc.serve")

    @app.put("/api")
    def api() -> Any:
        body = request.get_json(silent=True)
        if body is None:
            return jsonify(message='send a JSON body with Content-Type: application/json, e.g. '
                                   '{"prompts": ["Hello"], "tokens_to_generate": 8}'), 400
        try:
            return jsonify(service.handle(body))
        except GenerationError as exc:
            return jsonify(message=str(exc)), 400

    return app


def start(service: Service, *, host: str, port: int) -> BaseWSGIServer:
    """A threaded Werkzeug server for `service`, bound (port 0: a free one, see `.server_port`), not yet serving."""
    return make_server(host, port, make_app(service), threaded=True)
