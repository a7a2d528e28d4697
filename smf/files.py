"""Atomic file writes: the content goes to a synced temporary file that is renamed over the target,
so a crash while writing leaves either the old file or the new one, never a mix. A write the system
refuses (a full disk, a quota, a read-only directory) removes the temporary file and raises ConfigError
naming the target, in one line (torch.save reports a full disk as an ``inline_container.cc`` RuntimeError
raised while handling the OSError; the OSError is the one reported)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from smf.errors import ConfigError


def os_error_behind(err: BaseException) -> OSError | None:
    """The OSError ``err`` is, or was raised while handling or from (torch.save's RuntimeError over a full disk)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 (64 hex digits) of the file at ``path``, read a ``chunk`` of bytes at a time (a base's weights need not
    fit in memory twice)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to fill a temporary file beside ``path``, sync it, rename it to ``path``. The temporary
    file is this process's own (``smf suite --jobs`` workers may write one file at once: the last rename wins whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = os_error_behind(err)
        if cause is None or isinstance(err, ConfigError):
            raise
        raise ConfigError(f"cannot write {path}: {cause.strerror or cause}") from err
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` (UTF-8) to ``path``, atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: str | Path, obj, *, allow_nan: bool = True) -> Path:
    """``obj`` as indented JSON to ``path``, atomically. ``allow_nan=False``: ValueError for a non-finite float
    (JSON has none: Python writes ``Infinity`` / ``NaN``, which strict readers refuse)."""
    return write_text_atomic(path, json.dumps(obj, indent=2, allow_nan=allow_nan) + "\n")


def read_json_object(path: str | Path, what: str, required: tuple[str, ...] = ()) -> dict:
    """The JSON object in ``path``, a ``what`` (e.g. "results file"); ConfigError naming the file when it is not
    readable JSON, not an object, or lacks a key of ``required``."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON, bad UTF-8, an int of > 4300 digits
        raise ConfigError(f"{path} is not a readable {what} ({str(err).splitlines()[0]})") from None
    missing = [key for key in required if not isinstance(value, dict) or key not in value]
    if not isinstance(value, dict) or missing:
        raise ConfigError(f"{path} is not a {what}: expected a JSON object"
                          f"{' with ' + ', '.join(map(repr, required)) if required else ''}")
    return value
