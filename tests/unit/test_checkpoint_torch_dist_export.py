"""`ckpt convert ... --to torch_dist` writes what megatron-core wrote: the real fixtures
(make_megatron_core_torch_dist.py) converted to our layout and back hold megatron-core's own tensors under
megatron-core's keys, read with plain torch.distributed.checkpoint, and our reader takes the written folder back to
the same model and Adam state. That megatron-core itself loads the written folders and takes the
same next step is tests/fixtures/megatron_core_torch_dist/load_back.sh's record (load_back.json), run by hand in the
fixtures' megatron-core venv."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_hpc.checkpoint.conversion import read_whole
from megatron_hpc.checkpoint.conversion.optim_layout import by_name
from megatron_hpc.checkpoint.foreign import export_torch_dist
from megatron_hpc.cli.main import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_core_torch_dist"
ITER = "iter_0000003"


def dcp_tensors(folder: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Keys of a torch_dist folder read with torch.distributed.checkpoint alone (its default planner)."""
    metadata = FileSystemReader(folder).read_metadata()
    wanted = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata) and (keys is None or k in keys)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(wanted, storage_reader=FileSystemReader(folder), no_dist=True)
    return wanted


def _convert(src: Path, out: Path, *args: str) -> None:
    assert main(["ckpt", "convert", str(src), "--out", str(out), *args]) == 0


@pytest.fixture(scope="module")
def llama_ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "ours"
    _convert(FIXTURES / "llama_tp2_distopt", out, "--to", "xser", "--tp", "1")
    return out


def test_the_written_folder_holds_megatron_cores_own_tensors(llama_ours: Path, tmp_path: Path) -> None:
    """The Llama fixture (TP 2, distributed optimizer, fully_reshardable) through our layout at TP 1 and back at
    TP 2: every model and Adam tensor megatron-core saved, at its key, equal to the last bit (the grouped QKV, the
    [gate; up] linear_fc1 and the layer stacking undone and redone), the same layout markers, and the scheduler."""
    _convert(llama_ours, tmp_path / "back", "--to", "torch_dist", "--tp", "2", "--distributed-optimizer")
    # torch.save wrote the .distcp records without its slow crc32 (torch.load never checks it), and the process-wide
    # or per-thread option is back as it was for whatever this process saves next
    assert torch.serialization.get_crc32_options()
    written = tmp_path / "back" / ITER
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert json.loads((written / "metadata.json").read_text()) == json.loads(
        (FIXTURES / "llama_tp2_distopt" / ITER / "metadata.json").read_text())
    theirs = dcp_tensors(FIXTURES / "llama_tp2_distopt" / ITER)
    ours = dcp_tensors(written, list(theirs))
    assert sorted(ours) == sorted(theirs)
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    common = torch.load(written / "common.pt", weights_only=False)
    original = torch.load(FIXTURES / "llama_tp2_distopt" / ITER / "common.pt", weights_only=False)
    assert common["opt_param_scheduler"] == original["opt_param_scheduler"]
    assert common["content_metadata"] == original["content_metadata"]
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert [g["step"] for g in common["optimizer"]["optimizer"]["param_groups"]] == [3.0, 3.0]
    assert (common["args"].tensor_model_parallel_size, common["args"].num_query_groups, common["args"].swiglu,
            common["args"].normalization) == (2, 2, True, "RMSNorm")


def test_plain_adams_form_and_its_step(tmp_path: Path) -> None:
    """Without --distributed-optimizer: optimizer.state.exp_avg / exp_avg_sq / fp32_param beside common_step, the
    form megatron-core's own non-distributed Adam saved in the GPT TP 2 fixture (the same keys and values)."""
    _convert(FIXTURES / "gpt_tp2", tmp_path / "back", "--to", "torch_dist")
    written = tmp_path / "back" / ITER
    theirs = dcp_tensors(FIXTURES / "gpt_tp2" / ITER)
    ours = dcp_tensors(written)
    assert set(theirs) <= set(ours)
    assert {k for k in set(ours) - set(theirs)} == {k for k in ours if k.startswith("optimizer.state.fp32_param.")}
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), key
    common = torch.load(written / "common.pt", weights_only=False)
    assert float(common["optimizer"]["state"]["common_step"]) == 3.0
    assert "param_state_sharding_type" not in common["optimizer"]


