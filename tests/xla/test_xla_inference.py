"""`megatron-hpc evaluate` and `generate` on real torch-xla (XLA:CPU, one process) against the CPU: marker `xla`.

One tiny run of each family is trained on the CPU and saved -- GPT-NeoX-style (rotary on half of each head, parallel
residual, untied output) and Llama-style (RMSNorm, SwiGLU, grouped-query attention 4:2, no biases, untied output);
its recipe names trn1 but the run was planned on the CPU, so evaluate and generate pick the CPU by default (the
platform the run's plan ran on, as a `submit --platform cpu` of such a recipe) and XLA with --platform trn1. Run
with bash tests/xla/run.sh (see test_real_torch_xla.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.xla

TRAIN = r"""
import json
import sys
import numpy as np
from pathlib import Path
from megatron_hpc.config.schema import (CheckpointConfig, DataConfig, LaunchConfig, ModelConfig, OptimConfig,
                                         RunConfig, TrainConfig)
from megatron_hpc.data.indexed import IndexedDatasetWriter
from megatron_hpc.train.entry import plan_for_torchrun, run_training
tmp = Path(sys.argv[1])
rng = np.random.default_rng(0)
with IndexedDatasetWriter(str(tmp / "corpus"), dtype=np.uint16) as writer:
    for _ in range(120):
        writer.add_document(rng.integers(0, 500, size=int(rng.integers(5, 60))))
cfg = RunConfig(
    name="tiny",
    model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                      vocab_size=500, position_embedding="rope", tie_embeddings=False, init_method_std=0.2,
                      **json.loads(sys.argv[2])),
    train=TrainConfig(num_steps=1, micro_batch_size=2, global_batch_size=4, log_interval=1, eval_iters=2,
                      eval_test=False, tensorboard=False),
    optim=OptimConfig(lr=3e-3, lr_warmup_iters=0, lr_decay_style="constant"),
    data=DataConfig(source="indexed", path=str(tmp / "corpus"), split="80,10,10", cache_path=str(tmp / "cache")),
    checkpoint=CheckpointConfig(save=str(tmp / "ckpt")),
    launch=LaunchConfig(platform="trn1"),  # the recipe's; the plan below is the CPU's (what evaluate defaults to)
)
assert run_training(plan_for_torchrun(cfg, platform="cpu"), run_dir=tmp / "run") == 0
"""

# One process for every check (each start imports torch and torch_xla): the compile counts first, while no graph
# of this model exists yet, then the commands in-process, on XLA (--platform trn1) and on the run's own platform (the
# CPU).
INFER = r"""
import contextlib, io, json, sys
from pathlib import Path
import torch_xla
import torch_xla.debug.metrics as met
from megatron_hpc.cli.main import main
from megatron_hpc.generate.engine import generate
from megatron_hpc.generate.loading import load_for_generation
from megatron_hpc.generate.sampling import SamplingParams
ckpt = sys.argv[1]
model = load_for_generation(Path(ckpt)).model.to(torch_xla.device())


def compiles():
    data = met.metric_data("CompileTime")
    return 0 if data is None else data[0]


counts, outputs = [], []
for prompts, new in [([[3, 4, 5], [7, 8, 9, 10, 11, 12]], 3), ([[3, 4, 5], [7, 8, 9, 10, 11, 12]], 20),
                     ([[9, 9, 9, 9, 1, 2], [5]], 12)]:
    before = compiles()
    outputs.append([g.tokens for g in generate(model, prompts, SamplingParams(max_new_tokens=new))])
    counts.append(compiles() - before)


def cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--json"]) == 0
    return json.loads(out.getvalue())


prompts = ["--prompt-ids", "3,4,5", "--prompt-ids", "7,8,9,10,11,12,13,14,15"]  # a left-padded batch
sampled = ["--temperature", "0.8", "--top-k", "40", "--seed", "7"]
report = {"compiles": counts, "outputs": outputs}
for name, platform in (("xla", ["--platform", "trn1"]), ("cpu", [])):
    report[name] = {
        "evaluate": cli("evaluate", ckpt, "--split", "test", *platform),
        "greedy": cli("generate", ckpt, *prompts, "--max-new-tokens", "12", *platform),
        "sampled": cli("generate", ckpt, *prompts, "--max-new-tokens", "12", *sampled, *platform),
    }
print(json.dumps(report))
"""


def _python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


FAMILIES = {
    "neox": {"rotary_percent": 0.5, "parallel_residual": True},
    "llama": {"normalization": "rmsnorm", "swiglu": True, "num_query_groups": 2, "add_bias_linear": False,
              "ffn_hidden_size": 96},
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    tmp = tmp_path_factory.mktemp(f"xlainfer-{request.param}")
    _python(env, "-c", TRAIN, str(tmp), json.dumps(FAMILIES[request.param]))
    return tmp / "ckpt"


@pytest.fixture(scope="module")
def runs(env: dict[str, str], ckpt: Path) -> dict[str, Any]:
    return json.loads(_python(env, "-c", INFER, str(ckpt)).stdout.strip().splitlines()[-1])


def test_evaluate_on_xla_equals_the_cpu(runs: dict[str, Any]) -> None:
    xla, cpu = runs["xla"]["evaluate"], runs["cpu"]["evaluate"]  # cpu: the platform the run's plan ran on
    assert (xla["device"], cpu["device"]) == ("xla", "cpu")
    assert xla["splits"]["test"]["samples"] == cpu["splits"]["test"]["samples"] == 8
    assert xla["splits"]["test"]["loss"] == pytest.approx(cpu["splits"]["test"]["loss"], rel=1e-5)


def test_generate_on_xla_gives_the_cpu_tokens(runs: dict[str, Any]) -> None:
    for kind in ("greedy", "sampled"):
        xla, cpu = runs["xla"][kind], runs["cpu"][kind]
        assert (xla["device"], cpu["device"]) == ("xla", "cpu")
        assert [r["tokens"] for r in xla["results"]] == [r["tokens"] for r in cpu["results"]], kind
        assert [len(r["tokens"]) for r in cpu["results"]] == [12, 12]
        for x, c in zip(xla["results"], cpu["results"]):
            assert x["logprobs"] == pytest.approx(c["logprobs"], abs=1e-4)
    greedy, sampled = runs["cpu"]["greedy"]["results"], runs["cpu"]["sampled"]["results"]
    assert [r["tokens"] for r in greedy] != [r["tokens"] for r in sampled]  # the seeded run did sample


def test_decode_steps_share_one_graph(runs: dict[str, Any]) -> None:
    """The KV cache keeps one shape and a step's columns come as data: more new tokens compile nothing new."""
    first, longer, other_prompts = runs["compiles"]
    assert 1 <= first <= 4  # the prefill and one decode step (the sampling is in their graphs)
    assert longer == 0  # 20 new tokens instead of 3
    assert other_prompts == 0  # other prompts, same batch size and longest prompt
    assert [row[:3] for row in runs["outputs"][1]] == runs["outputs"][0]  # greedy: the longer run extends the shorter
