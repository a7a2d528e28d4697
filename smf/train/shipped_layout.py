"""The files of a pretrained base as a package asset (``smf/assets/science/base-*``), and the copy that gives back
exactly the files its pretraining wrote (:func:`smf.train.pretrain.ship_base` lays a base out, the suite's copy of a
shipped base unpacks it).

A base pretrained with memories holds its memories twice: in the model (``model.safetensors``) and in the memory
adapter beside it (``memory_adapter.safetensors``, the same tensors under the adapter's names). Shipped, it holds
them once: the adapter's weights are left out and written again from the model by the copy
(:func:`smf.model.adapter.memory_tensors`, as :func:`smf.train.pretrain.save_base` wrote them), and the model's
weights ship xz-compressed (``model.safetensors.xz``: LZMA2 with ``lc=0 lp=2 pb=2``, literals aligned to float32's
four bytes: 15% smaller, where xz's default settings give 8%; any ``xz -d`` reads it). A plain base ships as saved. Every file the
copy writes is checked against the sha256 its pretraining recorded, so a copy is the pretrained base to the bit or
an error naming the file, never a silently different base.
"""
from __future__ import annotations

import lzma
import shutil
from pathlib import Path

from smf.errors import ConfigError
from smf.files import file_sha256

WEIGHTS = "model.safetensors"
XZ = ".xz"
XZ_FILTERS = ({"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 0, "lp": 2, "pb": 2},)


def _memories(names) -> bool:
    from smf.model.adapter import ADAPTER_CONFIG  # torch and transformers: only for a base's files

    return ADAPTER_CONFIG in names


def _derived(names) -> set[str]:
    """The files of ``names`` that a shipped base leaves out (the copy writes them from the others)."""
    from smf.model.adapter import ADAPTER_WEIGHTS

    return {ADAPTER_WEIGHTS} if _memories(names) and WEIGHTS in names else set()


def shipped_name(name: str, names) -> str | None:
    """The file a shipped base holds for its pretraining's file ``name`` (one of ``names``, the record's): ``name``,
    ``name.xz``, or None for a file the copy writes from the others."""
    if name in _derived(names):
        return None
    return name + XZ if name == WEIGHTS and _memories(names) else name


def write_shipped(final: Path, names, destination: Path) -> None:
    """Write the files ``names`` of the base in ``final`` (a pretraining's ``final/``) into the folder
    ``destination`` as a shipped base holds them (module docstring)."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in names:
        shipped = shipped_name(name, names)
        if shipped == name:
            shutil.copyfile(final / name, destination / name)
        elif shipped is not None:
            with open(final / name, "rb") as source, lzma.open(destination / shipped, "wb", format=lzma.FORMAT_XZ,
                                                                filters=XZ_FILTERS) as packed:
                shutil.copyfileobj(source, packed, 1 << 20)


def missing_shipped(source: Path, names) -> list[str]:
    """The files of ``names`` that the shipped base in ``source`` should hold and does not."""
    return [shipped for shipped in (shipped_name(name, names) for name in names)
            if shipped is not None and not (source / shipped).is_file()]


def unpack_shipped(source: Path, files: dict[str, str], final: Path) -> None:
    """Write the files of the shipped base in ``source`` into ``final`` as its pretraining wrote them (``files``:
    name -> sha256, its record's), each checked against its digest; ConfigError naming the file that cannot be
    read or differs (a corrupt or truncated ``.xz`` included)."""
    derived = _derived(files)
    for name in files:
        shipped = shipped_name(name, files)
        if shipped == name:
            shutil.copyfile(source / name, final / name)
        elif shipped is not None:
            _decompress(source / shipped, final / name)
    _check(final, {name: digest for name, digest in files.items() if name not in derived})
    if derived:  # written from the model only once the model is the recorded one
        _write_adapter_weights(final)
        _check(final, {name: files[name] for name in derived})


def _decompress(packed: Path, target: Path) -> None:
    try:
        with lzma.open(packed, "rb") as source, open(target, "wb") as unpacked:
            shutil.copyfileobj(source, unpacked, 1 << 20)
    except (lzma.LZMAError, EOFError) as err:  # EOFError: truncated, the stream's end never reached
        raise ConfigError(f"{packed.name} cannot be decompressed ({err})") from None


def _write_adapter_weights(final: Path) -> None:
    """The memory adapter's weights of the model with memories in ``final``, as :func:`save_base` wrote them."""
    from safetensors.torch import save_file

    from smf.model.adapter import ADAPTER_WEIGHTS, memory_tensors
    from smf.model.loading import from_pretrained

    save_file(memory_tensors(from_pretrained(final)), str(final / ADAPTER_WEIGHTS))


def _check(final: Path, files: dict[str, str]) -> None:
    differ = [name for name, digest in files.items() if file_sha256(final / name) != digest]
    if differ:
        raise ConfigError(f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''} from its record")
