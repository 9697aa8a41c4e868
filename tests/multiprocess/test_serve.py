"""`megatron-hpc serve`: Megatron's `PUT /api` over real HTTP on a checkpoint trained at TP=2 (conftest's
tp2_checkpoint, which the generate tests load too). Greedy answers equal `megatron-hpc generate`'s; log-probs equal
a direct forward; bad requests get a one-line 400 and the server goes on; concurrent clients get what they would get
alone; at TP=2 (real gloo processes, rank 0 serving and rank 1 following) the answers equal TP=1's, for that GPT and
a Qwen-style Llama (conftest's generate_checkpoints: grouped-query attention with one key/value group per TP rank,
SwiGLU, RMSNorm, QKV bias)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import Request, urlopen

import mp_workers
import pytest
import torch
from test_generate_cli import FIXTURE
from test_generate_cli import cli_subprocess as _cli

pytestmark = pytest.mark.multiprocess

TOKENIZER = ["--vocab-file", str(FIXTURE / "vocab.json"), "--merge-file", str(FIXTURE / "merges.txt")]
PROMPTS = ["The quick brown", "fox", "the weather today"]


def put(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = Request(url, data=data, method="PUT", headers={"Content-Type": "application/json"})
    try:
        with urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Served:
    """`serve ... --port 0` started as a subprocess: the kernel picks a free port when the server binds, and the
    port is read back from the line serve prints (a port found free beforehand could be taken before the bind).
    A thread drains stderr as it comes, so request logs never fill the pipe, and keeps it for the assertions."""

    _LINE = re.compile(r"PUT (http://[^\s]+/api)")

    def __init__(self, argv: list[str], *, env: dict[str, str], timeout: float = 180, **popen: Any) -> None:
        self.proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, **popen)
        self._lines: list[str] = []
        self._found = threading.Event()
        self.url = ""
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        deadline = time.monotonic() + timeout
        while not self._found.wait(0.2):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()
        assert self.url, self.stderr()  # stderr ended without the line: the server did not start
        self._ready(deadline)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._lines.append(line)
            match = self._LINE.search(line)
            if match and not self.url:
                self.url = match.group(1)
                self._found.set()
        self._found.set()  # the process ended (poll says so) or closed stderr

    def _ready(self, deadline: float) -> None:
        # The line is printed once the socket is bound and listening, just before serve_forever: a request sent now
        # waits in the backlog; a refused one (not yet seen) is retried until the deadline.
        while True:
            try:
                put(self.url, {"prompts": ["x"], "tokens_to_generate": 1})
                return
            except URLError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.stderr()
                time.sleep(0.2)

    def stderr(self) -> str:
        return "".join(self._lines)

    def stop(self) -> str:
        """SIGTERM (what scancel and torchrun send); the server's whole stderr once it has exited."""
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self._drainer.join(timeout=30)  # ends at the end of stderr: when the server and any ranks under it are gone
        return self.stderr()


@pytest.fixture(scope="module")
def server(tp2_checkpoint: Path) -> Any:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    served = Served([sys.executable, "-m", "megatron_hpc", "serve", str(tp2_checkpoint), "--host", "127.0.0.1",
                     "--port", "0", *TOKENIZER], env=env, timeout=120)
    yield served.url
    err = served.stop()
    assert served.proc.returncode == 0, err  # SIGTERM stops it cleanly


def _generate_cli(cli: Any, ckpt: Path, prompt: str, n: int) -> dict[str, Any]:
    proc = cli("generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", str(n), "--json", *TOKENIZER)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["results"][0]


