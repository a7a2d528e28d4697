"""The one trainer behind every recipe: gradient accumulation, DDP, cosine schedule, clipping,
bf16 autocast, progress bar, train_log.jsonl, periodic checkpoints and exact resume.

Loss: the causal-LM cross entropy summed over the target tokens of a micro-batch, divided by
the number of target tokens in the whole global batch (all micro-batches and ranks), times the
world size because DDP averages gradients over ranks. So the gradient is that of the global
token-mean loss whatever the micro-batch size and number of processes. The sparse stage of the
``authors`` protocol divides each micro-batch's sum by that micro-batch's own target tokens instead,
so its gradient is the sum of the micro-batch means, as the authors' trainer's
(``Protocol.sparse_loss_sums_micro_batch_means``); under DDP the ranks' sums are averaged, as their
Trainer would average them under torchrun, so it depends on how the step is split into micro-batches.
The logged loss is the token mean either way.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from smf.data import IGNORE_INDEX, CausalLMCollator, get_protocol
from smf.errors import ConfigError
from smf.files import write_json_atomic
from smf.model.diagnostics import memory_blocks, memory_diagnostics
from smf.model.loading import FINAL_DIR, RUN_CONFIG
from smf.model.read_mask import reads_counted_at_loss
from smf.train.artifacts import save_final, write_run_config
from smf.train.checkpoint import CHECKPOINT_FILE, LOG_FILE, load_checkpoint, rng_state, save_checkpoint, truncate_log
from smf.train.config import STAGE_COMMANDS, RunConfig
from smf.train.data import StepPlan, check_own_rows, collate, target_tokens, training_features
from smf.train.distributed import Parallelism, World, all_reduce_sum, barrier, gather_objects, setup_distributed
from smf.train.fsdp import consolidated, local_part_of
from smf.train.recipes import TrainingSetup, build_setup
from smf.train.rules import check_run
from smf.train.run_dir import RunFiles, claim_output_dir
from smf.train.sharding import SHARDS_DIR, remove_stale_shards, save_memory_shards
from smf.train.steps import bf16_autocast
from smf.vocabulary import RECIPE_KINDS, TINY_MODEL
from smf_kernels.sharded import unsharded_memories

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cosine_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """Linear warm-up from 0 over ``warmup_steps``, then cosine decay to 0 at ``total_steps``."""
    from transformers import get_cosine_schedule_with_warmup  # transformers.optimization: seconds to import

    return get_cosine_schedule_with_warmup(optimizer, warmup_steps, total_steps)


def summed_token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over target tokens of the next-token cross entropy (fp32), a 0-d tensor."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shifted = logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def check_finite(setup: TrainingSetup, step: int, world: World, *, sharded: bool = False) -> None:
    """ConfigError if a trainable parameter holds inf or NaN after optimizer step ``step`` (the run diverged).
    ``sharded`` (FSDP: :attr:`Parallelism.sharded <smf.train.distributed.Parallelism>`): every rank checks its part
    and the ranks agree (one all_reduce), so all of them raise."""
    named = setup.trainable_parameters()
    bad = torch.stack([~torch.isfinite(local_part_of(p)).all() for p in named.values()]).int()
    if sharded:
        all_reduce_sum(bad, world)
    for name, flag in zip(named, bad.tolist()):
        if flag:
            raise ConfigError(f"training diverged: after step {step} {name} holds non-finite values; lower --lr or "
                              "--max-grad-norm")


def micro_batch_mean_scale(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """1 / (the micro-batch's target tokens, at least 1), a 0-d float32 tensor on the batch's device, computed
    there without a host sync: the reciprocal in float64 rounded once to float32, the very float that
    ``1 / max(int(tokens), 1)`` (a Python float) becomes when it multiplies a float32 loss, so the gradients keep
    their bits."""
    tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    return (1.0 / tokens.clamp(min=1).double()).float()


def run_step(wrapped: nn.Module, setup: TrainingSetup, scheduler, micro_batches: list[dict], num_tokens: int,
             config: RunConfig, world: World, parallel: Parallelism = Parallelism()) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches, the recipe's hooks (:mod:`smf.train.steps`) and the
    parallelisms applied to the model (``parallel``, :func:`smf.train.parallel.parallelize`; ``wrapped``, its
    module) around its
    forwards and backwards; returns this rank's summed token loss (0-d)."""
    autocast = bf16_autocast(config.bf16, world.device)
    per_micro_batch = (RECIPE_KINDS[config.recipe].sparse_step
                       and get_protocol(config.protocol).sparse_loss_sums_micro_batch_means)
    setup.step.begin_step(wrapped if config.compile else setup.model, micro_batches)
    loss_sum = torch.zeros((), device=world.device)
    for index, batch in enumerate(micro_batches):
        with parallel.micro_batch(index == len(micro_batches) - 1):  # the last one reduces the gradients
            with autocast():
                loss = summed_token_loss(wrapped, batch)
            setup.step.after_forward()
            scale = micro_batch_mean_scale(batch) if per_micro_batch else world.size / max(num_tokens, 1)
            (loss * scale).backward()
        loss_sum += loss.detach()
    parallel.reduce_gradients()  # what no wrapper reduced (FSDP2's replicated parameters)
    setup.step.finish_step(setup.optimizer, max_grad_norm=config.max_grad_norm)
    scheduler.step()
    return loss_sum


def _prepare_output_dir(config: RunConfig, world: World, files: RunFiles) -> None:
    output_dir = Path(config.output_dir)
    checkpoint = output_dir / CHECKPOINT_FILE
    if config.resume and not checkpoint.is_file():
        raise ConfigError(f"--resume: no checkpoint {CHECKPOINT_FILE} in --output-dir {config.output_dir!r}")
    if not config.resume and (checkpoint.is_file() or (output_dir / FINAL_DIR).exists()):
        raise ConfigError(f"--output-dir {config.output_dir!r} already holds a run; pass --resume to continue it "
                          "or choose a new directory")
    barrier(world)  # every rank has checked before rank 0 writes anything
    if world.is_main:
        write_run_config(files.path(RUN_CONFIG), config.to_dict())


DIAGNOSTICS_FILE = "memory_diagnostics.json"
DIAGNOSTIC_EXAMPLES = 32  # training examples the retrofit's memory diagnostics are measured on


def write_memory_diagnostics(model: nn.Module, features: list[dict], collator: CausalLMCollator,
                             device: torch.device, path: Path, tiny: bool = False) -> None:
    """:func:`smf.model.memory_diagnostics` of the retrofit memories on the first :data:`DIAGNOSTIC_EXAMPLES`
    training examples, written to ``path`` as JSON. An inert memory is warned about, except on the tiny model
    (``tiny``), a random model retrofitted for seconds, whose memories are expected to be: one info line says so."""
    examples = features[:DIAGNOSTIC_EXAMPLES]
    batches = [collate(examples, list(range(start, min(start + 4, len(examples)))), collator, device)
               for start in range(0, len(examples), 4)]
    logger.info("memory diagnostics: each memory switched off in turn, on %d training examples (%d forwards)",
                len(examples), len(batches) * (len(memory_blocks(model)) + 2))
    diagnostics = memory_diagnostics(model, batches, warn=not tiny)
    if tiny and diagnostics.inert_layers:
        logger.info("the memories at layers %s are inert, as expected of the tiny preset (a random model "
                    "retrofitted for seconds); on a real model this is a warning", diagnostics.inert_layers)
    write_json_atomic(path, diagnostics.to_dict())
    logger.info("memory diagnostics (%s) written to %s", "; ".join(
        f"layer {layer.layer}: alpha {layer.alpha}, KL off {layer.kl_off:.3g}, share {layer.branch_share:.3g}"
        for layer in diagnostics.layers), path)


def train(config: RunConfig) -> dict:
    """Train ``config.recipe`` (a resolved RunConfig); returns {"step", "total_steps", "final_dir" or None}.

    The output directory is locked for the run and cleaned up if it fails (:mod:`smf.train.run_dir`); own data is
    checked before either (:func:`~smf.train.data.check_own_rows`).
    """
    check_own_rows(config)
    world = setup_distributed(config.device)
    check_run(config, STAGE_COMMANDS[config.recipe], world.size)  # with those of the start, before anything loads
    with claim_output_dir(Path(config.output_dir), world) as files:
        return _train(config, world, files)


def _train(config: RunConfig, world: World, files: RunFiles) -> dict:
    _prepare_output_dir(config, world, files)
    output_dir = Path(config.output_dir)
    logger.info("run options: %s", json.dumps(config.to_dict()))
    seed_everything(config.seed)  # the same on every rank: fresh memories / LoRA weights agree
    setup = build_setup(config, world)
    features = training_features(config, setup.tokenizer)
    plan = StepPlan(len(features), config.global_batch_size, config.micro_batch_size, world.size, world.rank,
                    config.seed)
    total_steps = plan.steps_per_epoch * config.epochs
    scheduler = cosine_schedule(setup.optimizer, config.warmup_steps, total_steps)
    parallel = setup.parallel
    collator = CausalLMCollator(setup.tokenizer.pad_token_id)
    count_at_loss = RECIPE_KINDS[config.recipe].sparse_step and config.count_reads == "loss"
    checkpoint_path, log_path = files.path(CHECKPOINT_FILE), files.path(LOG_FILE)

    step = 0
    if config.resume:
        step = load_checkpoint(checkpoint_path, model=setup.model, optimizer=setup.optimizer, scheduler=scheduler,
                               rank=world.rank, world_size=world.size)
        if world.is_main:
            truncate_log(log_path, step)
        logger.info("resumed from %s at step %d of %d", checkpoint_path, step, total_steps)
    else:
        torch.manual_seed(config.seed + world.rank)  # dropout differs across ranks
        if world.is_main:
            truncate_log(log_path, 0)  # rows of an earlier attempt killed before its first checkpoint
    stop = total_steps if config.max_steps is None else min(config.max_steps, total_steps)
    logger.info("%d examples, %d steps per epoch, %d epochs, %d accumulation steps x %d processes",
                len(features), plan.steps_per_epoch, config.epochs, plan.accumulation_steps, world.size)

    setup.model.train()
    progress = tqdm(total=total_steps, initial=step, desc=config.recipe, disable=not world.is_main)
    while step < stop:
        started = time.perf_counter()
        indices = plan.global_indices(step)
        num_tokens = sum(target_tokens(features[i]) for i in indices)
        seen_tokens = sum(len(features[i]["input_ids"]) for i in indices)
        lr = scheduler.get_last_lr()[0]
        micro_batches = [collate(features, chunk, collator, world.device) for chunk in plan.micro_batches(step)]
        try:
            with reads_counted_at_loss(setup.model, micro_batches if count_at_loss else ()):
                loss_sum = run_step(parallel.module, setup, scheduler, micro_batches, num_tokens, config, world,
                                    parallel)
        except RuntimeError as err:  # torch refusing a scalar of the update that float32 cannot hold
            if "without overflow" not in str(err):
                raise
            raise ConfigError(f"training diverged: step {step + 1}'s update overflows float32 (learning rate "
                              f"{lr:g}); lower --lr") from err
        loss = all_reduce_sum(loss_sum, world).item() / num_tokens
        step += 1
        if not math.isfinite(loss):
            raise ConfigError(f"training diverged: the loss of step {step} is {loss} (learning rate {lr:g}); lower "
                              "--lr or --max-grad-norm, or check the data")
        elapsed = time.perf_counter() - started
        if world.is_main:
            with log_path.open("a") as handle:
                handle.write(json.dumps({"step": step, "epoch": (step - 1) // plan.steps_per_epoch, "loss": loss,
                                         "lr": lr, "tokens": seen_tokens, "seconds": round(elapsed, 4),
                                         **setup.step.step_log()}) + "\n")
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{seen_tokens / elapsed:.0f}")
            progress.update(1)
        if step % config.save_every == 0 or step == stop:
            # never a checkpoint (or final artefact) of non-finite weights
            check_finite(setup, step, world, sharded=parallel.sharded)
            rng_states = gather_objects(rng_state(), world)
            files.path(SHARDS_DIR)  # this run's, if it creates it
            shards = save_memory_shards(output_dir, step, setup.model, setup.optimizer, world)  # None: unsharded
            with consolidated(setup.model, setup.optimizer, world):  # whole FSDP tensors on rank 0
                if world.is_main:
                    save_checkpoint(checkpoint_path, step=step, model=setup.model, optimizer=setup.optimizer,
                                    scheduler=scheduler, rng_states=rng_states, run_options=config.to_dict(),
                                    shards=shards)
            if world.is_main and shards is not None:
                remove_stale_shards(output_dir, shards)
            barrier(world)
    progress.close()

    final_dir = None
    if step == total_steps:
        final_dir = files.path(FINAL_DIR)
        # rank 0 holds whole copies of sharded memories and of the FSDP-sharded parameters it saves meanwhile
        with unsharded_memories(setup.model), consolidated(setup.model, None, world,
                                                           trainable_only=config.recipe != "full"):
            if world.is_main:
                patch_base = config.adapter if RECIPE_KINDS[config.recipe].sparse_step and config.save_patch else None
                save_final(setup.model, setup.tokenizer, config.recipe, final_dir, patch_base)
                logger.info("saved the final %s artefact to %s", config.recipe, final_dir)
                if config.recipe == "retrofit":
                    write_memory_diagnostics(setup.model, features, collator, world.device,
                                             files.path(DIAGNOSTICS_FILE), tiny=config.model == TINY_MODEL)
        barrier(world)
    else:
        logger.info("stopped at step %d of %d (--max-steps); --resume continues the run", step, total_steps)
    return {"step": step, "total_steps": total_steps, "final_dir": final_dir}
