"""Megatron-LM's text generation API (`PUT /api`): a request's JSON checked and turned into a `Job` (token ids
and SamplingParams, what every rank runs), and a job's results turned into Megatron's response fields.

Field names, defaults and the wording of the refusals follow Megatron-LM's `MegatronGenerate.put`
(megatron/text_generation_server.py, read 2026-11-24), with these differences, each a refusal or a superset:
- every refusal is a 400 (Megatron answers some with 200 and the message as the body);
- an unknown field is refused with the closest valid one (Megatron ignores it, so a typo silently samples);
- beam search and its fields, top_p_decay, top_p_bound and prevent_newline_after_colon are refused by name;
- top_k and top_p may be combined (Megatron refuses both at once); top_p may be given as an int (1 or 0).
Megatron's defaults are kept: 64 tokens, temperature 1.0, top_k 0 and top_p 0 (off), that is sampling from the
whole distribution; greedy is `top_k: 1`.

Pure apart from the tokenizer: no torch, no HTTP.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_hpc.errors import GenerationError
from megatron_hpc.generate.sampling import SamplingParams

MAX_PROMPTS = 128
"""Megatron's limit on prompts per request."""
DEFAULT_TOKENS = 64
"""Megatron's default tokens_to_generate."""
FIELDS = ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS",
          "stop_on_double_eol", "stop_on_eol", "random_seed", "no_log", "stop_token")
UNSUPPORTED = {
    "beam_width": "beam search is not supported; drop beam_width (and length_penalty) to sample or use top_k 1",
    "length_penalty": "length_penalty only applies to beam search, which is not supported; drop it",
    "top_p_decay": "top_p_decay is not supported; drop it (top_p stays fixed through the generation)",
    "top_p_bound": "top_p_bound is not supported; drop it (top_p stays fixed through the generation)",
    "prevent_newline_after_colon": "prevent_newline_after_colon is not supported; drop it",
    "max_len": "max_len is no longer used.  Replace with tokens_to_generate",
    "sentences": "sentences is no longer used.  Replace with prompts",
}
"""Megatron fields we refuse (the last two with Megatron's own words)."""


class RequestError(GenerationError):
    """A request the server answers with 400: the message is the one-line reason."""


class Tokenizer(Protocol):
    vocab: dict[str, int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """What every rank runs for one request: broadcast as is from the serving rank to the followers."""
    prompts: list[list[int]]
    params: SamplingParams | None
    """None when tokens_to_generate is 0 (log-probs of the prompts only)."""
    logprobs: bool
    double_eol: int | None = None
    """Cut a row after two "\\n" tokens in a row (stop_on_double_eol): the id of "\\n"."""


def _typed(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any, why: str) -> Any:
    if name not in body:
        return default
    value = body[name]
    # bool is an int in Python, but a JSON true is no count, seed or temperature
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise RequestError(f"{why} (got {value!r})")
    return value


def _check_fields(body: Mapping[str, Any]) -> None:
    for name in body:
        if name in UNSUPPORTED:
            raise RequestError(UNSUPPORTED[name])
        if name not in FIELDS:
            close = difflib.get_close_matches(str(name), FIELDS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(FIELDS)}"
            raise RequestError(f"unknown field {name!r}; {hint}")
    if "prompts" not in body:
        raise RequestError("prompts argument required")


def _prompts(body: Mapping[str, Any], *, add_bos: bool) -> list[str]:
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS} (got {len(prompts)}); split the request")
    if any(not p for p in prompts) and not add_bos:
        raise RequestError("Empty prompts require add_BOS=true")
    return prompts


def _sampling(body: Mapping[str, Any], tokens: int, stops: tuple[int, ...]) -> SamplingParams:
    temperature = _typed(body, "temperature", (int, float), 1.0,
                         "temperature must be a positive number less than or equal to 100.0")
    if not 0.0 < temperature <= 100.0:
        raise RequestError(f"temperature must be a positive number less than or equal to 100.0 (got {temperature})")
    top_k = _typed(body, "top_k", (int,), 0,
                   "top_k must be an integer equal to or greater than 0 and less than or equal to 1000")
    if not 0 <= top_k <= 1000:
        raise RequestError(f"top_k must be equal to or greater than 0 and less than or equal to 1000 (got {top_k})")
    top_p = _typed(body, "top_p", (int, float), 0.0, "top_p must be a number in [0, 1] (0: off)")
    if not 0.0 <= top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], or 0 to turn it off (got {top_p})")
    seed = _typed(body, "random_seed", (int,), -1, "random_seed must be integer")
    if seed < -1:
        raise RequestError(f"random_seed must be a positive integer, or -1 for a fresh one (got {seed})")
    return SamplingParams(max_new_tokens=tokens, temperature=float(temperature), top_k=top_k,
                          top_p=float(top_p) if top_p > 0 else 1.0, seed=None if seed == -1 else seed,
                          stop_tokens=stops)


