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


@pytest.fixture(scope="session")
def tp2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GENERATE_MODEL trained 2 steps on synthetic tokens at TP 2 by two real gloo processes: the checkpoint that
    test_generate_cli and test_serve generate and serve from (read only, so one for the session)."""
    import mp_workers

    from megatron_hpc.config.loader import load_recipe

    root = tmp_path_factory.mktemp("gen")
    ckpt = root / "tp2"
    cfg = load_recipe("tiny", [*GENERATE_MODEL, "data.source=synthetic", "parallel.tensor=2", "train.num_steps=2",
                               "train.micro_batch_size=4", "train.global_batch_size=4", "train.tensorboard=false",
                               f"checkpoint.save={ckpt}"])
    mp_workers.spawn(mp_workers.train_runs, world=2, out_dir=root / "out", args=([cfg], str(root / "runs")))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    return ckpt
