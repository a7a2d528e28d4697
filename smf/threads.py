"""How many torch threads a command's process uses: ``--threads``, or one for the tiny model.

The tiny model's matrices (hidden 64) gain nothing from a second thread, and on a machine other jobs load, two
threads per process spin-wait for each other's core: ten forwards of the tiny model with memories took 36.6 s
at two threads against 2.3 s at one (README, "Tests and threads"). Larger models keep torch's default."""
from __future__ import annotations

import logging

from smf.vocabulary import TINY_MODEL

logger = logging.getLogger(__name__)


def use_threads(threads: int | None, model: str | None) -> None:
    """``torch.set_num_threads(threads)``; ``threads`` None: one thread when ``model`` (a name, or a loaded
    model's ``config._name_or_path``) is the tiny model, else torch's default left as it is."""
    import torch

    if threads is None and model != TINY_MODEL:
        return
    torch.set_num_threads(threads or 1)
    logger.info("%d torch thread%s%s", threads or 1, "" if (threads or 1) == 1 else "s",
                "" if threads else " (the tiny model; --threads N to change)")
