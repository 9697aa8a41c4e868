"""Every `megatron-hpc` command line README.md and docs/*.md show is one the real CLI accepts (doc_commands.py says
how they are found and checked), every recipe key the pages name exists, every subcommand is shown at least once,
and `plan` commands shown with their output in a console block print that output (`...` matches anything),
refusals included. Links between the pages, their #anchors and the repository paths they name exist too. The
self-tests at the end prove that a renamed flag, key or recipe fails the check.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from doc_commands import (
    DOCS,
    DocCommand,
    all_doc_commands,
    command_problem,
    extract_commands,
    key_overrides,
    link_problems,
    output_matches,
    recipe_key_spans,
    settings_problem,
)

from megatron_hpc.cli import main as cli_main

# The docs show more than these; fewer means the extractor stopped finding them.
FLOOR_COMMANDS = 60
FLOOR_KEYS = 60

# --- the tests --------------------------------------------------------------------------------------------

COMMANDS = all_doc_commands()


def test_the_docs_show_enough_commands_to_check():
    assert len(COMMANDS) >= FLOOR_COMMANDS, [c.where for c in COMMANDS]
    shown = {c.argv[0] for c in COMMANDS if c.argv}
    assert shown >= set(cli_main.COMMANDS), f"commands the docs never show: {set(cli_main.COMMANDS) - shown}"


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {' '.join(c.argv)[:60]}" for c in COMMANDS])
def test_a_doc_command_parses_with_real_flags_keys_and_recipes(command: DocCommand):
    problem = command_problem(command)
    assert problem is None, f"{command.where}: megatron-hpc {shlex.join(command.argv)}\n  {problem}"


SHOWN_PLANS = [c for c in COMMANDS if c.output and c.argv[:1] == ("plan",)]


def test_the_docs_show_plans_with_their_output():
    assert len(SHOWN_PLANS) >= 3  # the plan table (README, planning) and the two refusals
    refusing = [c for c in COMMANDS if c.shows_refusal]
    assert all(c in SHOWN_PLANS for c in refusing), "a shown refusal must be of `plan`, which this test runs"


@pytest.mark.parametrize("command", SHOWN_PLANS, ids=[c.where for c in SHOWN_PLANS])
def test_a_shown_plan_prints_what_the_doc_shows(command: DocCommand, capsys):
    code = cli_main.main(list(command.argv))
    captured = capsys.readouterr()
    printed = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    shown = [line for line in command.output if line.strip()]
    assert code == (1 if command.shows_refusal else 0), (command.where, captured.err)
    assert len(printed) == len(shown), (command.where, printed)
    for want, got in zip(shown, printed):
        assert output_matches(want, got), f"{command.where}: the doc shows\n  {want}\nplan prints\n  {got}"


# --- the checker can fail ---------------------------------------------------------------------------------

SAMPLE = """Intro `submit --wait`, `data none`, `megatron-hpc status [RUN|JOBID]` and `megatron-hpc generate CKPT
--prompt "..." [--prompt ...] [--top-k K --json]`, not `megatron-hpc-thing x`.

```bash
pip install x && megatron-hpc data demo && megatron-hpc submit --recipe tiny \\
    --cluster local   # a comment with `megatron-hpc nothing`
torchrun --nproc_per_node 2 -m megatron_hpc evaluate CKPT ...
```

