"""``smf background``: background read statistics of the retrofit memories (docs/method.md#slot-selection).

The model (base + retrofit adapter) runs in eval mode over ``n_background`` single-example
oasst1 batches (``batch_size`` > 1: that many documents per forward, each counted apart,
:func:`smf_kernels.sparse.background_collection.collect_background_batched`) (protocol ``clean``: held out
from the retrofit examples, see
:func:`smf.data.retrofit_and_background`; ``authors``: drawn from the same pool, see
:func:`smf.data.authors_retrofit_and_background`);
the :class:`SparseMemoryController` counts reads and the statistics are written to
``{output_dir}/background.safetensors``. Under torchrun each rank counts its share of the
examples and the counts are summed.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from smf.errors import ConfigError
from smf.files import write_atomic
from smf.model.loading import RUN_CONFIG, load_with_adapter, read_run_config
from smf.model.precision import authors_bf16_weights, cast_like_the_authors
from smf.train.artifacts import write_run_config
from smf.train.config import TINY_PRESET, RunConfig, unused_options
from smf.train.data import background_features, check_own_rows
from smf.train.distributed import World, barrier, setup_distributed
from smf.train.rules import BACKGROUND_FILE
from smf.train.run_dir import RunFiles, claim_output_dir
from smf_kernels.sparse import SparseMemoryController
from smf_kernels.sparse.background_collection import collect_background_batched

logger = logging.getLogger(__name__)


# Options that decide which oasst1 examples the retrofit trained on; the background set is drawn relative to them.
SPLIT_OPTIONS = ("protocol", "oasst_path", "oasst_languages", "n_examples", "data_seed")


def check_held_out_split(config: RunConfig) -> None:
    """Raise ConfigError if the retrofit run behind ``config.adapter`` drew its examples with other
    options than ``config`` (the background examples would then not be the protocol's)."""
    run_config = _retrofit_run_config(config.adapter)
    if run_config is None:
        logger.warning("no %s beside adapter %s: cannot check that the background set is held out", RUN_CONFIG,
                       config.adapter)
        return
    retrofit = read_run_config(run_config.parent)
    ours = config.to_dict()
    unused = unused_options(config, "background")  # under the authors protocol: the languages, the retrofit's size
    differ = [f"{name.replace('_', '-')} {retrofit[name]!r} (retrofit) vs {ours[name]!r}"
              for name in SPLIT_OPTIONS
              if name not in unused and name in retrofit and retrofit[name] != ours.get(name)]
    if differ:
        raise ConfigError("the background examples must be held out from the retrofit's; pass the retrofit's "
                          "options: " + "; ".join(differ))


def _retrofit_run_config(adapter: str) -> Path | None:
    """The run_config.json of the retrofit run behind ``adapter`` (its directory or final/ folder), or None."""
    adapter = Path(adapter)
    return next((d / RUN_CONFIG for d in (adapter, adapter.parent) if (d / RUN_CONFIG).is_file()), None)


def with_own_background(config: RunConfig) -> RunConfig:
    """``config`` with ``background_data`` defaulting to the retrofit's own texts (its ``retrofit_data``) when the
    adapter's retrofit ran on own data and neither --background-data nor --oasst-path is given (the tiny preset's
    oasst1 file gives way, as it does to --retrofit-data)."""
    preset_oasst = config.preset == "tiny" and config.oasst_path == TINY_PRESET.get("oasst_path")
    if config.background_data is not None or (config.oasst_path is not None and not preset_oasst):
        return config
    run_config = _retrofit_run_config(config.adapter)
    retrofit_data = None if run_config is None else read_run_config(run_config.parent).get("retrofit_data")
    if retrofit_data is None:
        return config
    logger.info("background statistics over the retrofit's own texts %s (give --background-data for others)",
                retrofit_data)
    return dataclasses.replace(config, background_data=retrofit_data, oasst_path=None)


def collect_background(config: RunConfig) -> Path:
    """Count reads over the background examples and save them; returns the file's path."""
    config = with_own_background(config)
    if config.background_data is None:  # own background texts are the user's choice: nothing to hold out
        check_held_out_split(config)
    check_own_rows(config)  # before any model loads
    world = setup_distributed(config.device)
    output_dir = Path(config.output_dir)
    with claim_output_dir(output_dir, world) as files:
        return _collect(config, world, files)


def _collect(config: RunConfig, world: World, files: RunFiles) -> Path:
    model, tokenizer = load_with_adapter(config.model, config.adapter, world.device, config.backend)
    controller = SparseMemoryController(model, rows_per_step=1)  # only counts reads here: no step selects rows
    if authors_bf16_weights(config.protocol, "auto", world.device):  # the sparse stage's weights, as it counts
        cast_like_the_authors(model, keep_fp32=controller.value_parameters())
    features = background_features(config, tokenizer)[world.rank::world.size]
    if config.batch_size > 1:  # several documents per forward, each counted apart
        stats = collect_background_batched(model, [f["input_ids"] for f in features], batch_size=config.batch_size,
                                           pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                           else tokenizer.eos_token_id, device=world.device)
    else:
        batches = [{"input_ids": torch.tensor([f["input_ids"]], device=world.device),
                    "attention_mask": torch.ones(1, len(f["input_ids"]), dtype=torch.long, device=world.device)}
                   for f in features]
        stats = controller.collect_background(batches)
    path = files.path(BACKGROUND_FILE)
    if world.is_main:
        write_run_config(files.path(RUN_CONFIG), config.to_dict())
        write_atomic(path, stats.save)
        logger.info("background statistics of %d batches written to %s", next(iter(stats.num_batches.values())),
                    path)
    barrier(world)
    return path