def _eol_ids(tok: Tokenizer) -> tuple[int | None, int | None]:
    """Ids of the tokens "\\n" and "\\n\\n" (Megatron hard-codes GPT-2's 198 and 628)."""
    one, two = tok.encode("\n"), tok.encode("\n\n")
    return (one[0] if len(one) == 1 else None), (two[0] if len(two) == 1 else None)


def parse_request(body: Any, tok: Tokenizer, *, eod: int | None) -> Job:
    """A Job from a request's JSON body; RequestError (one line, the fix) for anything Megatron would refuse."""
    if not isinstance(body, dict):
        raise RequestError('the body must be a JSON object, e.g. {"prompts": ["Hello"], "tokens_to_generate": 8}')
    _check_fields(body)
    add_bos = _typed(body, "add_BOS", (bool,), False, "add_BOS must be a boolean value")
    prompts = _prompts(body, add_bos=add_bos)
    tokens = _typed(body, "tokens_to_generate", (int,), DEFAULT_TOKENS,
                    "tokens_to_generate must be an integer greater than 0")
    if tokens < 0:
        raise RequestError(f"tokens_to_generate must be an integer greater than or equal to 0 (got {tokens})")
    logprobs = _typed(body, "logprobs", (bool,), False, "logprobs must be a boolean value")
    if tokens == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    for name in ("stop_on_eol", "stop_on_double_eol", "no_log"):
        _typed(body, name, (bool,), False, f"{name} must be a boolean value")
    stop = _typed(body, "stop_token", (int,), eod, "stop_token must be an integer")
    stops = () if stop is None else (stop,)
    one, two = _eol_ids(tok)
    if body.get("stop_on_eol"):
        stops += tuple(t for t in (one, two) if t is not None)
    elif body.get("stop_on_double_eol") and two is not None:
        stops += (two,)
    params = _sampling(body, tokens, stops) if tokens else None
    bos = [] if eod is None or not add_bos else [eod]
    if add_bos and eod is None:
        raise RequestError("add_BOS needs a tokenizer with <|endoftext|>, and this one has none; drop add_BOS")
    return Job(prompts=[bos + tok.encode(p) for p in prompts], params=params, logprobs=logprobs,
               double_eol=one if body.get("stop_on_double_eol") and not body.get("stop_on_eol") else None)


def cut_double_eol(tokens: list[int], eol: int | None) -> int:
    """How many of `tokens` to keep: up to and including the second of two "\\n" in a row."""
    if eol is not None:
        for i in range(1, len(tokens)):
            if tokens[i] == eol and tokens[i - 1] == eol:
                return i + 1
    return len(tokens)


def response(job: Job, new_tokens: list[list[int]], prompt_logprobs: list[list[float]] | None,
             new_logprobs: list[list[float]], tok: Tokenizer) -> dict[str, Any]:
    """Megatron's response fields: `text` (prompt and continuation), `segments` (each token's text), `logprobs`
    (of every token after the first, null unless asked for) and `tokens` (all ids, as the mcore server adds)."""
    text, segments, tokens, logprobs = [], [], [], []
    for i, (prompt, new) in enumerate(zip(job.prompts, new_tokens)):
        keep = cut_double_eol(new, job.double_eol)
        ids = prompt + new[:keep]
        tokens.append(ids)
        text.append(tok.decode(ids))
        segments.append([tok.decode([t]) for t in ids])
        if prompt_logprobs is not None:
            logprobs.append(prompt_logprobs[i] + new_logprobs[i][:keep])
    return {"text": text, "segments": segments, "logprobs": logprobs if job.logprobs else None, "tokens": tokens}