```console
$ megatron-hpc plan --recipe tiny --set train.num_steps=N
recipe      tiny on 1 x cpu
$ megatron-hpc runs --json
```
"""


def test_the_extractor_finds_blocks_chains_continuations_prompts_and_usage_lines():
    found = [(c.argv, c.fragment, c.output) for c in extract_commands("sample.md", SAMPLE)]
    assert found == [
        (("data", "demo"), False, ()),
        (("submit", "--recipe", "tiny", "--cluster", "local"), False, ()),
        (("evaluate", "CKPT"), False, ()),
        (("plan", "--recipe", "tiny", "--set", "train.num_steps=N"), False, ("recipe      tiny on 1 x cpu",)),
        (("runs", "--json"), False, ()),
        (("submit", "--wait"), True, ()),
        (("status", "RUN"), True, ()),
        (("status", "JOBID"), True, ()),
        (("generate", "CKPT", "--prompt", "...", "--top-k", "K", "--json"), True, ()),
    ]
    assert all(command_problem(c) is None for c in extract_commands("sample.md", SAMPLE))


@pytest.mark.parametrize(("line", "why"), [
    ("megatron-hpc logs RUN --folow", "unrecognized arguments: --folow"),  # a renamed or misspelt flag
    ("megatron-hpc logs RUN --fol", "unrecognized arguments: --fol"),  # an abbreviation of a real flag
    ("megatron-hpc plan --recipe tiny --nodes many", "invalid int value: 'many'"),
    ("megatron-hpc submit --recipe tiny --cluster slrum", "invalid choice: 'slrum'"),
    ("megatron-hpc ckpt reshard CKPT --tp N --virtual V", "unrecognized arguments: --virtual"),
    ("megatron-hpc data samples --seq-length 8", "required: --data-path"),
    ("megatron-hpc plan --recipe tiny --set train.lr=0.1", "unknown key 'train.lr'"),
    ("megatron-hpc plan --recipe tiny --set train.num_steps=lots", "expected an integer"),
    ("megatron-hpc plan --recipe tinny", "not a shipped recipe"),
    ("megatron-hpc submit --recipe gpt3_6.7b --nodes 16 --dry-run --out d", "submit refuses gpt3_6.7b on trn1"),
    ("megatron-hpc frobnicate --now", "invalid choice: 'frobnicate'"),
])
def test_a_wrong_command_in_a_doc_fails_the_check(line: str, why: str):
    (command,) = extract_commands("bogus.md", f"```bash\n{line}\n```\n")
    problem = command_problem(command)
    assert problem is not None and why in problem, problem


def test_an_inline_usage_line_is_checked_flag_by_flag_but_may_leave_out_required_ones():
    (ok,) = extract_commands("u.md", "see `megatron-hpc data samples --seq-length 8`")
    assert command_problem(ok) is None
    (bad,) = extract_commands("u.md", "see `megatron-hpc data samples --seq-len 8`")
    assert "unrecognized arguments: --seq-len" in (command_problem(bad) or "")


def test_shown_output_is_matched_line_by_line_with_ellipses():
    assert output_matches("flops  43.13 GFLOP per token (megatron-classic: ...); 6N gives 39.97",
                          "flops  43.13 GFLOP per token (megatron-classic: 12*L*h^2 (x)); 6N gives 39.97")
    assert not output_matches("mesh  world 512 = TP 8 x PP 1 x DP 64", "mesh  world 512 = TP 4 x PP 2 x DP 64")


KEY_SPANS = recipe_key_spans()


def test_recipe_keys_in_the_prose_are_found_and_a_wrong_one_fails():
    assert key_overrides("parallel.overlap_param_gather: true") == ["parallel.overlap_param_gather=true"]
    assert key_overrides("optim.min_lr > optim.lr") == ["optim.min_lr=N"]
    assert key_overrides("checkpoint.load=DIR checkpoint.finetune=true") == ["checkpoint.load=DIR",
                                                                             "checkpoint.finetune=true"]
    assert key_overrides("compile.sbatch") == [] and key_overrides("megatron_hpc.generate") == []
    assert settings_problem(("plan", "--set", "model.recompute_method=N")) is None  # a placeholder value
    for wrong, why in [("--set train.lr=0.1", "unknown key 'train.lr'"), ("model.recompute_method: blocks", "block"),
                       ("parallel.overlap_param_gathers", "unknown key")]:
        (override,) = key_overrides(wrong)
        assert why in (settings_problem(("plan", "--set", override)) or ""), wrong


def test_the_docs_name_recipe_keys():
    assert len(KEY_SPANS) >= FLOOR_KEYS, KEY_SPANS


@pytest.mark.parametrize(("where", "override"), KEY_SPANS, ids=[f"{w} {o}"[:80] for w, o in KEY_SPANS])
def test_a_recipe_key_the_docs_name_exists(where: str, override: str):
    problem = settings_problem(("plan", "--recipe", "tiny", "--set", override))
    assert problem is None, f"{where}: {problem}"


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_links_anchors_and_repository_paths_in_a_page_exist(page: Path):
    assert link_problems(page) == []


def test_a_broken_link_anchor_or_path_is_found(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# A heading\n\n[ok](#a-heading) [gone](missing.md) [no heading](#other) `benchmarks/nope.py`\n"
                    "`benchmarks/RESULTS.md` [results](" + str(DOCS[0].parent / "benchmarks/RESULTS.md") + ")\n")
    assert link_problems(page) == ["missing.md", "#other (no such heading)", "benchmarks/nope.py"]
