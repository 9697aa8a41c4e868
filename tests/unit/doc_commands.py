"""Finding and checking the `megatron-hpc` command lines, recipe keys and links that README.md and docs/*.md show.

test_docs_commands.py runs these over the pages. Commands come from ```bash / ```console blocks (backslash
continuations joined, `&&` / `;` / `|` chains split, a console block's output lines kept apart) and from inline
code spans that start with `megatron-hpc `, or with a subcommand and a flag (`submit --wait`). Inline usage lines
keep their `[optional]` parts, try each of `a|b`, and drop `[--flag ...]` repeats. `torchrun ... -m megatron_hpc
SUB ...` gives its SUB part. A command is parsed by the parser `main()` builds, with abbreviations off, so a flag
renamed to `--follow-log` does not accept the documented `--follow`. Every `--set KEY=VALUE` goes through the
recipe loader, which refuses unknown keys and bad values; every `--recipe` must be a shipped recipe. Placeholders
are plain strings (RUN, CKPT, /fsx/...); an all-caps one where the parser wants a number (`--tp N`) stands for 1,
and as a `--set` value (`--set train.num_steps=N`) for the recipe's own value, so only the key is checked.

Inline spans that name a recipe key (`parallel.tensor`, `data.path: PREFIX`, `optim.lr <= 0`) go through the loader
too, and relative links, their #anchors and repository paths in code spans must exist.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import re
import shlex
import typing
from pathlib import Path

from megatron_hpc.cli import main as cli_main
from megatron_hpc.config.loader import config_to_dict, known_recipes, load_recipe
from megatron_hpc.config.platforms import get_platform
from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import ConfigError
from megatron_hpc.plan.planner import resolve_data_source

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
OPERATORS = {"&&", "||", ";", "|", "&"}
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")
FENCE = re.compile(r"^\s*```(\S*)\s*$")
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
ERROR_PREFIX = "megatron-hpc: error:"
ELLIPSIS = re.compile(r"(?<![\w\"'.])\.\.\.(?![\w\"'.])")  # "more arguments"; a quoted "..." is a value


@dataclasses.dataclass(frozen=True)
class DocCommand:
    """One command line as a doc shows it, split into the arguments after `megatron-hpc`."""

    where: str  # file:line
    argv: tuple[str, ...]
    fragment: bool  # an inline usage line: flags are checked, required ones may be left out
    output: tuple[str, ...] = ()  # what a console block shows after it

    @property
    def shows_refusal(self) -> bool:
        return any(line.startswith(ERROR_PREFIX) for line in self.output)


# --- extraction -------------------------------------------------------------------------------------------

def _shell_words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True  # words split on spaces only; `;`, `|`, `&&` still come out alone
    return list(lexer)


def _cli_part(words: list[str]) -> list[str] | None:
    """The arguments after `megatron-hpc` (or after `-m megatron_hpc`) in one simple command, else None."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]  # `VAR=value megatron-hpc ...`
    if words and words[0] == "megatron-hpc":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "megatron_hpc":
            return words[i + 2:]
    return None


def _split_chain(words: list[str]) -> list[list[str]]:
    return [list(group) for is_op, group in itertools.groupby(words, lambda w: w in OPERATORS) if not is_op]


def _logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join backslash continuations; each result keeps the number of its first line."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.lstrip()
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        pending = None
        out.append((number, line))
    if pending is not None:
        out.append(pending)
    return out


def _block_commands(name: str, lang: str, lines: list[tuple[int, str]]) -> list[DocCommand]:
    found: list[DocCommand] = []
    console = lang == "console" or any(line.startswith("$ ") for _, line in lines)
    logical = _logical_lines(lines)
    for i, (number, line) in enumerate(logical):
        if console and not line.startswith("$ "):
            continue  # output
        text = line[2:] if console else line
        output: list[str] = []
        if console:
            for _, later in logical[i + 1:]:
                if later.startswith("$ "):
                    break
                output.append(later)
        for words in _split_chain(_shell_words(ELLIPSIS.sub(" ", text))):
            argv = _cli_part(words)
            if argv:  # a bare `megatron-hpc` or `-m megatron_hpc` names the tool, not a command
                found.append(DocCommand(f"{name}:{number}", tuple(argv), False, tuple(output)))
    return found


def _usage_variants(span: str) -> list[list[str]]:
    """An inline usage line as argument lists: `[x]` kept, `[--flag ...]` dropped, `a|b` each tried."""
    span = re.sub(r"\[[^\[\]]*\.\.\.\]", " ", span)  # "[--prompt ...]": the flag may repeat
    words = [w.strip("[]") for w in shlex.split(ELLIPSIS.sub(" ", span))]
    words = [w for w in words if w]
    choices = [w.split("|") if "|" in w else [w] for w in words]
    return [list(combo) for combo in itertools.product(*choices)][:32]


