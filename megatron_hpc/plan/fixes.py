"""The fixes a refusal suggests, held as data so that the planner can try each before the user reads it. Pure.

A refusal that names concrete fixes (`--set KEY=VALUE`, `--nodes N`, `--platform NAME`) raises a FixablePlanError or a
FixableConfigError: its candidate fixes, and a function that words its one line from the fixes that are kept.
`make_plan` (plan/planner.py) plans the recipe once per candidate, with the fix applied as the command line would
apply it, and words the refusal with the candidates that planned. When none did, it says that none fits at this
size and names the node count that plans the recipe. Advice without a value ("a smaller model") is worded as
before and not tried.

Inside plan/ a refusal is an ordinary PlanError or ConfigError: the searches of sizing.py catch them to try the
next mesh, so its message is worded when first read and a costly candidate list is built only when asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import ConfigError, MegatronHpcError, PlanError

Value = bool | int | float | str


@dataclass(frozen=True, slots=True)
class Fix:
    """One way out of a refusal: --set overrides, another --nodes, another --platform, or several at once."""

    sets: tuple[tuple[str, Value], ...] = ()
    """(section.key, value) pairs, as `--set section.key=value` gives them."""
    nodes: int | None = None
    platform: str | None = None
    planned: str = field(default="", compare=False)
    """Filled in by the planner once the fix planned: the mesh it planned ("TP 8 x PP 2")."""

    def text(self) -> str:
        """The flags that apply this fix, as the user types them."""
        flags = [f"--nodes {self.nodes}"] if self.nodes is not None else []
        flags += [f"--platform {self.platform}"] if self.platform else []
        return " ".join(flags + [f"--set {key}={value_text(value)}" for key, value in self.sets])

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with the --set values of this fix (nodes and platform are the planner's arguments)."""
        for key, value in self.sets:
            section, name = key.split(".")
            part = dataclasses.replace(getattr(cfg, section), **{name: value})
            cfg = dataclasses.replace(cfg, **{section: part})
        return cfg


def set_fix(key: str, value: Value) -> Fix:
    return Fix(sets=((key, value),))


def value_text(value: Value) -> str:
    """A value as --set takes it back (the loader reads YAML: `true`, not `True`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def values_of(fixes: Sequence[Fix], key: str) -> list[Value]:
    """The values the single-key fixes among `fixes` give `key`, in order."""
    return [f.sets[0][1] for f in fixes if len(f.sets) == 1 and f.sets[0][0] == key and f.nodes is None
            and f.platform is None]


def one_of(key: str, values: Sequence[Value]) -> str:
    """`--set key=v` for one value, `--set key=N with N in {a, b}` for several."""
    if len(values) == 1:
        return f"--set {key}={value_text(values[0])}"
    return f"--set {key}=N with N in {{{', '.join(value_text(v) for v in values)}}}"


def sizes_choice(key: str, fixes: Sequence[Fix]) -> str | None:
    """`--set key=N with N in {...}` for the sizes among `fixes`, noting 0 (the planner's choice) when it is one;
    None when `fixes` sets no size of `key`."""
    values = values_of(fixes, key)
    sizes = [v for v in values if v != 0]
    if not sizes:
        return f"--set {key}=0 (the planner chooses)" if values else None
    return one_of(key, sizes) + (" (0 lets the planner choose)" if 0 in values else "")


def nearest(values: Sequence[int], to: int) -> list[int]:
    """The nearest of `values` below `to` and the nearest above, ascending (what a batch or node fix offers)."""
    below = [v for v in values if v < to]
    above = [v for v in values if v > to]
    return ([max(below)] if below else []) + ([min(above)] if above else [])


Toward = Literal["more", "fewer"]


Candidates = Sequence[Fix] | Callable[[], Sequence[Fix]]


class FixableError(MegatronHpcError):
    """What FixablePlanError and FixableConfigError share: candidate fixes, and the wording of the message from
    the kept ones.

    The sizing searches raise and catch many refusals that nobody reads (a PP size that does not split the layers,
    a mesh short of memory), so the message is worded when first read, and candidates that cost a search may be
    given as a function that lists them. `toward` says which way the node count helps when no fix plans: "more"
    names the smallest node count that plans the recipe (memory, a mesh that does not divide), "fewer" the largest
    below this one (a global batch too small for the workers), None none (what the node count cannot change).
    `name_nodes` asks for that count even when the refusal offers no fix.
    """

    def __init__(self, wording: Callable[[list[Fix]], str], fixes: Candidates = (), *,
                 toward: Toward | None = "more", name_nodes: bool = False) -> None:
        super().__init__()
        self.wording, self.toward, self.name_nodes = wording, toward, name_nodes
        self._fixes, self._message = fixes, None

    @property
    def fixes(self) -> tuple[Fix, ...]:
        if callable(self._fixes):
            self._fixes = self._fixes()
        return tuple(self._fixes)

    def __str__(self) -> str:
        if self._message is None:  # untried: what a search inside plan/ sees
            self._message = self.wording(list(self.fixes))
        return self._message

    def __reduce__(self) -> tuple[type, tuple[str]]:
        # The wording is a closure: across processes the message travels as the plain error type.
        base = ConfigError if isinstance(self, ConfigError) else PlanError
        return base, (str(self),)

    def kept(self, fixes: Sequence[Fix], *, none_fits: str = "") -> MegatronHpcError:
        """The same refusal worded with only `fixes` (the candidates that planned), and `none_fits` after it."""
        message = self.wording(list(fixes)) + (f"; {none_fits}" if none_fits else "")
        return type(self)(lambda _: message, fixes, toward=self.toward)  # type: ignore[call-arg]


class FixablePlanError(FixableError, PlanError):
    """A PlanError whose fixes make_plan tries before the user reads them."""


class FixableConfigError(FixableError, ConfigError):
    """A ConfigError whose fixes make_plan tries before the user reads them."""


def offer(what: str, options: Sequence[tuple[Fix, str]], *, lead: str = "; use ",
          kind: type[FixablePlanError] | type[FixableConfigError] = FixablePlanError) -> FixableError:
    """The common shape: `what`, then the texts of the options whose fix planned, joined by "or" after `lead`."""

    def wording(kept: list[Fix]) -> str:
        texts = [text for fix, text in options if fix in kept]
        return what + (lead + " or ".join(texts) if texts else "")

    return kind(wording, [fix for fix, _ in options])
