"""xser files: round trip, the on-disk format of neuron-xla.md 1.1, and safe reading."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_hpc.checkpoint.store import read_xser
from megatron_hpc.checkpoint.store.xser import TensorReference, write_torch, write_xser
from megatron_hpc.errors import CheckpointError


def _data_pkl(main: Path) -> bytes:
    with zipfile.ZipFile(main) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        return zf.read(name)


def test_round_trip_dtypes_and_nesting(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    obj = {"w": torch.randn(3, 4, generator=gen), "b16": torch.randn(5, generator=gen).bfloat16(),
           "ids": torch.arange(6), "mask": torch.tensor([True, False]), "empty": torch.empty(0, 2),
           "nested": {"list": [1, 2.5, "x", None, torch.ones(2)], "n": 3}, "step": 7}
    write_xser(obj, tmp_path / "m.pt")
    back = read_xser(tmp_path / "m.pt")
    assert back.keys() == obj.keys() and back["step"] == 7 and back["nested"]["n"] == 3
    for key in ("w", "b16", "ids", "mask", "empty"):
        assert back[key].dtype == obj[key].dtype and torch.equal(back[key], obj[key]), key
    assert back["nested"]["list"][:4] == [1, 2.5, "x", None]
    assert torch.equal(back["nested"]["list"][4], torch.ones(2))


def test_on_disk_format(tmp_path: Path) -> None:
    t1, t2, t3, t4 = (torch.full((2,), float(i)) for i in range(1, 5))
    # Traversal order: dict items in insertion order, depth first; t1 appears again (aliased).
    obj = {"b": t1, "a": [t2, (t3, t1)], "c": {"d": t4}, "tup": (1, 2)}
    main = tmp_path / "model_optim_rng.pt"
    assert write_xser(obj, main) == 4
    assert b"torch_xla.utils.serialization\nTensorReference" in _data_pkl(main)
    files = sorted(p.name for p in (tmp_path / "model_optim_rng.pt.tensors").iterdir())
    assert files == ["tensor_0.pt", "tensor_1.pt", "tensor_2.pt", "tensor_3.pt"]
    for tid, want in enumerate((t1, t2, t3, t4)):  # each file is a plain torch.save of one tensor
        got = torch.load(tmp_path / "model_optim_rng.pt.tensors" / f"tensor_{tid}.pt", weights_only=True)
        assert type(got) is torch.Tensor and torch.equal(got, want), tid
    back = read_xser(main)
    assert back["a"] == [back["a"][0], [back["a"][1][0], back["a"][1][1]]]  # tuples come back as lists
    assert type(back["a"][1]) is list and back["tup"] == [1, 2]
    assert back["a"][1][1] is back["b"]  # the alias is one tensor again


def test_views_are_stored_compactly(tmp_path: Path) -> None:
    big = torch.arange(10_000.0)
    write_xser({"v": big[:3]}, tmp_path / "m.pt")
    assert (tmp_path / "m.pt.tensors" / "tensor_0.pt").stat().st_size < 4000
    assert torch.equal(read_xser(tmp_path / "m.pt")["v"], big[:3])


def test_torch_format_round_trip(tmp_path: Path) -> None:
    t = torch.randn(4)
    write_torch({"a": t, "b": (t, 1)}, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt.tensors").exists()
    back = read_xser(tmp_path / "m.pt")
    assert torch.equal(back["a"], t) and back["b"][1] == 1


def test_parameters_and_objects_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"model\.w is a Parameter.*state_dict"):
        write_xser({"model": {"w": torch.nn.Parameter(torch.ones(2))}}, tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"cfg is a PosixPath"):
        write_xser({"cfg": Path("/x")}, tmp_path / "b.pt")


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickles_never_run(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    # The payload works: an unrestricted load runs it (so this test can fail).
    torch.save({"x": _Evil(ran)}, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert ran.exists()

    marker = tmp_path / "pwned"
    torch.save({"x": _Evil(marker)}, tmp_path / "main.pt")
    with pytest.raises(CheckpointError, match=r"main\.pt asks for posix\.system, which a checkpoint may not contain"):
        read_xser(tmp_path / "main.pt")
    # A good main file whose tensor file is the attack.
    write_xser({"w": torch.ones(1)}, tmp_path / "good.pt")
    tensor = tmp_path / "good.pt.tensors" / "tensor_0.pt"
    tensor.unlink()
    torch.save(_Evil(marker), tensor)
    with pytest.raises(CheckpointError, match=r"tensor_0\.pt asks for posix\.system"):
        read_xser(tmp_path / "good.pt")
    # A bare pickle (not a zip) with the same payload.
    (tmp_path / "raw.pt").write_bytes(pickle.dumps(_Evil(marker), protocol=2))
    with pytest.raises(CheckpointError):
        read_xser(tmp_path / "raw.pt")
    assert not marker.exists()


_FAKE_TORCH_XLA = '''
class TensorReference(object):
  def __init__(self, tid):
    self.tid = tid
'''

_TORCH_XLA_SIDE = textwrap.dedent('''
    import os, sys, torch
    from torch_xla.utils.serialization import TensorReference
    ours, theirs = sys.argv[1], sys.argv[2]
    # 1) read our file the way torch_xla's xser.load does
    ref = torch.load(ours, weights_only=False)
    assert type(ref["w"]) is TensorReference and ref["w"].tid == 0, ref
    assert ref["pair"][0].tid == 0 and ref["pair"][1] == 2, ref
    t = torch.load(os.path.join(ours + ".tensors", "tensor_%d.pt" % ref["w"].tid))
    assert torch.equal(t, torch.arange(3.0)), t
    # 2) write a file the way torch_xla's xser.save does: CPU tensors stay inline
    os.mkdir(theirs + ".tensors")
    torch.save(torch.full((2, 2), 5.0), os.path.join(theirs + ".tensors", "tensor_0.pt"))
    torch.save({"model": {"w": TensorReference(0)}, "torch_rng_state": torch.get_rng_state(), "iteration": 3},
               theirs)
    print("ok")
''')


def test_interoperates_with_torch_xla_class(tmp_path: Path) -> None:
    """A stand-in torch_xla package (the class exactly as in torch_xla) on another interpreter's path."""
    pkg = tmp_path / "site" / "torch_xla" / "utils"
    pkg.mkdir(parents=True)
    for init in (pkg.parent / "__init__.py", pkg / "__init__.py"):
        init.write_text("")
    (pkg / "serialization.py").write_text(_FAKE_TORCH_XLA)
    w = torch.arange(3.0)
    write_xser({"w": w, "pair": (w, 2)}, tmp_path / "ours.pt")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, "-c", _TORCH_XLA_SIDE, str(tmp_path / "ours.pt"),
                           str(tmp_path / "theirs.pt")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    back = read_xser(tmp_path / "theirs.pt")
    assert back["iteration"] == 3 and torch.equal(back["model"]["w"], torch.full((2, 2), 5.0))
    assert back["torch_rng_state"].dtype == torch.uint8  # inline CPU tensor


def test_bad_tid_is_an_error(tmp_path: Path) -> None:
    ref = TensorReference(0)
    ref.tid = "0; rm -rf /"
    from megatron_hpc.checkpoint.store.xser import PICKLE_MODULE

    torch.save({"w": ref}, tmp_path / "m.pt", pickle_module=PICKLE_MODULE, pickle_protocol=2)
    with pytest.raises(CheckpointError, match="tid"):
        read_xser(tmp_path / "m.pt")


def test_bytes_that_are_no_pickle_are_called_damaged_not_a_refused_object(tmp_path: Path) -> None:
    """A zeroed stretch of a file (a copy gone wrong) is told apart from a pickle asking for a global we refuse."""
    main = tmp_path / "main.pt"
    torch.save({"x": torch.ones(2)}, main, _use_new_zipfile_serialization=False)  # a plain pickle stream
    main.write_bytes(b"\0" * main.stat().st_size)
    with pytest.raises(CheckpointError, match=r"main\.pt is not a readable pickle \(Unsupported operand 0; nothing in "
                       r"it ran\); it is damaged or truncated, copy it again"):
        read_xser(main)