def _inline_commands(name: str, text: str) -> list[DocCommand]:
    found: list[DocCommand] = []
    for match in INLINE.finditer(text):
        span = " ".join(match.group(1).split())  # a span may wrap onto the next line
        words = span.split()
        if words[0] in cli_main.COMMANDS and any(w.startswith("--") for w in words):
            span = f"megatron-hpc {span}"  # `submit --resume RUN`: the tool's name left out
        if not (span.startswith("megatron-hpc ") or span.startswith("torchrun ")):
            continue
        number = text.count("\n", 0, match.start()) + 1
        for words in _usage_variants(span):
            argv = _cli_part(words)
            if argv:  # a bare `megatron-hpc` or `-m megatron_hpc` names the tool, not a command
                found.append(DocCommand(f"{name}:{number}", tuple(argv), True))
    return found


def split_markdown(text: str) -> tuple[str, list[tuple[str, list[tuple[int, str]]]]]:
    """The prose (fenced blocks blanked, line numbers kept) and each fenced block as (language, numbered lines)."""
    prose: list[str] = []
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    lang: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence and lang is None:
            lang = fence.group(1).lower()
            blocks.append((lang, []))
        elif fence and fence.group(1) == "":
            lang = None
        elif lang is not None:
            blocks[-1][1].append((number, line))
        prose.append(line if lang is None and not fence else "")  # a block's backticks are not inline spans
    return "\n".join(prose), blocks


def extract_commands(name: str, text: str) -> list[DocCommand]:
    """Every megatron-hpc command a Markdown text shows, in shell blocks and inline code spans."""
    prose, blocks = split_markdown(text)
    found: list[DocCommand] = []
    for lang, lines in blocks:
        if lang in SHELL_LANGS:
            found += _block_commands(name, lang, lines)
    return found + _inline_commands(name, prose)


def all_doc_commands() -> list[DocCommand]:
    commands: list[DocCommand] = []
    for path in DOCS:
        commands += extract_commands(str(path.relative_to(REPO)), path.read_text(encoding="utf-8"))
    return commands


# --- checking ---------------------------------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:  # argparse keeps subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _subparsers(child)
    return found


def build_parser(argv: list[str], *, fragment: bool) -> argparse.ArgumentParser:
    """The parser main() builds for argv, strict about flag names; for a fragment, nothing is required."""
    parser = cli_main.build_parser(argv)
    for each in _subparsers(parser):
        each.allow_abbrev = False
        if fragment:
            for action in each._actions:
                action.required = False
            for group in each._mutually_exclusive_groups:
                group.required = False
    return parser


def _parse_error(argv: list[str], *, fragment: bool) -> str | None:
    """None if argv parses, else argparse's error line."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            build_parser(argv, fragment=fragment).parse_args(argv)
    except SystemExit as exc:
        if not exc.code:
            return None  # --help, --version
        return (stderr.getvalue().strip().splitlines() or ["(no message)"])[-1]
    return None


def parse_problem(argv: list[str], *, fragment: bool) -> str | None:
    """Parse argv; an all-caps placeholder that the parser wants as a number stands for 1."""
    argv = list(argv)
    for _ in range(len(argv) + 1):
        error = _parse_error(argv, fragment=fragment)
        bad = re.search(r"invalid \S+ value: '([A-Z][A-Z0-9_]*)'", error or "")
        if bad is None:
            return error
        argv[argv.index(bad.group(1))] = "1"
    return error


def _option_values(argv: tuple[str, ...], flag: str) -> list[str]:
    values = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]
    return values + [word.split("=", 1)[1] for word in argv if word.startswith(flag + "=")]


_MISSING = object()


def _current_value(resolved: dict, key: str) -> object:
    node: object = resolved
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def settings_problem(argv: tuple[str, ...]) -> str | None:
    """Unknown recipe, or a --set the recipe loader refuses (unknown key, bad value); None if all load."""
    recipes = _option_values(argv, "--recipe")
    for recipe in recipes:
        if recipe not in known_recipes():
            return f"--recipe {recipe}: not a shipped recipe ({', '.join(known_recipes())})"
    overrides = _option_values(argv, "--set")
    if not overrides:
        return None
    try:
        load_recipe(recipes[0] if recipes else "tiny", _checked_overrides(recipes, overrides))
    except ConfigError as exc:
        return f"--set: {exc}"
    return None


def _checked_overrides(recipes: list[str], overrides: list[str]) -> list[str]:
    """The --set items with a placeholder value replaced by the recipe's own value (only the key is checked)."""
    resolved = config_to_dict(load_recipe(recipes[0] if recipes else "tiny"))
    checked = []
    for item in overrides:
        key, _, value = item.partition("=")
        current = _current_value(resolved, key)
        if PLACEHOLDER.fullmatch(value) and current is not _MISSING and not isinstance(current, dict):
            item = f"{key}={json.dumps(current)}"  # a placeholder value: check the key with a value of the right type
        checked.append(item)
    return checked


