"""How many torch threads a command's process uses: ``--threads``, or one for a small model.

A small model's matrices (the tiny model's hidden size is 64) gain nothing from a second thread, and on a machine
other jobs load, two threads per process spin-wait for each other's core: ten forwards of the tiny model with
memories took 36.6 s at two threads against 2.3 s at one (README, "Tests and threads"). Larger models keep
torch's default."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from smf.vocabulary import TINY_MODEL

logger = logging.getLogger(__name__)

SMALL_HIDDEN_SIZE = 256  # a model this wide or narrower runs one thread unless --threads says otherwise


def small_model(model: str | None) -> bool:
    """Whether ``model`` (a name or path) is the tiny model or a local directory whose ``config.json`` gives a
    hidden size of at most :data:`SMALL_HIDDEN_SIZE`; a hub id is never read (no network for this)."""
    if model == TINY_MODEL:
        return True
    config = Path(str(model)).expanduser() / "config.json"
    try:
        text = json.loads(config.read_text()) if config.is_file() else {}
    except (OSError, ValueError):
        return False
    text = text.get("text_config", text) if isinstance(text, dict) else {}
    width = text.get("hidden_size", text.get("n_embd")) if isinstance(text, dict) else None
    return isinstance(width, int) and width <= SMALL_HIDDEN_SIZE


def use_threads(threads: int | None, model: str | None) -> None:
    """``torch.set_num_threads(threads)``; ``threads`` None: one thread when ``model`` (a name or path, or a
    loaded model's ``config._name_or_path``) is small (:func:`small_model`), else torch's default left as it is."""
    import torch  # the command line's parser imports this module and no torch

    if threads is None and not small_model(model):
        return
    torch.set_num_threads(threads or 1)
    logger.info("%d torch thread%s%s", threads or 1, "" if (threads or 1) == 1 else "s",
                "" if threads else " (a small model; --threads N to change)")
