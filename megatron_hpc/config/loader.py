"""Recipe YAML -> frozen RunConfig.

A recipe is a YAML mapping shaped like `RunConfig`; `extends: other` merges it over another
recipe first. `--set a.b=c` overrides are applied last. Every key is checked against the
dataclass fields and every value against the field's type, so a typo or a bad value fails here,
before anything is planned or queued.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_hpc.config.schema import RunConfig
from megatron_hpc.errors import ConfigError

RECIPE_SUFFIX = ".yaml"
_MAX_EXTENDS_DEPTH = 8


def recipe_dir() -> Path:
    """Folder of the recipes shipped with the package: the recipes package's own folder. (importlib.resources
    finds the same folder for an unzipped install, but importing it costs `plan` more than the whole plan.)"""
    import megatron_hpc.recipes

    return Path(megatron_hpc.recipes.__file__).parent


def known_recipes() -> list[str]:
    """Names of the shipped recipes; a leading underscore marks a base meant only for `extends`."""
    names = (p.name[: -len(RECIPE_SUFFIX)] for p in recipe_dir().glob(f"*{RECIPE_SUFFIX}"))
    return sorted(n for n in names if not n.startswith("_"))


def resolve_recipe(name_or_path: str) -> Path:
    """A shipped recipe by name, or a YAML file by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not candidate.is_file():
            raise ConfigError(f"recipe file {name_or_path} does not exist")
        return candidate
    shipped = recipe_dir() / f"{name_or_path}{RECIPE_SUFFIX}"
    if shipped.is_file():
        return shipped
    names = known_recipes()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(f"unknown recipe {name_or_path!r}; {hint}known recipes: {', '.join(names)}")


def load_recipe(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a recipe, apply `a.b=c` overrides, and validate it into a RunConfig."""
    path = resolve_recipe(name_or_path)
    raw = _read_with_extends(path, depth=0)
    raw.setdefault("name", path.name[: -len(path.suffix)])
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(RunConfig, raw)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-JSON form of a config (what run folders and checkpoints store)."""
    return dataclasses.asdict(cfg)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping, found {type(data).__name__}")
    return data


def _read_with_extends(path: Path, *, depth: int) -> dict[str, Any]:
    if depth > _MAX_EXTENDS_DEPTH:
        raise ConfigError(f"{path}: 'extends' chain deeper than {_MAX_EXTENDS_DEPTH}; is there a cycle?")
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: 'extends' must name one recipe, found {parent!r}")
    sibling = path.parent / f"{parent}{RECIPE_SUFFIX}"
    parent_path = sibling if sibling.is_file() else resolve_recipe(parent)
    base = _read_with_extends(parent_path, depth=depth + 1)
    base.pop("name", None)  # a child is its own recipe
    return _deep_merge(base, data)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.num_steps=100")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
        node = child
    # YAML parsing turns "3" into 3 and "true" into True; the field type coerces the rest.
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        node[parts[-1]] = text


def from_dict(cls: type, data: Any, *, where: str = "", root: type | None = None) -> Any:
    """Build dataclass `cls` from a mapping, checking keys and value types. `root` is the dataclass of the whole
    document (`cls` itself at the top), searched for the section an unknown key belongs to."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'recipe'}: expected a mapping, found {data!r}")
    root = root or cls
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key_message(where, str(key), list(fields), elsewhere=_key_paths(root, str(key))))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], where=path, root=root)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}: required key is missing; set it in the recipe or with --set {path}=...")
    return cls(**kwargs)


def _unknown_key_message(where: str, key: str, valid: list[str], *, elsewhere: list[str]) -> str:
    full = f"{where}.{key}" if where else key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    prefix = f"{where}." if where else ""
    # The key exists, in another section (train.lr for optim.lr): name where it lives before any near miss here.
    sections = [path.rpartition(".")[0] or "the top level" for path in elsewhere]
    lives = (f"; {key!r} lives in {' and '.join(sections)}: use {' or '.join(repr(p) for p in elsewhere)}"
             if elsewhere else "")
    if close:
        ask = "the closest key here is {}" if elsewhere else "did you mean {}?"
        return f"unknown key {full!r}{lives}; {ask.format(repr(prefix + close[0]))} (valid here: {', '.join(valid)})"
    return f"unknown key {full!r}{lives}; valid keys here: {', '.join(valid)}"


def _key_paths(root: type, key: str, *, where: str = "") -> list[str]:
    """Dotted paths of every field named `key` in dataclass `root` and the dataclasses it nests, in field order."""
    found = []
    hints = typing.get_type_hints(root)
    for f in dataclasses.fields(root):
        path = f"{where}.{f.name}" if where else f.name
        if f.name == key:
            found.append(path)
        if dataclasses.is_dataclass(hints[f.name]):
            found += _key_paths(hints[f.name], key, where=path)
    return found


def _coerce(hint: Any, value: Any, *, where: str, root: type | None = None) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where=where, root=root)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, where=where, root=root)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            # Megatron's own spelling (--normalization RMSNorm) differs only in case: name the key's.
            close = ([str(c) for c in choices if str(c).lower() == str(value).lower()]
                     or difflib.get_close_matches(str(value), [str(c) for c in choices], n=1))
            hint_text = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{where}: {value!r} is not allowed; {hint_text}use one of {list(choices)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, found {value!r}")
        (item_type, *_rest) = typing.get_args(hint)
        return tuple(_coerce(item_type, v, where=f"{where}[{i}]", root=root) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, found {value!r}")
        return {str(k): str(v) for k, v in value.items()}
    return _coerce_scalar(hint, value, where=where)


def _coerce_scalar(hint: Any, value: Any, *, where: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, found {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, found {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # YAML 1.1 reads "5e-4" as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, found {value!r}")
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, found {value!r}")
    raise ConfigError(f"{where}: unsupported field type {hint!r}")
