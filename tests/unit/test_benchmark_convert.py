"""benchmarks/convert_cpu.py: its shape is GPT-3 1.3B's, its padding Megatron's, its table reads against the copy.

No timing here (that is the benchmark's job); these are the pure parts its figures are read against.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "convert_cpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("convert_cpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_default_shape_is_gpt3_1_3b_at_tp_8_to_2():
    bench = _bench()
    args = bench.parse_args(["--dir", "x"])
    assert (args.layers, args.hidden, args.heads, args.seq, args.from_tp, args.to_tp) == (24, 2048, 16, 2048, 8, 2)
    assert (args.format, args.optimizer) == ("xser", False)  # weights only: the safe default
    shape = bench.Shape(layers=24, hidden=2048, heads=16, vocab=50257, seq=2048)
    padded = bench.padded_vocab(50257, tp=8)
    # 12 h^2 + 13 h per layer (QKV, proj, two MLP matrices, their biases, two LayerNorms), embeddings, final norm
    h = 2048
    assert bench.num_params(shape, padded=padded) == 24 * (12 * h * h + 13 * h) + (padded + 2048) * h + 2 * h
    assert 1.3e9 < bench.num_params(shape, padded=padded) < 1.45e9


@pytest.mark.parametrize(("vocab", "tp"), [(50257, 8), (50257, 2), (50304, 1), (1000, 4)])
def test_the_vocabulary_pads_to_a_multiple_of_128_tp(vocab, tp):
    bench = _bench()
    padded = bench.padded_vocab(vocab, tp=tp)
    assert padded % (128 * tp) == 0 and vocab <= padded < vocab + 128 * tp


def test_heads_that_do_not_split_are_refused(capsys):
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--dir", "x", "--heads", "12", "--from-tp", "8"])
    assert "--heads 12" in capsys.readouterr().err


def test_the_table_divides_by_the_copy_and_the_verdict_reads_both_goals():
    bench = _bench()
    gib = bench.GIB
    copy = bench.Row(name="cp -r", wall_s=4.0, peak_rss=None)
    fast = bench.Row(name="ours", wall_s=6.0, peak_rss=3 * gib)
    text = bench.table([copy, fast], {"output, two ranks": 5 * gib})
    assert "| ours | 6.00 | 1.50 | 3.00 |" in text and "| cp -r | 4.00 | 1.00 | - |" in text
    assert "| output, two ranks | 5.00 |" in text
    assert bench.verdict(fast, copy, two_ranks=5 * gib) == \
        "time goal (<= 2x copy): met; memory goal (< two output ranks' shards): met"
    slow = bench.Row(name="ours", wall_s=9.0, peak_rss=6 * gib)
    assert bench.verdict(slow, copy, two_ranks=5 * gib) == \
        "time goal (<= 2x copy): NOT met; memory goal (< two output ranks' shards): NOT met"
