"""A base model and a run's folders recognised after they were copied or moved (issue 57: suite folders move).

- :func:`weights_digest`: the sha256 of a local base model's config and weight files, which a memory adapter records
  beside its base's path (:func:`smf.model.save_memory_adapter`), so that the same base at another path is known as
  its base by content;
- :func:`moved_roots` and :func:`relocated`: the paths a run recorded inside a folder that moved since (its
  ``run_config.json`` records where the run was: ``output_dir``), found at the same place in the folder's new
  location.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from smf.files import file_sha256

WEIGHT_SUFFIXES = (".safetensors", ".bin")  # what a save_pretrained folder holds its weights in (a shard index too)
DIGEST_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def weights_digest(name: str | Path | None) -> str | None:
    """sha256 (64 hex digits) of the base model in the local directory ``name``: the names and bytes of its
    ``config.json``, weight files (``*.safetensors``, ``*.bin``: a base with memories' adapter too) and shard index;
    None when ``name`` is not a local directory holding weights (``'tiny'``, a hub id: their names identify them).
    Reads every weight file (a 0.5B-parameter base: about 1 GB)."""
    if not name or not Path(name).is_dir():
        return None
    files = [path for path in sorted(Path(name).iterdir())
             if path.is_file() and (path.suffix in WEIGHT_SUFFIXES or path.name in DIGEST_FILES)]
    if not any(path.suffix in WEIGHT_SUFFIXES for path in files):
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def moved_roots(written_at: str | Path | None, now_at: str | Path) -> tuple[Path, Path] | None:
    """(old, new): the folder that moved, for a directory recorded (absolute) at ``written_at`` that lies at ``now_at``
    now: both paths without their common tail (``/a/suite/train/x`` now at ``/b/copy/train/x``: ``/a/suite`` and
    ``/b/copy``); None when it has not moved or ``written_at`` is not an absolute path."""
    if not written_at or not Path(written_at).is_absolute():
        return None
    old, new = Path(written_at).parts, Path(now_at).absolute().parts
    if old == new:
        return None
    tail = 0
    while tail < min(len(old), len(new)) - 1 and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    return Path(*old[:len(old) - tail]), Path(*new[:len(new) - tail])


def relocated(path: str | None, roots: tuple[Path, Path] | None) -> str | None:
    """``path`` (as a run recorded it) at its place in the new folder of ``roots`` (:func:`moved_roots`) when it lay
    inside the old one and something is there now; any other path, a hub id, or ``roots`` None: as it is."""
    if path is None or roots is None or not Path(path).is_absolute() or not Path(path).is_relative_to(roots[0]):
        return path
    moved = roots[1] / Path(path).relative_to(roots[0])
    return str(moved) if moved.exists() else path
