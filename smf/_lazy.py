"""Package namespaces that import their modules on first use (PEP 562): ``import smf.train.config`` runs
``smf/train/__init__.py``, and the command line's parser (``smf --help``) must not import torch,
transformers or the model code through it."""
from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__``: ``exports`` maps each public name to the
    submodule (relative to ``package``) that defines it; the submodule is imported when the name is first
    read, and the value is then kept in the package's namespace."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
