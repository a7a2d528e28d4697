"""Typed options, shared by the trainer's configuration and the suite's.

An option is a dataclass field made with :func:`option`: its default, help text and the commands that take it.
Its type says what it accepts: ``Literal`` choices, pydantic's bounded types (``PositiveInt``, ...), a path that
must exist (:data:`ExistingDir`), a list (:data:`AsList`). From that alone come the per-command filter
(:func:`only`), the checks and coercion of values from files and flags, done by pydantic (:func:`checked`), and
one argparse flag per option with its default in the help (:func:`add_flags`)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import typing
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BeforeValidator, Field, TypeAdapter, ValidationError

from smf.errors import ConfigError
from smf.vocabulary import canonical


def option(default, help: str, commands: tuple[str, ...] = ()):
    """A dataclass field with its help text and the commands that take it."""
    return dataclasses.field(default=default, metadata={"help": help, "commands": commands})


def _check(test, message: str) -> AfterValidator:
    """A validator: the value if ``test(value)``, else ValueError(``message.format(value)``)."""
    def check(value):
        if not test(value):
            raise ValueError(message.format(value))
        return value
    return AfterValidator(check)


ExistingPath = Annotated[str, _check(lambda path: Path(path).exists(), "no such path {!r}")]
ExistingDir = Annotated[str, _check(lambda path: Path(path).is_dir(), "no such directory {!r}")]
Distinct = _check(lambda values: len(set(values)) == len(values), "{} repeats a value")
# A list option also takes one value, or a comma-separated string (as ``smf suite --conditions`` gives).
AsList = BeforeValidator(lambda v: [item.strip() for item in v.split(",")] if isinstance(v, str)
                         else v if isinstance(v, (list, tuple)) else [v])


def choice_tuple(choices: tuple[str, ...]):
    """The type of a non-empty tuple of distinct ``choices``, put in the choices' order."""
    return Annotated[tuple[typing.Literal[choices], ...], AsList, Field(min_length=1), Distinct,
                     AfterValidator(lambda values: tuple(c for c in choices if c in values))]


def takes(cls, command: str) -> list[str]:
    """The options of dataclass ``cls`` that ``command`` takes, in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if command in f.metadata.get("commands", ())]


def only(cls, command: str, options: dict) -> dict:
    """The entries of ``options`` that ``command`` takes, in declaration order."""
    return {name: options[name] for name in takes(cls, command) if name in options}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_adapter = functools.cache(TypeAdapter)  # one validator per config class


def checked(cls, options: dict, name_of=flag):
    """``cls(**options)`` with every value checked and coerced to its field's type by pydantic (YAML's ``5e-4``, a
    string, as a float; old spellings mapped, with a warning); a ConfigError naming the first bad option as
    ``name_of(name)`` otherwise (``name`` dotted for a field of a nested dataclass: ``eval.tasks``)."""
    try:
        return _adapter(cls).validate_python({name: canonical(value, name_of(name)) for name, value in options.items()})
    except ValidationError as err:
        error = err.errors()[0]
        where = name_of(".".join(part for part in error["loc"] if isinstance(part, str)))  # eval.tasks, not its index
        if error["type"] == "missing":
            raise ConfigError(f"{where} is required") from None
        if error["type"] == "value_error":  # from the validators here, whose messages name the value
            raise ConfigError(f"{where}: {error['ctx']['error']}") from None
        raise ConfigError(f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}") from None


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


def read_file(path: str | Path, valid=None) -> dict:
    """The :func:`mapping` in a YAML (or, by suffix, JSON) file; ConfigError if it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"--config {str(path)!r} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{str(err).splitlines()[0]}") from None
    return mapping(raw, f"--config {str(path)!r}", valid)


def add_flags(parser: argparse.ArgumentParser, cls, command: str) -> None:
    """One flag per option of ``cls`` that ``command`` takes, its default in the help: a switch for a bool, the
    choices of a ``Literal``, one or more values for a list; unset flags stay out of the namespace (so a config
    file can set them)."""
    hints = typing.get_type_hints(cls)
    for spec in only(cls, command, {spec.name: spec for spec in dataclasses.fields(cls)}).values():
        hint, name, default = hints[spec.name], flag(spec.name), spec.default
        shown = "none" if default is None else " ".join(map(str, default)) if isinstance(default, tuple) else default
        kwargs = {"default": argparse.SUPPRESS, "help": f"{spec.metadata['help']} (default: {shown})"}
        if hint is bool:
            parser.add_argument(name, action="store_true", **kwargs)
            continue
        hint = typing.get_args(hint)[0] if type(None) in typing.get_args(hint) else hint  # X | None: X
        nargs = "+" if typing.get_origin(hint) in (list, tuple) else None
        hint = typing.get_args(hint)[0] if nargs else hint
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        # A choice is read in its one spelling before argparse checks it (old spellings mapped, with a warning).
        parser.add_argument(name, type=functools.partial(canonical, argument=name) if choices else hint, nargs=nargs,
                            choices=choices, metavar=None if choices else spec.name.upper(), **kwargs)