def test_greedy_equals_generate_and_logprobs_a_direct_forward(server, tp2_checkpoint, cli_in_process):
    from megatron_hpc.generate.loading import load_for_generation

    status, out = put(server, {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1, "logprobs": True})
    assert status == 200, out
    import torch.distributed as dist

    assert not dist.is_initialized()
    try:  # the loader makes a one-rank gloo world in this process; the tests after this one need none
        loaded = load_for_generation(tp2_checkpoint, vocab_file=FIXTURE / "vocab.json",
                                     merge_file=FIXTURE / "merges.txt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    tok = loaded.tokenizer
    for i, prompt in enumerate(PROMPTS):
        ref = _generate_cli(cli_in_process, tp2_checkpoint, prompt, 6)
        assert out["tokens"][i] == ref["prompt_ids"] + ref["tokens"]
        assert out["text"][i] == prompt + ref["text"]
        assert out["segments"][i] == [tok.decode([t]) for t in out["tokens"][i]]
        ids = torch.tensor([out["tokens"][i]])
        with torch.no_grad():  # log p of every token after the first, from one plain forward of the whole row
            logp = loaded.model(ids)[0, :-1, :tok.vocab_size].float().log_softmax(-1)
        direct = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(out["logprobs"][i]), direct, rtol=0, atol=1e-4)
    status, plain = put(server, {"prompts": PROMPTS[:1], "tokens_to_generate": 6, "top_k": 1})
    assert status == 200 and plain["logprobs"] is None and plain["tokens"][0] == out["tokens"][0]
    status, only = put(server, {"prompts": PROMPTS[:1], "tokens_to_generate": 0, "logprobs": True})
    assert status == 200 and only["tokens"][0] == out["tokens"][0][:len(only["tokens"][0])]
    assert only["logprobs"][0] == pytest.approx(out["logprobs"][0][:len(only["tokens"][0]) - 1], abs=1e-5)


def test_sampling_fields(server):
    body = {"prompts": PROMPTS, "tokens_to_generate": 8, "temperature": 1.5, "top_k": 40, "random_seed": 3}
    a, b = put(server, body), put(server, body)
    assert a[0] == 200 and a == b  # seeded: the same draws
    other = put(server, {**body, "random_seed": 4})[1]
    greedy = put(server, {**body, "top_k": 1})[1]
    assert other["tokens"] != a[1]["tokens"] and greedy["tokens"] != a[1]["tokens"]
    status, out = put(server, {"prompts": ["", "fox"], "tokens_to_generate": 2, "add_BOS": True, "top_k": 1})
    eod = json.loads((FIXTURE / "vocab.json").read_text())["<|endoftext|>"]
    assert status == 200 and out["tokens"][0][0] == eod and out["tokens"][1][0] == eod
    assert out["text"][0].startswith("<|endoftext|>") and out["text"][1].startswith("<|endoftext|>fox")


