"""Typed options, shared by the trainer's configuration and the suite's.

An option is a dataclass field made with :func:`option`: its default, help text and the commands that take it.
Its type says what it accepts: ``Literal`` choices, pydantic's bounded types (``PositiveInt``, :data:`Seed`, ...),
a path that must exist (:data:`ExistingDir`), a list (:data:`AsList`). From that alone come the per-command filter
(:func:`only`), the checks and coercion of values from files and flags, done by pydantic (:func:`checked`), and
one argparse flag per option with its default in the help (:func:`add_flags`).

Every float option is finite: an options dataclass sets ``__pydantic_config__ = OPTIONS_CONFIG``, which refuses
``inf`` and ``nan`` for every float field (from flags, YAML's ``.inf`` or JSON's ``Infinity``) by name.

This module and the option classes import neither torch nor the model code: the command line's parser (and
``smf --help``) is built from them alone."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import typing
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from smf.errors import ConfigError
from smf.vocabulary import canonical

OPTIONS_CONFIG = ConfigDict(allow_inf_nan=False)  # see the module docstring
Seed = Annotated[int, Field(ge=0, lt=2 ** 32)]  # a seed numpy takes too (np.random.seed: [0, 2**32))


def option(default, help: str, commands: tuple[str, ...] = (), shown: str | None = None):
    """A dataclass field with its help text and the commands that take it; ``shown`` is what ``--help`` gives
    as its default where the value alone would not say it (a None that means "automatic")."""
    return dataclasses.field(default=default, metadata={"help": help, "commands": commands, "shown": shown})


def _check(test, message: str) -> AfterValidator:
    """A validator: the value if ``test(value)``, else ValueError(``message.format(value)``)."""
    def check(value):
        if not test(value):
            raise ValueError(message.format(value))
        return value
    return AfterValidator(check)


ExistingPath = Annotated[str, _check(lambda path: Path(path).exists(), "no such path {!r}")]
ExistingDir = Annotated[str, _check(lambda path: Path(path).is_dir(), "no such directory {!r}")]
DATASET_SUFFIXES = (".jsonl", ".json", ".parquet")  # the local dataset files smf.data.load_split reads
DATASET_DIR_MARKERS = ("dataset_info.json", "dataset_dict.json")  # what save_to_disk writes (Dataset, DatasetDict)


def dataset_path_error(path: str) -> str | None:
    """Why ``path`` is not a local dataset that :func:`smf.data.load_split` reads (a .jsonl / .json / .parquet
    file, or a ``save_to_disk`` directory), or None if it is one."""
    path = Path(path)
    if path.is_dir():
        if not any((path / marker).is_file() for marker in DATASET_DIR_MARKERS):
            return (f"{str(path)!r} is a directory but not a dataset saved by save_to_disk (no "
                    f"{' or '.join(DATASET_DIR_MARKERS)})")
        return None
    if not path.exists():
        return f"no such path {str(path)!r}"
    if not path.is_file() or path.suffix not in DATASET_SUFFIXES:
        return (f"{str(path)!r} is not a dataset file: expected a {', '.join(DATASET_SUFFIXES)} file or a "
                "save_to_disk directory")
    return None


def _dataset(path: str) -> str:
    error = dataset_path_error(path)
    if error is not None:
        raise ValueError(error)
    return path


DatasetPath = Annotated[str, AfterValidator(_dataset)]
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


def section_names(section: str):
    """The ``name_of`` of :func:`checked` for the options under the config key ``section``: ``world: option 'n_new'``,
    and ``world`` alone for a check of the options together (a ``__post_init__``'s, whose message names them)."""
    return lambda name: f"{section}: option {name!r}" if name else section


def checked(cls, options: dict, name_of=flag):
    """``cls(**options)`` with every value checked and coerced to its field's type by pydantic (YAML's ``5e-4``, a
    string, as a float; old spellings mapped, with a warning); a ConfigError naming the first bad option as
    ``name_of(name)`` otherwise (``name`` dotted for a field of a nested dataclass: ``eval.tasks``)."""
    try:
        return _adapter(cls).validate_python({name: canonical(value, name_of(name)) for name, value in options.items()})
    except ValidationError as err:
        raise ConfigError(_one_line(err, name_of)) from None


def checked_option(name: str, kind, value):
    """``value`` checked and coerced as ``kind`` (a type pydantic validates: ``PositiveInt | None``), as
    :func:`checked` checks a field; a one-line ConfigError naming ``name`` otherwise (for a value read outside an
    options class, e.g. a suite config's ``threads`` read by ``python -m smf.train.pretrain``)."""
    try:
        return _adapter(kind).validate_python(value)
    except ValidationError as err:
        raise ConfigError(_one_line(err, lambda _: name)) from None


def _one_line(err: ValidationError, name_of) -> str:
    """pydantic's first error in ``err`` as one line naming the value's option, ``name_of(name)``."""
    error = err.errors()[0]
    where = name_of(".".join(part for part in error["loc"] if isinstance(part, str)))  # eval.tasks, not its index
    if error["type"] == "missing":
        return f"{where} is required"
    if error["type"] == "value_error":  # from the validators here, whose messages name the value
        return f"{where}: {error['ctx']['error']}"
    return f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}"


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


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing a mapping that holds a key twice (yaml itself keeps the last one, silently: a
    suite's second variant of one name would replace the first): what every YAML the project reads is read with
    (:func:`read_file`). A merge key's (``<<``) entries may still be overridden, as YAML has it."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    seen = first.get(_one_spelling(key))  # not by line: a flow mapping, {a: 1, a: 2}, holds both on one
                except TypeError:  # an unhashable key: yaml's own error follows
                    continue
                if seen is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} at line {key_node.start_mark.line + 1} (first "
                        f"{_first_spelling(seen[0], key)}at line {seen[1]}); a mapping holds each key once",
                        key_node.start_mark)
                first[_one_spelling(key)] = (key, key_node.start_mark.line + 1)
        return super().construct_mapping(node, deep)


