"""Megatron's `PUT /api` fields to a Job (megatron_hpc/generate/api.py), with the real GPT-2 BPE tokenizer of the
preprocess fixture: Megatron's defaults and their mapping onto SamplingParams, refusals, the response fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hpc.data.tokenizer import GPT2BPETokenizer
from megatron_hpc.generate.api import Job, RequestError, cut_double_eol, parse_request, response
from megatron_hpc.generate.sampling import SamplingParams

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "preprocess"


@pytest.fixture(scope="module")
def tok() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(FIXTURE / "vocab.json", FIXTURE / "merges.txt")


def test_megatron_defaults_sample_the_whole_distribution(tok):
    job = parse_request({"prompts": ["fox", "The quick"]}, tok, eod=tok.eod)
    assert job.prompts == [tok.encode("fox"), tok.encode("The quick")] and not job.logprobs
    # 64 tokens, temperature 1, no top-k, top_p 0 meaning off, no seed, stop at <|endoftext|>
    assert job.params == SamplingParams(max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0, seed=None,
                                        stop_tokens=(tok.eod,))
    assert not job.params.greedy


def test_fields_map_onto_sampling_params(tok):
    job = parse_request({"prompts": ["fox"], "tokens_to_generate": 5, "temperature": 0.7, "top_k": 1, "top_p": 0.9,
                         "random_seed": 3, "logprobs": True, "add_BOS": True, "stop_token": 7}, tok, eod=tok.eod)
    assert job.prompts == [[tok.eod, *tok.encode("fox")]] and job.logprobs
    assert job.params == SamplingParams(max_new_tokens=5, temperature=0.7, top_k=1, top_p=0.9, seed=3,
                                        stop_tokens=(7,))
    assert job.params.greedy
    only = parse_request({"prompts": ["fox"], "tokens_to_generate": 0, "logprobs": True}, tok, eod=tok.eod)
    assert only.params is None and only.logprobs


def test_end_of_line_stops(tok):
    (nl,), (nlnl,) = tok.encode("\n"), tok.encode("\n\n")
    eol = parse_request({"prompts": ["a"], "stop_on_eol": True}, tok, eod=tok.eod)
    assert eol.params.stop_tokens == (tok.eod, nl, nlnl) and eol.double_eol is None
    double = parse_request({"prompts": ["a"], "stop_on_double_eol": True}, tok, eod=tok.eod)
    assert double.params.stop_tokens == (tok.eod, nlnl) and double.double_eol == nl
    assert cut_double_eol([5, nl, 6, nl, nl, 9, 9], nl) == 5
    assert cut_double_eol([5, nl, 6], nl) == 3 and cut_double_eol([5, nl, nl], None) == 3


@pytest.mark.parametrize("body, words", [
    ({}, "prompts argument required"),
    ({"prompts": [1, 2]}, "prompts is not a list of strings"),
    ({"prompts": ["a"] * 129}, "Maximum number of prompts is 128 (got 129)"),
    ({"prompts": ["a"], "top_p": 1.01}, "top_p must be in (0, 1], or 0 to turn it off (got 1.01)"),
    ({"prompts": ["a"], "top_p": "0.5"}, "top_p must be a number"),
    ({"prompts": ["a"], "top_k": 1001}, "less than or equal to 1000 (got 1001)"),
    ({"prompts": ["a"], "top_k": True}, "top_k must be an integer"),
    ({"prompts": ["a"], "temperature": 101}, "less than or equal to 100.0 (got 101)"),
    ({"prompts": ["a"], "random_seed": -2}, "random_seed must be a positive integer"),
    ({"prompts": ["a"], "logprobs": 1}, "logprobs must be a boolean value (got 1)"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, "greater than or equal to 0 (got -1)"),
    ({"prompts": ["a"], "prompt": ["b"]}, "unknown field 'prompt'; did you mean 'prompts'?"),
    ({"prompts": ["a"], "sentences": ["b"]}, "sentences is no longer used.  Replace with prompts"),
    ({"prompts": ["a"], "top_p_decay": 0.5}, "top_p_decay is not supported"),
    ("a", "must be a JSON object"),
])
def test_refusals_are_one_line(tok, body, words):
    with pytest.raises(RequestError) as info:
        parse_request(body, tok, eod=tok.eod)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_response_fields(tok):
    prompt = tok.encode("fox")
    job = Job(prompts=[prompt], params=SamplingParams(max_new_tokens=3), logprobs=True)
    out = response(job, [[11, 12, 13]], [[-1.0] * (len(prompt) - 1)], [[-0.5, -0.25, -0.125]], tok)
    assert out["tokens"] == [[*prompt, 11, 12, 13]]
    assert out["text"] == [tok.decode([*prompt, 11, 12, 13])]
    assert out["segments"] == [[tok.decode([t]) for t in [*prompt, 11, 12, 13]]]
    assert out["logprobs"] == [[-1.0] * (len(prompt) - 1) + [-0.5, -0.25, -0.125]]
    no_lp = response(Job(prompts=[prompt], params=None, logprobs=False), [[]], None, [[]], tok)
    assert no_lp["logprobs"] is None and no_lp["tokens"] == [prompt]
