"""Hardware as data (config/hardware.py): the built-ins state every figure with its source, a platform file plans
like a built-in, and a file with a missing field or a unit that cannot be right is refused in one line with the
fix (issue 29)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_hpc.cli.main import main
from megatron_hpc.config.hardware import BUILTIN_HARDWARE, as_dict
from megatron_hpc.config.platforms import PLATFORMS

A100 = str(Path(__file__).resolve().parents[2] / "recipes" / "platforms" / "dgx_a100_80gb.yaml")


def test_every_builtin_platform_has_hardware_with_sources():
    for name, platform in PLATFORMS.items():
        hw = platform.hardware
        assert hw is BUILTIN_HARDWARE[name] and hw.runtime == name
        assert hw.workers_per_node == platform.workers_per_node
        assert hw.memory_per_worker_gib == platform.memory_per_worker_gib
        assert hw.peak_tflops_16bit == platform.peak_tflops_bf16  # one figure for MFU and the step-time model
        assert hw.sources


def test_a_platform_file_plans_like_a_builtin(capsys):
    args = ["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", A100, "--set",
            "data.source=synthetic", "--json"]
    assert main(args) == 0
    plan = yaml.safe_load(capsys.readouterr().out)
    assert (plan["platform"], plan["backend"], plan["hardware"]) == ("p5", "nccl", "dgx_a100_80gb")
    assert plan["memory_limit_gib"] == 80 and (plan["tensor_parallel"], plan["pipeline_parallel"]) == (8, 16)
    # MFU (predicted, and logged by the trainer) is against the A100's peak, not p5's 989, although it runs as p5.
    assert plan["peak_tflops_per_worker"] == 312.0
    assert main([*args, "--set", "train.precision=fp32"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["peak_tflops_per_worker"] == 19.5
    assert main(args[:-1]) == 0
    out = capsys.readouterr().out
    assert "on dgx_a100_80gb (runs as p5)" in out
    assert out.startswith("recipe      gpt3_175b on 128 x dgx_a100_80gb (8 workers per node, runs as p5, backend nccl)")


@pytest.mark.parametrize("given", ["dgx_a100_80gb", "dgx_a100_80gb.yaml"])
def test_a_shipped_platform_file_is_found_by_name_outside_the_checkout(tmp_path, capsys, monkeypatch, given):
    """An install from a wheel has no recipes/ folder to give a path to: the shipped file is found by its name,
    from any folder; a name that is neither a file nor a shipped one lists the shipped ones."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", given, "--json"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["hardware"] == "dgx_a100_80gb"
    assert main(["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", "dgx_a100"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("megatron-hpc: error: platform file dgx_a100 does not exist; pass an existing YAML file to "
                   "--platform-file, or a shipped one by name (dgx_a100_80gb)")


def test_a_platform_named_like_a_builtin_is_refused(tmp_path, capsys):
    """tune keeps one calibration per hardware name: a platform file or profile platform named p5 would share
    p5's (and a profile's could never be chosen: --platform p5 is the built-in)."""
    path = write(tmp_path, name="p5")
    assert main(["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert "name 'p5' is a built-in platform's" in err and "(e.g. p5-site)" in err and "\n" not in err
    from megatron_hpc.launch.cluster_profile import profile_from_dict

    from megatron_hpc.errors import ConfigError

    with pytest.raises(ConfigError, match="platforms\\[0\\]: name 'trn1' is a built-in platform's"):
        profile_from_dict({"platforms": [{**yaml.safe_load(Path(A100).read_text()), "name": "trn1"}]})


def write(tmp_path, **changes):
    data = yaml.safe_load(Path(A100).read_text())
    for key, value in changes.items():
        if "." in key:
            section, field = key.split(".")
            data[section][field] = value
        elif value is None:
            del data[key]
        else:
            data[key] = value
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("changes", "expected"), [
    ({"peak_tflops_16bit": None}, "missing peak_tflops_16bit; a platform file states every field"),
    ({"inter_node.bandwidth_gbytes_per_s": 1600},
     "inter_node.bandwidth_gbytes_per_s is 1600, more than any link carries in GB/s: it looks like Gbit/s (bits); "
     "this field takes bytes: write 200"),
    ({"inter_node.bandwidth_gbytes_per_s": "1600 Gbps"},
     "inter_node.bandwidth_gbytes_per_s is '1600 Gbps', bits per second; this field takes GB/s (bytes) as a number: "
     "write 200"),
    ({"intra_node.latency_us": 5000}, "it looks like nanoseconds; give microseconds: 5"),
    ({"memory_per_worker_gib": 81920}, "it looks like MiB; write 80"),
    ({"peak_tflops_16bit": 312000}, "it looks like GFLOP/s or a whole node's"),
    ({"runtime": "a100"}, "runtime 'a100' is not a built-in platform; use one of cpu, p5, trn1, trn2"),
    ({"workers_per_node": 0}, "workers_per_node is 0; it must be positive"),
    ({"peak_tflop_16bit": 1}, "peak_tflop_16bit"),  # an unknown key, named (with the closest)
    # a word is a type error, not a number with a unit ("eight" once raised a ValueError from the unit check)
    ({"workers_per_node": "eight"}, "workers_per_node: expected an integer, found 'eight'"),
    ({"inter_node.bandwidth_gbytes_per_s": "200 GB/s"}, "write a plain number in the unit the name gives (GB/s)"),
    ({"memory_per_worker_gib": "80GB"}, "write a plain number in the unit the name gives (GiB)"),
    # the name is the calibration's file name: no path out of the cache
    ({"name": "../../x"}, "name '../../x' also names the file tune keeps its calibration in"),
])
def test_a_bad_platform_file_is_refused_in_one_line(tmp_path, capsys, changes, expected):
    path = write(tmp_path, **changes)
    assert main(["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err, err


@pytest.mark.parametrize("name", ["Edge", "8gpu", "e"])
def test_a_platform_name_is_text_not_a_number_with_a_unit(tmp_path, capsys, name):
    path = write(tmp_path, name=name)
    assert main(["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", str(path), "--json"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["hardware"] == name


def test_platform_and_platform_file_together_are_refused(capsys):
    assert main(["plan", "--recipe", "tiny", "--platform", "p5", "--platform-file", A100]) == 1
    assert "both name the hardware; use one" in capsys.readouterr().err


def test_builtins_round_trip_through_the_file_checks():
    from megatron_hpc.config.hardware import hardware_from_dict

    for hw in BUILTIN_HARDWARE.values():
        data = as_dict(hw)
        assert hardware_from_dict(data, where="x", runtimes=tuple(PLATFORMS)) == dataclasses.replace(hw)


def test_the_cluster_profiles_platforms_are_named_by_platform(tmp_path, capsys, monkeypatch):
    profile = tmp_path / "cluster.yaml"
    profile.write_text(yaml.safe_dump({"partition": "gpu", "platforms": [yaml.safe_load(Path(A100).read_text())]}))
    monkeypatch.setenv("MEGATRON_HPC_CLUSTER_CONFIG", str(profile))
    assert main(["plan", "--recipe", "gpt3_175b", "--nodes", "128", "--platform", "dgx_a100_80gb", "--json",
                 "--set", "data.source=synthetic"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["hardware"] == "dgx_a100_80gb"
    assert main(["plan", "--recipe", "tiny", "--platform", "dgx"]) == 1
    assert f"unknown platform 'dgx'; use one of cpu, p5, trn1, trn2, or of the cluster profile {profile}: " \
           "dgx_a100_80gb" in capsys.readouterr().err
    bad = yaml.safe_load(Path(A100).read_text())
    del bad["inter_node"]
    profile.write_text(yaml.safe_dump({"platforms": [bad]}))
    assert main(["plan", "--recipe", "tiny", "--platform", "dgx_a100_80gb"]) == 1
    assert "platforms[0]: missing inter_node" in capsys.readouterr().err
    monkeypatch.delenv("MEGATRON_HPC_CLUSTER_CONFIG")  # and no default profile: the line once read "no cluster
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)  # profile describes none"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["plan", "--recipe", "tiny", "--platform", "dgx_a100_80gb"]) == 1
    assert "use one of cpu, p5, trn1, trn2 (no cluster profile found), or describe the nodes with --platform-file" \
        in capsys.readouterr().err


def test_submit_keeps_the_platform_files_hardware_and_a_resume_asks_for_it(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["submit", "--recipe", "gpt3_175b", "--nodes", "128", "--platform-file", A100, "--dry-run",
            "--out", str(run), "--set", "data.source=synthetic"]
    assert main(args) == 0
    plan = yaml.safe_load((run / "plan.json").read_text())
    assert (plan["platform"], plan["hardware"]) == ("p5", "dgx_a100_80gb")
    capsys.readouterr()
    assert main(["submit", "--resume", str(run), "--dry-run"]) == 1
    assert "pass the same --platform-file FILE to resume it" in capsys.readouterr().err
    assert main(["submit", "--resume", str(run), "--dry-run", "--platform-file", A100]) == 0
