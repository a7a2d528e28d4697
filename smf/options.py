"""Typed options, shared by the trainer's configuration and the suite's.

An option is a dataclass field made with :func:`option`: its default, help text, the commands that
take it, and optionally its choices, a lower bound and whether it names a path. From that alone come
the per-command filter (:func:`takes`), the checks of values read from YAML/JSON files against the
field's type (:func:`coerce`, types from ``typing.get_type_hints``), the checks of a built config
(:func:`check`), and one argparse flag per option with its default in the help (:func:`add_flags`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path

from smf.errors import ConfigError
from smf.vocabulary import canonical

BOUNDS = {"positive": (lambda v: v > 0, "> 0"), "non-negative": (lambda v: v >= 0, ">= 0")}


def option(default, help: str, commands: tuple[str, ...] = (), *, choices: tuple | None = None,
           bound: str | None = None, path: str | None = None):
    """A dataclass field with its metadata; ``bound``: a key of :data:`BOUNDS`; ``path``: "any" or "dir", a
    path (or directory) that must exist when given."""
    return dataclasses.field(default=default, metadata={"help": help, "commands": commands, "choices": choices,
                                                        "bound": bound, "path": path})


def takes(cls, command: str) -> list[str]:
    """The options of dataclass ``cls`` that ``command`` takes, in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if command in f.metadata.get("commands", ())]


def only(cls, command: str, options: dict) -> dict:
    """The entries of ``options`` that ``command`` takes."""
    names = takes(cls, command)
    return {name: value for name, value in options.items() if name in names}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _kind(cls, name: str) -> tuple[type, type | None]:
    """(scalar type, list or tuple or None) of option ``name`` of ``cls``: (int, list) for ``list[int] | None``."""
    hint = typing.get_type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) in (list, tuple):
        return typing.get_args(hint)[0], typing.get_origin(hint)
    return hint, None


def _scalar(kind: type, value, where: str):
    wrong = f"{where} must be {'true or false' if kind is bool else 'a ' + kind.__name__}, got {value!r}"
    if kind is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads 5e-4 (no dot) as a string
        except ValueError:
            raise ConfigError(wrong) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(wrong)
    return value


def coerce(cls, name: str, value, where: str):
    """``value`` (as read from a file) as option ``name`` of ``cls``; ConfigError naming ``where`` otherwise.

    A list option takes a list (or one value; a comma-separated string for a list of strings); its values
    must be distinct, and values drawn from the option's choices are put in the choices' order.
    """
    spec = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = canonical(value, where)
    if value is None:
        if spec.default is not None:
            raise ConfigError(f"{where} cannot be null")
        return None
    kind, container = _kind(cls, name)
    if container is None:
        return _scalar(kind, value, where)
    if isinstance(value, str) and kind is str:
        value = value.split(",")
    values = [_scalar(kind, canonical(v, where), where) for v in (value if isinstance(value, (list, tuple)) else
                                                                  [value])]
    choices, bound = spec.metadata.get("choices"), spec.metadata.get("bound")
    if choices:
        for v in values:
            if v not in choices:
                raise ConfigError(f"{where}: {v!r} is not one of {', '.join(choices)}")
        values = [c for c in choices if c in values]
    if not values or len(set(values)) != len(values) or (bound and not all(BOUNDS[bound][0](v) for v in values)):
        raise ConfigError(f"{where} must be a non-empty list of distinct {bound + ' ' if bound else ''}"
                          f"{kind.__name__}s, got {value!r}")
    return container(values)


def check(config, name_of=flag) -> None:
    """Raise ConfigError for a value of ``config`` outside its option's choices or bound, or a path option
    naming nothing; errors name the option as ``name_of(name)``."""
    for spec in dataclasses.fields(config):
        value, meta = getattr(config, spec.name), spec.metadata
        if value is None or not meta:
            continue
        if meta["choices"] and not isinstance(value, (list, tuple)) and value not in meta["choices"]:
            raise ConfigError(f"{name_of(spec.name)} must be one of {', '.join(meta['choices'])}; got {value!r}")
        if meta["bound"] and not isinstance(value, (list, tuple)) and not BOUNDS[meta["bound"]][0](value):
            raise ConfigError(f"{name_of(spec.name)} must be {BOUNDS[meta['bound']][1]}, got {value!r}")
        if meta["path"] and not (Path(value).is_dir() if meta["path"] == "dir" else Path(value).exists()):
            raise ConfigError(f"{name_of(spec.name)}: no such {'directory' if meta['path'] == 'dir' else 'path'} "
                              f"{value!r}")


def mapping(raw, where: str, valid=None) -> dict:
    """``raw`` (a mapping, or None for empty) with ``-`` in keys read as ``_``; ConfigError for a key not in
    ``valid`` (when given)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    result = {str(key).replace("-", "_"): value for key, value in raw.items()}
    for key in result:
        if valid is not None and key not in valid:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")
    return result


def read_file(path: str | Path) -> dict:
    """The mapping in a YAML (or, by suffix, JSON) file; ConfigError if it is missing, unreadable or no mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    if path.suffix == ".json":
        parse, errors = json.loads, json.JSONDecodeError
    else:
        import yaml

        parse, errors = yaml.safe_load, yaml.YAMLError
    try:
        raw = parse(path.read_text())
    except errors as err:
        raise ConfigError(f"--config {str(path)!r} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(path)!r} must hold a mapping of option names to values")
    return raw


def _text_to(cls, name: str):
    """argparse ``type`` of option ``name``: the text as the option's scalar type (old spellings mapped)."""
    kind, _ = _kind(cls, name)

    def parse(text: str):
        return canonical(kind(text), flag(name))

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid int value" errors
    return parse


def add_flags(parser: argparse.ArgumentParser, cls, command: str) -> None:
    """One flag per option of ``cls`` that ``command`` takes, its default in the help; unset flags stay out of
    the namespace (so a config file can set them)."""
    for name in takes(cls, command):
        spec = {f.name: f for f in dataclasses.fields(cls)}[name]
        meta, default = spec.metadata, spec.default
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        help_text = f"{meta['help']} (default: {'none' if shown is None else shown})"
        kind, container = _kind(cls, name)
        if kind is bool:  # a switch: --resume
            parser.add_argument(flag(name), action="store_true", default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag(name), type=_text_to(cls, name), nargs="+" if container else None,
                                choices=meta["choices"], metavar=None if meta["choices"] else name.upper(),
                                default=argparse.SUPPRESS, help=help_text)