def test_plain_adam_also_in_the_bf16_runs_form(tmp_path: Path) -> None:
    """A --bf16 run without the distributed optimizer (Float16OptimizerWithFloat16Params) reads torch's state dict
    nested under 'optimizer' and refused the top-level form alone (KeyError 'pre_wd_mult' in megatron-core 0.16.1's
    load_state_dict); the export holds both, the nested one as megatron-core saved it in the real llama_bf16_tp2
    fixture, with the same optimizer tensors (fp32 masters and moments) by key and value. load_back.json records
    megatron-core --bf16 continuing from it."""
    _convert(FIXTURES / "llama_bf16_tp2", tmp_path / "back", "--to", "torch_dist")
    written = tmp_path / "back" / ITER
    theirs = torch.load(FIXTURES / "llama_bf16_tp2" / ITER / "common.pt", weights_only=False)["optimizer"]
    ours = torch.load(written / "common.pt", weights_only=False)["optimizer"]
    identity = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")  # optimizer.py's group identifiers
    for form in (ours, ours["optimizer"]):  # FP32Optimizer's, then Float16OptimizerWithFloat16Params'
        assert float(form["state"]["common_step"]) == float(theirs["optimizer"]["state"]["common_step"]) == 3.0
        assert ([tuple(g[k] for k in identity) for g in form["param_groups"]]
                == [tuple(g[k] for k in identity) for g in theirs["optimizer"]["param_groups"]])
    want = {k: v for k, v in dcp_tensors(FIXTURES / "llama_bf16_tp2" / ITER).items() if k.startswith("optimizer.")}
    got = dcp_tensors(written)
    assert want and set(want) <= set(got)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key


@pytest.mark.parametrize("sizes", [("--tp", "2", "--pp", "1"), ("--tp", "1", "--pp", "2")])
def test_our_reader_takes_the_written_folder_back(llama_ours: Path, tmp_path: Path, sizes: tuple[str, ...]) -> None:
    """ours -> torch_dist (at TP 2 or PP 2) -> ours again: the same weights, Adam moments and step, progress and
    model config as the first conversion."""
    _convert(llama_ours, tmp_path / "back", "--to", "torch_dist", *sizes)
    _convert(tmp_path / "back", tmp_path / "again", "--to", "torch", "--tp", "1", "--pp", "1")
    first, again = read_whole(llama_ours).first, read_whole(tmp_path / "again").first
    assert again["resolved_config"]["model"] == first["resolved_config"]["model"]
    assert (again["iteration"], again["consumed_train_samples"], again["lr_scheduler"]) == (
        first["iteration"], first["consumed_train_samples"], first["lr_scheduler"])
    assert sorted(again["model"]) == sorted(first["model"])
    for name, weight in first["model"].items():
        assert torch.equal(again["model"][name], weight), name
    moments, want = by_name(again["model"], again["optimizer"]), by_name(first["model"], first["optimizer"])
    for name, m in want.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(moments[name][key], m[key]), (name, key)


def test_weights_only_when_the_lr_schedule_is_unknown(llama_ours: Path, tmp_path: Path) -> None:
    """A checkpoint without optim and train settings (as a Hugging Face import has none) is written weights only,
    its args saying no_save_optim, so Megatron-LM does not look for Adam's state; the note says how to load it."""
    whole = read_whole(llama_ours)
    del whole.first["resolved_config"]["optim"]
    exported = export_torch_dist(whole, tmp_path / "back", tp=1, pp=1)
    assert exported.optimizer == "none"
    assert len(exported.notes) == 1 and "weights only" in exported.notes[0] and "--finetune" in exported.notes[0]
    common = torch.load(tmp_path / "back" / ITER / "common.pt", weights_only=False)
    assert common["args"].no_save_optim is True and "optimizer" not in common
    assert not any(k.startswith("optimizer.") for k in dcp_tensors(tmp_path / "back" / ITER))


def test_distributed_optimizer_needs_torch_dist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["ckpt", "convert", str(FIXTURES / "gpt_tp2"), "--to", "torch", "--distributed-optimizer", "--out",
                 str(tmp_path / "out")])
    assert code == 1
    assert "--distributed-optimizer chooses the optimizer layout of --to torch_dist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
