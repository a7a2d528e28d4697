"""Write docs/api.md, the API reference, from the public names' signatures and docstrings.

    python tools/gen_api_docs.py            # rewrite docs/api.md
    python tools/gen_api_docs.py --check    # exit 1 if docs/api.md differs from what this would write

Public names: a module's ``__all__``; for a module without one, the classes and functions it defines (or a
submodule of it defines) and its upper-case constants, none starting with ``_``. A class lists its own public
methods and properties (not those it inherits). An object exported by several modules is written out once, under
the first of :data:`MODULES`, and named under the others. The output depends only on the code: names sorted, object
addresses removed from default values, sets sorted. tests/test_api_docs.py fails when docs/api.md is stale.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "api.md"
COMMAND = "python tools/gen_api_docs.py"
# The modules documented, in this order; an object appears in full under the first that exports it.
MODULES = (
    "smf_kernels",
    "smf_kernels.ops",
    "smf_kernels.backends",
    "smf_kernels.sparse",
    "smf_kernels.sharded",
    "smf_kernels.hf",
    "smf_kernels.fsdp",
    "smf.model",
    "smf.tiny",
)
CONSTANT_TYPES = (str, int, float, tuple, list, dict, frozenset, set)
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
DOUBLE_BACKTICKS = re.compile(r"``([^`]+)``")


def public_names(module) -> list[str]:
    """The module's public names (see the module docstring), sorted case-insensitively."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = []
        for name, obj in vars(module).items():
            if name.startswith("_"):
                continue
            defined_in = getattr(obj, "__module__", None) or ""
            own = (inspect.isclass(obj) or inspect.isfunction(obj)) and (
                defined_in == module.__name__ or defined_in.startswith(module.__name__ + "."))
            constant = name.isupper() and isinstance(obj, CONSTANT_TYPES)
            if own or constant:
                names.append(name)
    return sorted(names, key=lambda name: (name.lower(), name))


def markdown(docstring: str | None) -> list[str]:
    """A docstring as Markdown lines: its first paragraph as prose (Sphinx roles and ``literals`` as `code`), the
    rest verbatim in a text block (its indented argument lists kept as written, roles shortened)."""
    if not docstring:
        return ["*(no docstring)*", ""]
    docstring = ROLE.sub(lambda m: f"``{m[1].split(' <')[0]}``", docstring)
    summary, _, rest = docstring.partition("\n\n")
    lines = [DOUBLE_BACKTICKS.sub(r"`\1`", " ".join(summary.split())), ""]
    if rest.strip():
        lines += ["```text", rest.strip("\n"), "```", ""]
    return lines


class _Annotation:
    """An annotation written as its source text (``from __future__ import annotations`` makes them strings, which
    a signature would show quoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquoted(annotation):
    return _Annotation(annotation) if isinstance(annotation, str) else annotation


def signature(obj, constructor: bool = False) -> str | None:
    """``(arguments) -> result`` of a callable, annotations unquoted, without object addresses (a constructor's
    without ``-> None``); None where Python cannot say."""
    try:
        found = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    parameters = [p.replace(annotation=_unquoted(p.annotation)) for p in found.parameters.values()]
    result = inspect.Signature.empty if constructor else _unquoted(found.return_annotation)
    return ADDRESS.sub("", str(found.replace(parameters=parameters, return_annotation=result)))


def constant_value(value) -> str:
    """A constant's value as Python writes it (sets sorted; long ones: type and size); any other object: its
    class."""
    if isinstance(value, (set, frozenset)):
        text = f"{type(value).__name__}({sorted(value, key=repr)!r})"
    elif isinstance(value, CONSTANT_TYPES) or value is None:
        text = repr(value)
    else:
        return f"{type(value).__module__}.{type(value).__qualname__}(...)"
    if len(text) > 300:
        return f"{type(value).__name__} of {len(value)} items"
    return text


def class_members(cls) -> list[tuple[str, object]]:
    """The public methods and properties a class defines itself, in name order."""
    members = []
    for name, member in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            members.append((name, member))
    return members


def document_class(qualified: str, cls) -> list[str]:
    bases = ", ".join(base.__qualname__ if base.__module__ == "builtins" else f"{base.__module__}.{base.__qualname__}"
                      for base in cls.__bases__ if base is not object)
    lines = [f"### `{qualified}`", "", "```python", f"class {cls.__name__}({bases}):" if bases else
             f"class {cls.__name__}:"]
    constructor = signature(cls, constructor=True) if "__init__" in vars(cls) or "__new__" in vars(cls) else None
    if constructor is not None:
        lines.append(f"    {cls.__name__}{constructor}")
    lines += ["```", "", *markdown(inspect.getdoc(cls))]
    for name, member in class_members(cls):
        if isinstance(member, property):
            lines += [f"#### `{cls.__name__}.{name}` (property)", "", *markdown(inspect.getdoc(member))]
        else:
            lines += [f"#### `{cls.__name__}.{name}`", "", "```python", f"{name}{signature(member) or '(...)'}",
                      "```", "", *markdown(inspect.getdoc(member))]
    return lines


def document(qualified: str, obj) -> list[str]:
    """The Markdown lines of one public name."""
    if inspect.isclass(obj):
        return document_class(qualified, obj)
    name = qualified.rsplit(".", 1)[1]
    if callable(obj):
        return [f"### `{qualified}`", "", "```python", f"{name}{signature(obj) or '(...)'}", "```", "",
                *markdown(inspect.getdoc(obj))]
    return [f"### `{qualified}`", "", "```python", f"{name} = {constant_value(obj)}", "```", ""]


def render() -> str:
    """The whole of docs/api.md."""
    lines = ["# API reference", "",
             f"Generated from the docstrings by `{COMMAND}` (do not edit by hand; tests/test_api_docs.py fails when",
             "this page is stale). Signatures as Python reports them. The guides: [library.md](library.md) (the",
             "ops, backends, the controller's steps), [hf.md](hf.md) (saving, loading, the Trainer),",
             "[method.md](method.md) (the method).", ""]
    lines += [f"- [`{name}`](#{name.replace('.', '')})" for name in MODULES]
    lines.append("")
    written: dict[int, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        summary = (inspect.getdoc(module) or "").split("\n\n")[0]
        lines += [f"## {module_name}", "", *markdown(summary)]
        for name in public_names(module):
            obj = getattr(module, name)
            qualified = f"{module_name}.{name}"
            if (inspect.isclass(obj) or callable(obj)) and id(obj) in written:
                lines += [f"### `{qualified}`", "", f"The same object as `{written[id(obj)]}`, above.", ""]
                continue
            if inspect.isclass(obj) or callable(obj):
                written[id(obj)] = qualified
            lines += document(qualified, obj)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="Write docs/api.md from the public names' docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale; write nothing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(REPO)} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(REPO))  # this checkout's packages, not another installed copy
    sys.exit(main())
