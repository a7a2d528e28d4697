"""Atomic file writes: the content goes to a synced temporary file that is renamed over the target,
so a crash while writing leaves either the old file or the new one, never a mix."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to fill a temporary file beside ``path``, sync it, rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) to ``path``, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, obj) -> Path:
    """``obj`` as indented JSON to ``path``, atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
