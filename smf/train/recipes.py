"""The four training recipes of docs/method.md#two-stage-training: which model, which parameters train, which optimizer.

- ``retrofit``: fresh memories at ``layers``; every memory parameter (+ alpha) trains; AdamW.
- ``sparse``: memories from the retrofit adapter; only value rows picked each step by the
  :class:`~smf_kernels.sparse.MemoryStep` of ``--update``'s kind train (+ alpha in mode additive+s); what each
  recipe and update does is read off its entry in :data:`smf.vocabulary.RECIPE_KINDS` /
  :data:`~smf.vocabulary.UPDATE_KINDS`; :class:`RowSparseAdamW`, or
  :class:`RowSparseSGD` with ``--row-optimizer sgd`` (``--update exact``; the ablations ``--update dense_masked``
  and ``--update authors`` step torch AdamW, :mod:`smf_kernels.sparse.updates`).
- ``--alpha-lr``: alpha in its own parameter group at that rate, in any recipe where it trains.
- ``lora``: peft LoRA on the seven projections, of the base model or of the base model with the memories of
  ``adapter`` (frozen); AdamW.
- ``full``: every parameter of the base model, or of the base model with the memories of ``adapter`` (their
  values, keys, projections and alpha too); AdamW.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from smf.errors import ConfigError
from smf.model import apply_lora, attach_memories, configure_trainable, memory_blocks
from smf.model.loading import load_base, load_with_adapter
from smf.model.memory_mode import set_memory_mode
from smf.model.precision import authors_bf16_weights, cast_like_the_authors
from smf.train.config import RunConfig
from smf.train.distributed import Parallelism, World
from smf.train.parallel import parallelize
from smf.train.rules import background_file, check_sparse_mode
from smf.train.steps import DenseStep, MemoryUpdateStep, StepHooks, bf16_autocast
from smf.vocabulary import RECIPE_KINDS, UPDATE_KINDS
from smf_kernels.sparse import BackgroundStats, MemoryStep, RowSparseAdamW, RowSparseSGD, updates

logger = logging.getLogger(__name__)



@dataclass
class TrainingSetup:
    """What the trainer needs from a recipe: the unwrapped model, its tokenizer and optimizer, what the recipe does
    around each step's forwards, backwards and optimizer step (:mod:`smf.train.steps`), and how the parallelisms
    applied to the model take part in a step (``parallel``: its ``module`` is the one the forwards run through)."""

    model: nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    step: StepHooks
    parallel: Parallelism = Parallelism()

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}


def set_sparse_mode(model: nn.Module, mode: str | None) -> None:
    """Finetune the adapter's memories in ``mode`` (None: the adapter's own), as far as
    :func:`smf.train.rules.check_sparse_mode` allows (additive -> additive+s)."""
    saved = memory_blocks(model)[0].mode
    check_sparse_mode(mode, saved)
    if mode is not None and mode != saved:
        set_memory_mode(model, mode)


# The optimizer of each --row-optimizer, for a sparse update that steps rows (--update exact); the ablations and the
# other recipes step torch AdamW.
ROW_OPTIMIZERS = {"adamw": RowSparseAdamW, "sgd": RowSparseSGD}


def optimizer_class(config: RunConfig) -> type[torch.optim.Optimizer]:
    """The optimizer of ``config``'s run: the --row-optimizer's where the recipe's sparse step updates rows (its
    entries in :data:`~smf.vocabulary.RECIPE_KINDS` and :data:`~smf.vocabulary.UPDATE_KINDS`), else torch AdamW."""
    if RECIPE_KINDS[config.recipe].sparse_step and UPDATE_KINDS[config.update].row_optimizer:
        return ROW_OPTIMIZERS[config.row_optimizer]
    return torch.optim.AdamW


def param_groups(model: nn.Module, trainable: list[nn.Parameter], alpha_lr: float | None) -> list[dict]:
    """The optimizer's parameter groups: every trainable parameter at the run's rate, or, with ``alpha_lr``, the
    trainable alphas (the memory branches' scales) in a second group at that rate (the LR schedule scales every
    group alike). Where no alpha trains, ``alpha_lr`` sets nothing (the command line refuses it before loading:
    :func:`smf.train.config.frozen_alpha`) and is logged."""
    if alpha_lr is None:
        return [{"params": trainable}]
    alphas = {id(block.alpha) for block in memory_blocks(model)
              if block.alpha is not None and block.alpha.requires_grad}
    if not alphas:
        logger.warning("alpha_lr %g sets nothing: this run trains no alpha", alpha_lr)
        return [{"params": trainable}]
    return [{"params": [p for p in trainable if id(p) not in alphas]},
            {"params": [p for p in trainable if id(p) in alphas], "lr": alpha_lr}]


def build_setup(config: RunConfig, world: World) -> TrainingSetup:
    """Model, tokenizer, frozen/trainable parameters, parallelisms, step and optimizer of ``config.recipe``, in that
    order: the recipe's model and its trainable parameters, the parallelisms applied to it
    (:func:`~smf.train.parallel.parallelize`: memories, FSDP or DDP, compile; collective), then its step and its
    optimizer, built on the parameters as the parallelisms left them.

    Uses torch's global RNG (seeded by the caller identically on every rank) to initialise
    fresh memories and LoRA weights.
    """
    recipe = config.recipe
    model, tokenizer = recipe_model(config, world)
    if recipe == "lora":
        counts = {"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                  "total": sum(p.numel() for p in model.parameters())}
    else:
        counts = configure_trainable(model, recipe)
    if authors_bf16_weights(config.protocol, config.bf16, world.device):
        trainable = [p for p in model.parameters() if p.requires_grad]
        cast_like_the_authors(model, keep_fp32=() if recipe == "full" else trainable)
        logger.info("protocol %s: bf16 weights, %s", config.protocol,
                    "no fp32 master copy" if recipe == "full" else "the trainable parameters fp32")
    parallel = parallelize(model, config, world)
    step = sparse_step(config, model, world) if RECIPE_KINDS[recipe].sparse_step else DenseStep()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_class(config)(param_groups(model, trainable, config.alpha_lr), lr=config.lr,
                                        weight_decay=config.weight_decay)
    logger.info("recipe %s: %d of %d parameters trainable (%s)", recipe, counts["trainable"], counts["total"],
                type(optimizer).__name__)
    return TrainingSetup(model, tokenizer, optimizer, step, parallel)


def recipe_model(config: RunConfig, world: World) -> tuple[nn.Module, object]:
    """``config.recipe``'s model (on ``world.device``; before any parallelism and before its trainable parameters
    are chosen) and its tokenizer, by where its memories come from (:data:`~smf.vocabulary.RECIPE_KINDS`): the
    base with fresh memories (retrofit); else the base, or the base with the memories of --adapter (required by
    sparse), in the run's mode for the sparse step, with LoRA (lora) or as it is (full)."""
    kind = RECIPE_KINDS[config.recipe]
    if kind.memories == "fresh":
        model, tokenizer = load_base(config.model, world.device)
        if memory_blocks(model):
            raise ConfigError(
                f"--model: {config.model} already holds memories at layers "
                f"{[b.layer_index for b in memory_blocks(model)]}; a retrofit adds fresh memories to a plain base "
                f"(to train these: smf train --model {config.model} --adapter {config.model})")
        attach_memories(model, config.layers, config.mode, alpha_init=config.alpha_init,
                        n_keys=config.n_keys, heads=config.heads, topk=config.topk, key_dim=config.key_dim,
                        backend=config.backend)
        return model.to(world.device), tokenizer
    # from the base model, or (--adapter) the base with its memories (frozen under LoRA, trained by the others)
    model, tokenizer = (load_base(config.model, world.device) if config.adapter is None else
                        load_with_adapter(config.model, config.adapter, world.device, config.backend))
    if kind.sparse_step:
        set_sparse_mode(model, config.mode)
    if config.recipe == "lora":
        model = apply_lora(model, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout)
    return model, tokenizer


def sparse_step(config: RunConfig, model: nn.Module, world: World) -> MemoryUpdateStep:
    """--recipe sparse's step: ``config.update``'s :class:`~smf_kernels.sparse.MemoryStep` over ``model``'s
    memories with the background statistics of ``config.background``, driven by :class:`MemoryUpdateStep` (the
    rules on ``world`` and that the file exists were checked before the model loaded: :func:`smf.train.rules.check_run`;
    whether it fits the memories is checked here)."""
    kind = getattr(updates, UPDATE_KINDS[config.update].kernel)()  # the update kind its entry names
    update = MemoryStep(model, update=kind, rule=config.rule, rows_per_step=config.rows_per_step)
    step = MemoryUpdateStep(update, bf16_autocast(config.bf16, world.device), compiled=config.compile,
                            world=world.size, step_tokens=config.global_batch_size // world.size * config.max_length)
    try:
        update.set_background(BackgroundStats.load(background_file(config.background), update.memories))
    except ValueError as err:
        raise ConfigError(f"--background: {err}") from err
    return step
