"""Training examples of each recipe and their split into optimizer steps, ranks and micro-batches.

The order of epoch ``e`` is a permutation of the examples fixed by ``(seed, e)``; optimizer step
``s`` (0-based, counted over all epochs) takes the ``s % steps_per_epoch``-th slice of
``global_batch_size`` examples of epoch ``s // steps_per_epoch`` (a last partial batch is dropped).
So the data position of a run is a function of the step alone, which makes resume exact; rank
``r`` of ``world`` takes the ``r``-th equal part of the slice and cuts it into micro-batches.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass

import torch

from smf.data import (
    IGNORE_INDEX,
    CausalLMCollator,
    assistant_pairs,
    authors_retrofit_and_background,
    get_protocol,
    load_oasst1,
    load_training_rows,
    response_texts,
    retrofit_and_background,
    tokenize_examples,
)
from smf.data import medmcqa, oasst
from smf.data.own_data import load_own, one_batch_or_more, own_features
from smf.data.paths import OWN_SCHEMAS
from smf.errors import ConfigError
from smf.train.config import RunConfig
from smf.train.rules import check_batch_split

logger = logging.getLogger(__name__)


def _oasst_split(config: RunConfig, tokenizer, n_background: int) -> tuple[list[dict], list[dict]]:
    """(retrofit, background) oasst1 examples of ``config.protocol`` (see :mod:`smf.data.protocol`)."""
    protocol = get_protocol(config.protocol)
    messages = load_oasst1(path=config.oasst_path)
    if protocol.oasst_response_only:
        return authors_retrofit_and_background(response_texts(messages), config.n_examples, n_background,
                                               protocol.background_pool, config.data_seed)
    languages = None if config.oasst_languages == "all" else tuple(config.oasst_languages.split(","))
    pairs = assistant_pairs(messages, languages=languages)
    retrofit, background = retrofit_and_background(pairs, n_retrofit=config.n_examples, n_background=n_background,
                                                   seed=config.data_seed)
    return ([oasst.format_example(pair, tokenizer) for pair in retrofit],
            [oasst.format_example(pair, tokenizer) for pair in background])


def own_rows(config: RunConfig) -> tuple[list[dict], str]:
    """(rows, schema) of the own-data file the stage reads: --retrofit-data or --train-data (the first
    ``n_examples`` rows, at least one global batch), --background-data (the first ``n_background``); ConfigError in
    one line naming the file, line and what was expected. Reads no model: :func:`check_own_rows` runs it first."""
    if config.recipe == "background":
        rows, schema = load_own(config.background_data, "--background-data", OWN_SCHEMAS["background"])
        return rows[:config.n_background], schema
    key = "retrofit" if config.recipe == "retrofit" else "train"
    path = getattr(config, f"{key}_data")
    rows, schema = load_own(path, f"--{key}-data", OWN_SCHEMAS[key])
    return one_batch_or_more(rows, config.n_examples, config.global_batch_size, f"--{key}-data {path!r}",
                             "--global-batch-size"), schema


def check_own_rows(config: RunConfig) -> None:
    """:func:`own_rows` of a stage on own data, read before any model loads (so bad data fails in seconds)."""
    if config.own_data():
        own_rows(config)


def training_features(config: RunConfig, tokenizer) -> list[dict]:
    """Tokenised {"input_ids", "labels"} of the recipe's training set: the own-data file (--retrofit-data,
    --train-data; the first ``n_examples`` rows, all by default), else oasst1 for retrofit and MedMCQA otherwise."""
    if config.own_data():
        key = "retrofit" if config.recipe == "retrofit" else "train"
        rows, schema = own_rows(config)
        if schema == "text" and config.loss_on == "answer":
            logger.warning("--loss-on answer: %s holds text rows, which have no prompt; every token is trained",
                           getattr(config, f"{key}_data"))
        features = own_features(tokenizer, rows, schema, config.loss_on, config.max_length)
        logger.info("%s: %d training examples from %s (%s rows, loss on %s)", config.recipe, len(features),
                    getattr(config, f"{key}_data"), schema, "every token" if config.loss_on == "all" else
                    "the answer tokens")
        return features
    if config.recipe == "retrofit":
        examples, _ = _oasst_split(config, tokenizer, n_background=0)  # no background set drawn, none checked
    else:
        rows = load_training_rows(config.medmcqa_path, config.n_examples, config.data_seed, config.protocol)
        examples = [medmcqa.format_example(row, config.protocol) for row in rows]
    features = tokenize_examples(tokenizer, examples, max_length=config.max_length)
    logger.info("%s: %d training examples (protocol %s)", config.recipe, len(features), config.protocol)
    return features


def background_features(config: RunConfig, tokenizer) -> list[dict]:
    """Tokenised background examples: ``clean``: the oasst1 pairs after the first ``n_examples`` retrofit
    pairs; ``authors``: the first ``n_background`` of the authors' draw from the same pool. Own data
    (``background_data``): its first ``n_background`` texts."""
    if config.background_data is not None:
        rows, schema = own_rows(dataclasses.replace(config, recipe="background"))
        return own_features(tokenizer, rows, schema, max_length=config.max_length)
    _, examples = _oasst_split(config, tokenizer, config.n_background)
    return tokenize_examples(tokenizer, examples, max_length=config.max_length)


def target_tokens(feature: dict) -> int:
    """Tokens that enter the causal-LM loss: labels after the one-token shift that are not ignored."""
    return sum(label != IGNORE_INDEX for label in feature["labels"][1:])


@dataclass
class StepPlan:
    """How the examples map to optimizer steps (see module docstring)."""

    num_examples: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int
    seed: int

    def __post_init__(self) -> None:
        check_batch_split(self.global_batch_size, self.micro_batch_size, self.world_size)
        if self.num_examples < self.global_batch_size:
            raise ConfigError(f"only {self.num_examples} training examples, fewer than one global batch "
                              f"({self.global_batch_size}); lower --global-batch-size or add data")
        self.steps_per_epoch = self.num_examples // self.global_batch_size
        self._orders: dict[int, list[int]] = {}

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch_size // (self.world_size * self.micro_batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(self.num_examples))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time
        return self._orders[epoch]

    def global_indices(self, step: int) -> list[int]:
        """Example indices of optimizer step ``step`` (0-based), over all ranks."""
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.global_batch_size
        return self.epoch_order(epoch)[start:start + self.global_batch_size]

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of step ``step``: ``accumulation_steps`` lists of example indices."""
        per_rank = self.global_batch_size // self.world_size
        mine = self.global_indices(step)[self.rank * per_rank:(self.rank + 1) * per_rank]
        return [mine[i:i + self.micro_batch_size] for i in range(0, per_rank, self.micro_batch_size)]


def collate(features: list[dict], indices: list[int], collator: CausalLMCollator,
            device: torch.device) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, labels (micro_batch, longest) on ``device``."""
    batch = collator([features[i] for i in indices])
    return {key: value.to(device) for key, value in batch.items()}
