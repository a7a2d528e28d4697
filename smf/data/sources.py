"""Reading a dataset split from the hub or from a local file, and deterministic subsets."""
from __future__ import annotations

import logging
import os
import random
from pathlib import Path

from smf.errors import ConfigError
from smf.options import dataset_path_error

logger = logging.getLogger(__name__)


def load_split(hub_id: str, config: str | None, split: str, path: str | Path | None = None):
    """One split as a ``datasets.Dataset``.

    Args:
        hub_id, config, split: the public dataset (used when ``path`` is None).
        path: local override in the same schema: a ``.jsonl``/``.json`` or ``.parquet`` file
            (the whole file is the split), or a directory written by ``save_to_disk`` (a
            ``Dataset``, or a ``DatasetDict`` holding ``split``). One that cannot be read (another
            format, corrupt rows, no such split) raises ConfigError naming it.
    """
    import datasets  # heavy (torch, pyarrow): imported when a split is loaded
    from datasets.exceptions import DatasetsError

    if path is None:
        try:
            return datasets.load_dataset(hub_id, config, split=split)
        except (ConnectionError, OSError, ValueError) as err:
            offline = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "0"))
            raise OSError(f"could not load dataset {hub_id!r} (config {config!r}, split {split!r}) from the hub or "
                          f"its cache (offline={offline}); pass path= to a local copy (jsonl, parquet or a "
                          f"save_to_disk directory). Cause: {err}") from err
    path = Path(path)
    error = dataset_path_error(str(path))
    if error is not None:
        raise ConfigError(f"dataset path: {error}")
    bars = not datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()  # a local file's "Generating train split" bar, once per read, says nothing
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ConfigError(f"{str(path)!r} holds splits {list(loaded)}, not {split!r}")
                loaded = loaded[split]
            return loaded
        if path.suffix in (".jsonl", ".json"):
            return datasets.Dataset.from_json(str(path))
        return datasets.Dataset.from_parquet(str(path))
    except (DatasetsError, OSError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"dataset {str(path)!r} cannot be read ({cause})") from err
    finally:
        if bars:
            datasets.utils.enable_progress_bars()


def subset(dataset, n: int | None = None, seed: int | None = None):
    """The first ``n`` rows (``seed`` None), or ``n`` rows drawn at random with ``seed``, in drawn order.

    ``n`` None keeps every row (shuffled when ``seed`` is given). Asking for more rows than
    exist returns them all and logs a warning.
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be a non-negative int or None, got {n!r}")
    size = len(dataset)
    if n is not None and n > size:
        logger.warning("asked for %d rows but only %d exist; using all of them", n, size)
    order = list(range(size))
    if seed is not None:
        random.Random(seed).shuffle(order)
    if n is not None:
        order = order[:n]
    return dataset.select(order) if hasattr(dataset, "select") else [dataset[i] for i in order]


def shuffled(items: list, seed: int) -> list:
    """A new list with ``items`` in an order fixed by ``seed`` (e.g. seed + epoch per epoch)."""
    order = list(items)
    random.Random(seed).shuffle(order)
    return order