def test_bad_requests_get_400_and_the_server_goes_on(server):
    good = {"prompts": ["fox"], "tokens_to_generate": 4, "top_k": 1}
    expected = put(server, good)
    cases = [  # (body, words of the reason)
        ({"tokens_to_generate": 4}, "prompts argument required"),
        ({"prompts": "fox"}, "prompts is not a list of strings"),
        ({"prompts": []}, "prompts is empty"),
        ({"prompts": ["fox"], "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"prompts": ["fox"], "top_p": -0.1}, "top_p must be in (0, 1]"),
        ({"prompts": ["fox"], "tokens_to_generate": 40}, "exceeds the model's context of 32 by"),
        ({"prompts": ["fox " * 40], "tokens_to_generate": 1}, "more than the model's context of 32"),
        ({"prompts": ["fox"], "topk": 3}, "unknown field 'topk'; did you mean 'top_k'?"),
        ({"prompts": ["fox"], "temperature": 0}, "temperature must be a positive number"),
        ({"prompts": ["fox"], "tokens_to_generate": "4"}, "tokens_to_generate must be an integer"),
        ({"prompts": ["fox"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
        ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
        ({"prompts": ["fox"], "beam_width": 2}, "beam search is not supported"),
        ({"prompts": ["fox"], "max_len": 2}, "Replace with tokens_to_generate"),
        ([1, 2], "must be a JSON object"),
    ]
    for body, words in cases:
        status, out = put(server, body)
        assert status == 400 and words in out["message"], (body, out)
        assert "\n" not in out["message"]
        assert put(server, good) == expected
    status, out = put(server, None, raw=b"{not json")
    assert status == 400 and "send a JSON body" in out["message"]
    assert put(server, good) == expected


def test_concurrent_clients_get_what_they_get_alone(server):
    bodies = [{"prompts": [p], "tokens_to_generate": n, "top_k": 1} for p in PROMPTS for n in (3, 7)]
    alone = [put(server, b) for b in bodies]
    got: dict[int, Any] = {}

    def client(i: int) -> None:
        got[i] = put(server, bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(bodies))] == alone
    assert all(status == 200 for status, _ in alone)


def test_cli_client(server):
    proc = _cli("serve", "--client", server, "--prompt", "fox", "--tokens-to-generate", "3",
                "--request", '{"top_k": 1}')
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == put(server, {"prompts": ["fox"], "tokens_to_generate": 3, "top_k": 1})[1]
    proc = _cli("serve", "--client", server, "--prompt", "fox", "--request", '{"top_p": 2.0}')
    assert proc.returncode == 1 and "refused the request (400): top_p must be in (0, 1]" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # The server's root, as a user of Megatron's client (which takes HOST:PORT and adds /api) would type it: Flask's
    # 404 page is HTML; the error stays one line and names the URL that works.
    proc = _cli("serve", "--client", server.removesuffix("/api"), "--prompt", "fox")
    assert proc.returncode == 1 and "(404): NOT FOUND" in proc.stderr and "http://HOST:PORT/api?" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


REQUESTS = [{"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1, "logprobs": True},
            {"prompts": ["fox"], "tokens_to_generate": 40},  # refused before rank 1 hears of it
            {"prompts": PROMPTS, "tokens_to_generate": 6, "temperature": 0.9, "top_k": 30, "random_seed": 5},
            {"prompts": PROMPTS[:2], "tokens_to_generate": 5, "temperature": 1.2, "top_p": 0.8, "random_seed": 6}]


def serve_at_tp(rank: int, world: int, ports: list[int], ckpts: list[str]) -> list[Any]:
    """For each checkpoint: rank 0 serves real HTTP on a free port and sends REQUESTS to itself; the other ranks
    follow."""
    import torch.distributed as dist

    from megatron_hpc.generate.loading import load_for_generation
    from megatron_hpc.generate.serving import Service, follow, start
    from megatron_hpc.parallel.context import ParallelContext
    from megatron_hpc.plan.mesh import Mesh

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{ports[0]}")
    ctx = ParallelContext.build(Mesh(num_nodes=1, workers_per_node=world, tensor_parallel=world), rank=rank)
    results = []
    for ckpt in ckpts:
        loaded = load_for_generation(Path(ckpt), vocab_file=FIXTURE / "vocab.json",
                                     merge_file=FIXTURE / "merges.txt", ctx=ctx if world > 1 else None)
        assert loaded.model.tp_size == world
        if rank > 0:
            out: Any = follow(loaded.model)
        else:
            tok = loaded.tokenizer
            service = Service(model=loaded.model, tokenizer=tok, eod=tok.vocab["<|endoftext|>"], log=False)
            httpd = start(service, host="127.0.0.1", port=0)
            thread = threading.Thread(target=httpd.serve_forever)
            thread.start()
            out = [put(f"http://127.0.0.1:{httpd.server_port}/api", body) for body in REQUESTS]
            httpd.shutdown()
            thread.join()
            service.stop_followers()
        results.append(out)
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, generate_checkpoints: dict[str, Path]) -> dict[str, Any]:
    """serve_at_tp at world 1 and world 2 over the GPT and the Qwen-style Llama checkpoint (one spawn each):
    (checkpoint, world size) -> each rank's answers."""
    root = tmp_path_factory.mktemp("serve_tp")
    names = list(generate_checkpoints)
    ckpts = [str(generate_checkpoints[name]) for name in names]
    out = {}
    for world in (1, 2):
        ranks = mp_workers.spawn(serve_at_tp, world=world, out_dir=root / f"tp{world}", args=(ckpts,))
        out.update({(name, world): [rank[i] for rank in ranks] for i, name in enumerate(names)})
    return out


@pytest.mark.parametrize("checkpoint", ["gpt", "llama"])
def test_tp2_serving_equals_tp1(served: dict[str, Any], checkpoint: str) -> None:
    one, two = served[checkpoint, 1][0], served[checkpoint, 2]
    assert two[1] == len(REQUESTS) - 1  # rank 1 ran every accepted request, then the stop message ended it
    assert [status for status, _ in two[0]] == [200, 400, 200, 200]
    for (s1, r1), (s2, r2) in zip(one, two[0]):
        assert s1 == s2
        if s1 != 200:
            assert r1 == r2
            continue
        assert (r2["tokens"], r2["text"], r2["segments"]) == (r1["tokens"], r1["text"], r1["segments"])
        if r1["logprobs"] is not None:
            for a, b in zip(r1["logprobs"], r2["logprobs"]):
                assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
    assert one[0][1]["tokens"] != one[2][1]["tokens"]  # the sampled requests are not greedy in disguise
    assert served["gpt", 1][0][0][1]["tokens"] != served["llama", 1][0][0][1]["tokens"]  # two models, really


def test_torchrun_tp2_cli_serves_what_tp1_serves(server, tp2_checkpoint):
    """The real `torchrun -m megatron_hpc serve` at TP 2; SIGTERM (what scancel and torchrun send) stops every rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    # --standalone: torchrun's rendezvous store binds a port of the kernel's choosing at once (no --master_port found
    # free beforehand, which another process group could take before the store binds it); --port 0 the same for HTTP
    served = Served([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                     "megatron_hpc", "serve", str(tp2_checkpoint), "--host", "127.0.0.1", "--port", "0",
                     *TOKENIZER], env={**env, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    url = served.url
    body = {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1, "logprobs": True}
    try:
        status, out = put(url, body)
        assert status == 200, out
        ref = put(server, body)[1]
        assert (out["tokens"], out["text"]) == (ref["tokens"], ref["text"])
        for a, b in zip(out["logprobs"], ref["logprobs"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
        assert put(url, {"prompts": ["fox"], "top_p": 2.0})[0] == 400
        assert put(url, body)[1]["tokens"] == out["tokens"]
    finally:
        err = served.stop()
    # torchrun itself reports the signal with a traceback; the ranks (whose lines it prefixes) print none
    assert "at TP 2" in err and "megatron-hpc serve: stopping" in err, err[-3000:]
    assert "[rank0]: Traceback" not in err and "[rank1]: Traceback" not in err, err[-3000:]


def test_an_imported_hf_llama_is_served_with_its_own_tokenizer(tmp_path: Path, cli_in_process) -> None:
    """A Llama imported from a Hugging Face folder carries its tokenizer.json (a HuggingFaceTokenizer, which has an
    eod and no GPT-2 vocab): `serve` starts on it, and a greedy answer is transformers' `generate`, token for token
    (serve looked up GPT-2's <|endoftext|> in tok.vocab and died with an AttributeError before listening)."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    from hf_models import hf_llama_model, save_llama

    theirs = hf_llama_model(kv_heads=1, seed=4).eval()
    folder = save_llama(theirs, tmp_path / "hf", shards=True)
    converted = cli_in_process("ckpt", "convert", str(folder), "--to", "xser", "--out", str(tmp_path / "ours"))
    assert converted.returncode == 0, converted.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    served = Served([sys.executable, "-m", "megatron_hpc", "serve", str(tmp_path / "ours"), "--host", "127.0.0.1",
                     "--port", "0", "--quiet"], env=env, timeout=120)
    try:
        status, reply = put(served.url, {"prompts": ["the quick brown fox"], "tokens_to_generate": 12, "top_k": 1})
    finally:
        err = served.stop()
    assert status == 200 and served.proc.returncode == 0, (reply, err)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok("the quick brown fox", return_tensors="pt").input_ids
    want = theirs.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id,
                           eos_token_id=None)[0].tolist()
    got = reply["tokens"][0]
    assert got[:prompt.shape[1]] == prompt[0].tolist()
    # It stops at the tokenizer's end-of-sequence id, as the HF default does; up to there the tokens are equal.
    assert got == want[:len(got)] and (len(got) == len(want) or got[-1] == tok.eos_token_id), (got, want)