def data_problem(argv: tuple[str, ...]) -> str | None:
    """A new-run `submit` whose recipe has no data off the cpu platform: submit (even --dry-run) refuses it with
    check_data_source, so a page showing it shows a command that fails as written."""
    recipes = _option_values(argv, "--recipe")
    if argv[:1] != ("submit",) or not recipes or "--resume" in argv:
        return None
    cfg = load_recipe(recipes[0], _checked_overrides(recipes, _option_values(argv, "--set")))
    platform = get_platform((_option_values(argv, "--platform") or [cfg.launch.platform])[-1])
    if resolve_data_source(cfg.data, platform) == "missing":
        return (f"submit refuses {recipes[0]} on {platform.name} without data; show it with --set data.path=PREFIX "
                "(or --set data.source=synthetic)")
    return None


def command_problem(command: DocCommand) -> str | None:
    problem = parse_problem(list(command.argv), fragment=command.fragment)
    if problem is None and not command.shows_refusal:
        problem = settings_problem(command.argv)  # a refusal the doc shows is checked by running it
    if problem is None and not command.shows_refusal and not command.fragment:
        problem = data_problem(command.argv)
    return problem


def output_matches(shown: str, printed: str) -> bool:
    pattern = ".*".join(re.escape(part) for part in shown.split("..."))
    return re.fullmatch(pattern, printed) is not None


# --- recipe keys in the prose ------------------------------------------------------------------------------

SECTIONS = "|".join(name for name, hint in typing.get_type_hints(RunConfig).items() if dataclasses.is_dataclass(hint))
FILE_NAME = re.compile(r"\.(?:json|jsonl|yaml|sbatch|sh|safetensors|bin|idx|pt|txt|md|py)$")  # compile.sbatch
KEY_SPAN = re.compile(rf"(?:--set )?((?:{SECTIONS})(?:\.[a-z0-9_]+)+)(?: ?([:=]|<=|>=|<|>|\+) ?(.+))?")


def key_overrides(span: str) -> list[str]:
    """`a.b`, `a.b: v`, `a.b=v`, `--set a.b=v`, `a.b <= 0` (key only), or several `a.b=v c.d=w` -> overrides."""
    words = shlex.split(span) if "=" in span else [span]
    if len(words) > 1 and all(KEY_SPAN.fullmatch(w) for w in words):
        return [o for w in words for o in key_overrides(w)]
    match = KEY_SPAN.fullmatch(span)
    if match is None or FILE_NAME.search(match.group(1)):
        return []
    key, op, value = match.groups()
    return [f"{key}={value if op in (':', '=') else 'N'}"]  # N: a placeholder, checked with the default's value


def recipe_key_spans() -> list[tuple[str, str]]:
    """(file:line, override) for each inline span naming a recipe key (`parallel.tensor`, `data.path: PREFIX`,
    `--set train.eval_test=false`); a key without a value, or with a placeholder, gets the default's value."""
    found = []
    for path in DOCS:
        text, _ = split_markdown(path.read_text(encoding="utf-8"))
        for match in INLINE.finditer(text):
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}"
            found += [(where, o) for o in key_overrides(" ".join(match.group(1).split()))]
    return found


# --- links and paths --------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_block = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_block = not in_block
        elif not in_block and (heading := re.match(r"#{1,6} (.*)", line)):
            slug = _slug(heading.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?:tests|benchmarks|slurm|recipes|csrc|docs|launch|compile_cache|megatron_hpc)/[\w./*-]*")


def link_problems(page: Path) -> list[str]:
    """Relative links whose file or #heading is missing, and inline repository paths that match no file."""
    text = page.read_text(encoding="utf-8")
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            missing.append(target)
        elif anchor and anchor not in _anchors(linked):
            missing.append(f"{target} (no such heading)")
    for span in INLINE.findall(split_markdown(text)[0]):
        if REPO_PATH.fullmatch(span) and not list(REPO.glob(span.rstrip("/"))):
            missing.append(span)
    return missing
