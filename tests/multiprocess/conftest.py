"""Markers for the multiprocess tier (also declared in pyproject.toml; repeated here so the tier
runs under a bare `pytest tests/multiprocess -p no:cacheprovider` too), and the checkpoints that several
modules of the tier load, trained once a session."""

from __future__ import annotations

from pathlib import Path

import pytest

GENERATE_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
                  "model.max_position_embeddings=32", "model.vocab_size=400", "model.make_vocab_size_divisible_by=64",
                  "model.init_method_std=0.2"]
"""The `tiny` recipe at the size of the preprocess fixture's tokenizer (400 tokens)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiprocess: real processes talking over gloo on CPU")


LLAMA_MODEL = ["model.normalization=rmsnorm", "model.swiglu=true", "model.num_query_groups=2",
               "model.add_bias_linear=false", "model.add_qkv_bias=true", "model.tie_embeddings=false",
               "model.position_embedding=rope", "model.rope_scaling=llama3", "model.ffn_hidden_size=128"]
"""GENERATE_MODEL's overrides that make it a Qwen2-style Llama (mp_workers.LLAMA with a QKV bias): 4 heads sharing 2
key/value groups, so TP 2 holds one group per rank."""


@pytest.fixture(scope="session")
def generate_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GENERATE_MODEL ("gpt") and GENERATE_MODEL + LLAMA_MODEL ("llama") trained 2 steps on synthetic tokens at TP 2
    by two real gloo processes (one spawn): the checkpoints that test_generate_cli, test_serve and
    test_evaluate_test_split generate, serve and evaluate from (read only, so one each for the session)."""
    import mp_workers

    from megatron_hpc.config.loader import load_recipe

    root = tmp_path_factory.mktemp("gen")
    ckpts = {"gpt": root / "tp2", "llama": root / "tp2_llama"}
    configs = [load_recipe("tiny", [*GENERATE_MODEL, *(LLAMA_MODEL if name == "llama" else []),
                                    "data.source=synthetic", "parallel.tensor=2", "train.num_steps=2",
                                    "train.micro_batch_size=4", "train.global_batch_size=4",
                                    "train.tensorboard=false", f"checkpoint.save={ckpt}"])
               for name, ckpt in ckpts.items()]
    mp_workers.spawn(mp_workers.train_runs, world=2, out_dir=root / "out", num_ports=len(configs),
                     args=(configs, str(root / "runs")))
    for ckpt in ckpts.values():
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    return ckpts


@pytest.fixture(scope="session")
def tp2_checkpoint(generate_checkpoints: dict[str, Path]) -> Path:
    """generate_checkpoints' GPT."""
    return generate_checkpoints["gpt"]


@pytest.fixture(scope="session")
def llama_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """The one-process references of the Llama proofs, 20 steps each in one spawn: "llama" (mp_workers.llama on the
    4-layer pipeline_config) and "qwen" (the same with a QKV bias). The parallel, sequence-parallel, pipeline,
    distributed-optimizer and recompute modules compare their Llama runs of that shape with these."""
    import mp_workers

    root = tmp_path_factory.mktemp("llama_reference")
    configs = {"llama": mp_workers.llama(mp_workers.pipeline_config()),
               "qwen": mp_workers.llama(mp_workers.pipeline_config(), qkv_bias=True)}
    mp_workers.spawn(mp_workers.fault_runs, world=1, out_dir=root, num_ports=len(configs),
                     args=(list(configs.values()), [""] * len(configs), str(root)))
    return {name: mp_workers.metrics(root / f"run{i}") for i, name in enumerate(configs)}