def _one_spelling(key):
    """``key`` as :func:`mapping` reads it (``-`` as ``_``), so ``output-dir`` and ``output_dir`` are one key."""
    return key.replace("-", "_") if isinstance(key, str) else key


def _first_spelling(first, key) -> str:
    """The first spelling of a key given twice, when it differs from ``key`` (``'output_dir' ``), else nothing."""
    return f"{first!r} " if first != key else ""


def _unique_json_object(pairs: list) -> dict:
    """json's ``object_pairs_hook``: the object, or ValueError naming a key it holds twice, in either spelling of
    :func:`_one_spelling` (json keeps the last)."""
    first: dict = {}
    for key, _ in pairs:
        if _one_spelling(key) in first:
            raise ValueError(f"duplicate key {key!r} (first {_first_spelling(first[_one_spelling(key)], key)}"
                             f"given earlier); an object holds each key once")
        first[_one_spelling(key)] = key
    return dict(pairs)


def read_file(path: str | Path, valid=None) -> dict:
    """The :func:`mapping` in a YAML (or, by suffix, JSON) file; ConfigError if it is missing or unreadable, or
    holds a key twice in one mapping (:class:`UniqueKeyLoader`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    try:
        raw = (json.loads(path.read_text(), object_pairs_hook=_unique_json_object) if path.suffix == ".json"
               else yaml.load(path.read_text(), Loader=UniqueKeyLoader))
    except (ValueError, yaml.YAMLError) as err:  # ValueError: json's errors, a key twice
        raise ConfigError(f"--config {str(path)!r} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                          f"{str(err).splitlines()[0]}") from None
    return mapping(raw, f"--config {str(path)!r}", valid)


def positive_int(text: str) -> int:
    """An argparse ``type``: ``text`` as an integer >= 1 (argparse's one-line error naming the flag otherwise)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


class ListAction(argparse.Action):
    """A list flag that takes its items space- or comma-separated, or both: ``--seeds 0 1``, ``--seeds 0,1``.
    Each item is converted by ``item_type`` and, with ``item_choices``, must be one of them (an argparse error
    naming the flag otherwise)."""

    def __init__(self, *args, item_type=str, item_choices=None, **kwargs) -> None:
        super().__init__(*args, nargs="+", **kwargs)
        self.item_type, self.item_choices = item_type, item_choices

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = [item.strip() for value in values for item in value.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentError(self, "expected at least one value")
        converted = []
        for item in items:
            try:
                value = self.item_type(item)
            except (TypeError, ValueError):
                raise argparse.ArgumentError(self, f"invalid {getattr(self.item_type, '__name__', 'list')} value: "
                                                   f"{item!r}") from None
            if self.item_choices is not None and value not in self.item_choices:
                raise argparse.ArgumentError(self, f"invalid choice: {item!r} (choose from "
                                                   f"{', '.join(map(str, self.item_choices))})")
            converted.append(value)
        setattr(namespace, self.dest, converted)


def shown_value(value) -> str:
    """An option's value as ``--help`` shows it: lists space-separated, paths inside the package relative to it."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, str) and os.path.isabs(value):
        package_root = Path(__file__).resolve().parents[1]
        return os.path.relpath(value, package_root) if Path(value).is_relative_to(package_root) else value
    return str(value)


def add_flags(parser: argparse.ArgumentParser, cls, command: str, shown: dict[str, str] | None = None,
              preset: tuple[str, dict] | None = None, groups: list[tuple[str, str, list[str]]] = ()) -> None:
    """One flag per option of ``cls`` that ``command`` takes, with one default in its help: ``shown[name]`` if
    given, else the option's ``shown`` text, else its value; and, when ``preset = (name, options)`` sets the
    option otherwise, the preset's value too (``default: 512; --preset tiny: 32``). A switch for a bool, the
    choices of a ``Literal``, one or more values for a list (:class:`ListAction`); unset flags stay out of the
    namespace (so a config file can set them). With ``groups`` ((title, description, option names), ...), ``--help``
    lists those options under their title, in that order."""
    hints = typing.get_type_hints(cls)
    group_of = {name: group for title, description, names in groups
                for group in [parser.add_argument_group(title, description)] for name in names}
    for spec in only(cls, command, {spec.name: spec for spec in dataclasses.fields(cls)}).values():
        hint, name, default = hints[spec.name], flag(spec.name), spec.default
        target = group_of.get(spec.name, parser)
        text = (shown or {}).get(spec.name) or spec.metadata.get("shown") or shown_value(default)
        if preset is not None and spec.name in preset[1] and preset[1][spec.name] != default:
            text += f"; --preset {preset[0]}: {shown_value(preset[1][spec.name])}"
        kwargs = {"default": argparse.SUPPRESS, "help": f"{spec.metadata['help']} (default: {text})"}
        if hint is bool:
            target.add_argument(name, action="store_true", **kwargs)
            continue
        hint = typing.get_args(hint)[0] if type(None) in typing.get_args(hint) else hint  # X | None: X
        hint = typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint  # its base type
        choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        # A choice is read in its one spelling before argparse checks it (old spellings mapped, with a warning).
        read = functools.partial(canonical, argument=name) if choices else hint
        if typing.get_origin(hint) in (list, tuple):
            item = typing.get_args(hint)[0]
            target.add_argument(name, action=ListAction, item_type=item, metavar=spec.name.upper(), **kwargs)
            continue
        target.add_argument(name, type=read, choices=choices, metavar=None if choices else spec.name.upper(),
                            **kwargs)
