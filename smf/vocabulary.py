"""The words of the experiments, each spelled once: recipes, memory modes, sparse updates, conditions, tasks, the
default model and the tiny preset's sizes; the selection rules and kernel backends are smf_kernels' own, read from
:mod:`smf_kernels.names` (which imports no torch, so neither does this module nor the command line's parser).

Command line, config files, code and reports all use these spellings. Spellings an earlier version
accepted from users are still read, with a deprecation warning (:func:`canonical`).
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

from smf.errors import ConfigError
from smf_kernels.names import BACKENDS, RULES  # the scoring rules and kernel backends, torch-free

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # the paper's base model
TINY_MODEL = "tiny"  # :mod:`smf.tiny`, built in code


@dataclass(frozen=True)
class RecipeKind:
    """A training recipe (docs/method.md#two-stage-training) and what it does with memories, as data: the run's
    options (:mod:`smf.train.sections`, :mod:`smf.train.rules`) and its model (:mod:`smf.train.recipes`) read it."""

    name: str
    command: str  # the command that runs it: smf retrofit, or smf train --recipe {name}
    memories: str  # where its memories come from: "fresh" (attached), "adapter" (--adapter, required) or "adapter if
    # given" (none without --adapter)
    trains_memories: bool  # its memories (and any alpha) train
    shards_memories: bool  # --shard-memories can split them over the processes
    sparse_step: bool = False  # its memories' value rows train through the sparse step (--update, the sparse options)


RECIPE_KINDS = {kind.name: kind for kind in (
    RecipeKind("retrofit", "retrofit", "fresh", trains_memories=True, shards_memories=True),
    RecipeKind("sparse", "train", "adapter", trains_memories=True, shards_memories=True, sparse_step=True),
    RecipeKind("lora", "train", "adapter if given", trains_memories=False, shards_memories=False),
    RecipeKind("full", "train", "adapter if given", trains_memories=True, shards_memories=False))}
RECIPES = tuple(RECIPE_KINDS)
TRAIN_RECIPES = tuple(name for name, kind in RECIPE_KINDS.items() if kind.command == "train")  # smf train --recipe

MEMORY_MODES = ("replacement", "additive", "additive+s")  # +S: alpha trains in the sparse stage too
RETROFIT_MODE = {"replacement": "replacement", "additive": "additive", "additive+s": "additive"}


@dataclass(frozen=True)
class UpdateKind:
    """A sparse update (``smf train --update``) and what it supports, as data: :mod:`smf.train.rules` refuses
    what it does not support, :mod:`smf.train.recipes` builds it."""

    name: str
    optimizer: str  # the --optimizer value it replaced (docs/method.md#migrating-from---optimizer): old configs and
    # suite fingerprints (smf.suite.fingerprints) read it
    kernel: str  # its kind in smf_kernels.sparse.updates, which the step composes (the class's name: no torch here)
    row_optimizer: bool  # steps the selected rows with --row-optimizer (its kernel kind's ``rows``; the others: torch
    # AdamW on whole tables)
    one_process: str | None = None  # why it runs in one process only (no torchrun, no --shard-memories); None: any
    counts_every_position: str | None = None  # why --count-reads loss cannot steer it; None: it can


# smf train --update (it replaced --optimizer): the exact row update and the two ablations.
UPDATE_KINDS = {kind.name: kind for kind in (
    UpdateKind("exact", "row_sparse", "ExactRows", row_optimizer=True),
    UpdateKind("dense_masked", "dense_masked", "DenseMasked", row_optimizer=False),
    UpdateKind("authors", "authors", "AuthorsMasked", row_optimizer=False,
               one_process="the authors' single-GPU update",
               counts_every_position="the authors' update counts every position, padding included"))}
SPARSE_UPDATES = tuple(UPDATE_KINDS)
ROW_OPTIMIZERS = ("adamw", "sgd")  # smf train --row-optimizer: RowSparseAdamW or RowSparseSGD (--update exact)
# Removed command-line options -> what replaced them (docs/method.md#migrating-from---optimizer), for parse errors.
REMOVED_OPTIONS = {
    "--optimizer": "--optimizer is now --update (row_sparse -> exact; dense_masked and authors keep their names)",
    "--sparse-backward": "--sparse-backward is gone: the exact update fills the rows' gradient itself (drop it)",
    "--fused-update": "--fused-update is gone: every exact step is the fused one (drop it)",
}
TASKS = ("medmcqa", "wikitext", "triviaqa")
# A user's own evaluation sets (docs/own-data.md): learning (the MedMCQA stand-in), held-out perplexity (WikiText's)
# and retained knowledge (TriviaQA's), each scored by its stand-in's rule; and their metric keys.
# retain_heldout: retained knowledge asked in a form no training text holds (a world's held-out question templates)
EVAL_ROLES = ("learn", "heldout", "retain", "retain_heldout")
OWN_METRIC_OF_ROLE = {"learn": "learn_acc", "heldout": "heldout_ppl", "retain": "retain_acc",
                      "retain_heldout": "retain_heldout_acc"}
# The metric key a results record holds for each evaluated task (smf.eval.tasks writes them, smf report checks them).
METRIC_OF_TASK = {"medmcqa": "medmcqa_acc", "wikitext": "wikitext_ppl", "triviaqa": "triviaqa_acc",
                  **OWN_METRIC_OF_ROLE}
LOSS_ON = ("all", "answer")  # the tokens a qa/mc training row's loss scores (docs/own-data.md)
COUNT_READS = ("all", "loss")  # the tokens whose memory reads steer the sparse selection (docs/own-data.md)

# Table 1 of the paper: the base model, sparse finetuning as f"{mode}-{rule}", and the two baselines.
SPARSE_CONDITIONS = tuple(f"{mode}-{rule}" for mode in MEMORY_MODES for rule in sorted(RULES))  # kl, tfidf
CONDITIONS = ("base", *SPARSE_CONDITIONS, "lora", "full")

PAPER_LAYERS = (6, 12, 18)
TINY_MEMORY_LAYERS = (2, 4, 6)
TINY_MEMORY_KWARGS = {"n_keys": 16, "heads": 2, "topk": 4, "key_dim": 32}

# Old spelling -> the one spelling (memory mode, sparse optimizer).
DEPRECATED_SPELLINGS = {"additive_s": "additive+s", "row-sparse": "row_sparse", "dense-masked": "dense_masked"}

__all__ = ["CONDITIONS", "DEFAULT_MODEL", "EVAL_ROLES", "MEMORY_MODES", "RECIPES", "RECIPE_KINDS", "ROW_OPTIMIZERS",
           "RULES", "SPARSE_CONDITIONS", "SPARSE_UPDATES", "TASKS", "TINY_MODEL", "UPDATE_KINDS", "RecipeKind",
           "UpdateKind", "canonical", "check_layers", "condition_recipe", "split_condition"]


def canonical(value, argument: str):
    """``value`` in its one spelling; an old spelling of ``argument`` is mapped with a DeprecationWarning
    (and a logged warning, which the command line shows)."""
    if not isinstance(value, str) or value not in DEPRECATED_SPELLINGS:
        return value
    new = DEPRECATED_SPELLINGS[value]
    message = f"{argument} {value!r} is deprecated; use {new!r}"
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    logger.warning(message)
    return new


def split_condition(condition: str) -> tuple[str, str]:
    """(memory mode, rule) of a sparse condition, e.g. ``additive+s-kl`` -> (``additive+s``, ``kl``)."""
    if condition not in SPARSE_CONDITIONS:
        raise ConfigError(f"condition must be one of {', '.join(SPARSE_CONDITIONS)}; got {condition!r}")
    mode, rule = condition.rsplit("-", 1)
    return mode, rule


def condition_recipe(condition: str) -> str | None:
    """What a condition trains: None (base: no training), 'lora', 'full' or 'sparse'."""
    if condition == "base":
        return None
    return condition if condition in ("lora", "full") else "sparse"


def check_layers(layers, num_layers: int | None = None, argument: str = "layers") -> tuple[int, ...]:
    """The memory layer indices as a tuple, checked: distinct ints >= 0, and < ``num_layers`` (the model's
    decoder layers) when given. Raises ConfigError (a ValueError) naming ``argument`` otherwise."""
    layers = tuple(layers) if isinstance(layers, (list, tuple)) else (layers,)
    if not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ConfigError(f"{argument} must be a non-empty list of int indices, got {list(layers)}")
    if any(index < 0 for index in layers) or len(set(layers)) != len(layers):
        raise ConfigError(f"{argument} must be distinct non-negative indices, got {list(layers)}")
    beyond = [index for index in layers if num_layers is not None and index >= num_layers]
    if beyond:
        raise ConfigError(f"{argument} {list(layers)}: indices {beyond} are beyond the model, which has "
                         f"{num_layers} decoder layers (valid: [0, {num_layers - 1}])")
    return layers
