"""The options of ``smf retrofit``, ``smf background`` and ``smf train``, grouped by what they configure: one
dataclass per section (the run, the model, the memories, each recipe's own options, the data, the optimizer,
parallelism, checkpoints). Each option is declared once, in its section, with its default, help text and the
commands that take its flag (:func:`smf.options.option`); :class:`smf.train.config.RunConfig` holds them all, flat.

Which options a run uses follows from its stage's sections (:data:`STAGE_SECTIONS`): an option of a section the
stage does not take (``--lora-r`` for ``--recipe full``) cannot be given to it (``smf train: error: --lora-r is not
used by this run``). Within a section it takes, a section's :meth:`unused` names the options that the run's other
values leave idle (``--alpha-init`` under ``--mode replacement``); the combinations of options a run refuses are the
rules of :mod:`smf.train.rules`, each guarding one section. Adding an option: one field in its section (a rule
there, if it has one).

This module imports neither torch nor the model code (the command line's parser is built from it)."""
from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.options import AsList, DatasetPath, ExistingDir, ExistingPath, Seed, option
from smf.vocabulary import (BACKENDS, COUNT_READS, DEFAULT_MODEL, LOSS_ON, MEMORY_MODES, RECIPE_KINDS, ROW_OPTIMIZERS,
                            RULES, SPARSE_UPDATES, TRAIN_RECIPES, UPDATE_KINDS)

# The commands that take an option's flag.
ALL, FIT = ("retrofit", "background", "train"), ("retrofit", "train")
RETRO, BG, TRAIN = ("retrofit",), ("background",), ("train",)
SCALED = "scaled to the model (docs/own-data.md#memory-sizes); {} at Qwen-2.5-0.5B"


class Section:
    """What every section has: the options its run leaves idle, read off a whole
    :class:`~smf.train.config.RunConfig` ``config`` of ``command``'s run (none by default)."""

    @staticmethod
    def unused(config, command: str) -> dict[str, str]:
        """Options of this section that the run of ``config`` (which takes the section) does not use, with why."""
        return {}


@dataclasses.dataclass
class RunOptions(Section):
    """Where and how the process runs."""

    output_dir: str | None = option(None, "run directory: checkpoints, train_log.jsonl, final artefact (required)", ALL)
    preset: Literal["tiny"] | None = option(None, "'tiny': every recipe on CPU in seconds (tiny Qwen-2, byte "
                                            "tokenizer, tiny memories, small batches, the data in smf/assets)", ALL)
    recipe: Literal[TRAIN_RECIPES] = option("sparse", "what to train (docs/method.md#two-stage-training)", TRAIN)
    bf16: Literal["auto", "on", "off"] = option("auto", "bf16 autocast (auto: on if the CUDA device has bf16)", FIT)
    device: str = option("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...", ALL)
    threads: PositiveInt | None = option(None, "torch threads of this process", ALL,
                                         shown="1 for a small model (tiny, or local of hidden size <= 256)")
    compile: bool = option(False, "torch.compile the model, mode reduce-overhead (CUDA graphs on a GPU); --recipe "
                           "sparse then selects the rows before (or, one micro-batch, in) the backward, a step "
                           "without graph breaks (one process)", FIT)


@dataclasses.dataclass
class ModelOptions(Section):
    """The base model, the memories it starts from and the kernels that run them."""

    model: str = option(DEFAULT_MODEL, "base model: hub id, local save_pretrained directory, or 'tiny'", ALL)
    backend: Literal[BACKENDS] | None = option(None, "memory kernel backend; it must run on --device", ALL,
                                               shown="automatic: triton on CUDA, else ext when built, else torch")
    adapter: ExistingDir | None = option(None, "retrofit memory adapter: the retrofit run directory or its final/ "
                                         "folder (required for background and --recipe sparse; --recipe full: "
                                         "finetune the model with these memories, every parameter; --recipe lora: "
                                         "LoRA on the model with these memories, frozen)", BG + TRAIN)

    @staticmethod
    def unused(config, command: str) -> dict[str, str]:
        if command == "train" and RECIPE_KINDS[config.recipe].memories == "adapter if given" and config.adapter is None:
            return {"backend": f"this run has no memories (--recipe {config.recipe} without --adapter)"}
        return {}


@dataclasses.dataclass
class MemoryOptions(Section):
    """The memories a retrofit attaches, and how they join the layer's MLP (for --recipe sparse too: --mode)."""

    mode: Literal[MEMORY_MODES] | None = option(None, "how memories join the layer's MLP (--recipe sparse: "
                                                "the adapter's mode, or additive+s on an additive adapter; "
                                                "docs/method.md#placement-in-qwen-2)", FIT)
    layers: Annotated[list[int], AsList] | None = option(None, "0-based decoder layers that get a memory", RETRO,
                                                         shown=SCALED.format("6,12,18"))
    n_keys: PositiveInt | None = option(None, "sub-keys per half (slots = n_keys**2)", RETRO, shown=SCALED.format(128))
    heads: PositiveInt | None = option(None, "memory query heads", RETRO, shown=SCALED.format(4))
    topk: PositiveInt | None = option(None, "slots read per head per token", RETRO, shown=SCALED.format(16))
    key_dim: Annotated[int, Field(gt=0, multiple_of=2)] | None = option(
        None, "query/key width (even: split in halves)", RETRO, shown=SCALED.format(256))
    alpha_init: NonNegativeFloat = option(0.01, "initial alpha of the memory branch (additive modes)", RETRO)

    @staticmethod
    def unused(config, command: str) -> dict[str, str]:
        if command == "retrofit" and config.mode == "replacement":
            return {"alpha_init": "--mode replacement has no alpha (the memory replaces the MLP)"}
        return {}


@dataclasses.dataclass
class SparseOptions(Section):
    """The background statistics, the row selection and the sparse update (--recipe sparse's own section)."""

    background: ExistingPath | None = option(None, "background statistics: a file written by `smf background` or its "
                                             "run directory (required for --recipe sparse)", TRAIN)
    rule: Literal[RULES] = option("tfidf", "slot scoring rule (--recipe sparse)", TRAIN)
    rows_per_step: PositiveInt | None = option(None, "T: value rows trained per layer per step (--recipe sparse)",
                                               TRAIN, shown="3.1%% of each memory's slots, at least 1, at most "
                                               "512: the paper's 512 of 16,384")
    update: Literal[SPARSE_UPDATES] = option(
        "exact", "exact: only the selected rows and their AdamW state move (--recipe sparse); the ablations "
        "dense_masked and authors (one process): docs/method.md#the-sparse-update-exact-default-and-the-authors-"
        "ablation", TRAIN)
    row_optimizer: Literal[ROW_OPTIMIZERS] = option(
        "adamw", "how --update exact steps the selected rows: adamw (row-sparse AdamW, the paper's) or sgd (plain "
        "SGD, as Lin et al. 2025: a row moves with its gradient; docs/method.md#the-row-optimizer-and-alphas-rate)",
        TRAIN)
    count_reads: Literal[COUNT_READS] = option(
        "all", "which tokens' memory reads steer the row selection (--recipe sparse): all = every non-padding token "
        "(the paper's), loss = only the positions whose next token the loss scores (docs/own-data.md#read-counting)",
        TRAIN)
    save_patch: bool = option(
        False, "also write final/patch/: a knowledge patch, the value rows (and any other memory tensor or alpha) "
        "this run changed against --adapter, a fraction of the adapter's size (docs/hf.md#knowledge-patches)", TRAIN)

    @staticmethod
    def unused(config, command: str) -> dict[str, str]:
        if not UPDATE_KINDS[config.update].row_optimizer:
            return {"row_optimizer": f"--update {config.update} steps torch AdamW; only --update exact steps rows "
                                     "with it"}
        return {}


@dataclasses.dataclass
class LoraOptions(Section):
    """LoRA's rank, alpha and dropout (--recipe lora's own section)."""

    lora_r: PositiveInt = option(16, "LoRA rank (--recipe lora)", TRAIN)
    lora_alpha: PositiveInt = option(32, "LoRA alpha (--recipe lora)", TRAIN)
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = option(0.05, "LoRA dropout (--recipe lora)", TRAIN)


@dataclasses.dataclass
class BackgroundOptions(Section):
    """How many documents smf background reads, and how many per forward (its own section)."""

    n_background: PositiveInt = option(2000, "background documents (the paper's single-example batches)", BG)
    batch_size: PositiveInt = option(1, "background documents per forward, each counted apart (the same statistics "
                                     "as one per forward up to last-bit rounding; benchmarks/RESULTS.md)", BG)


@dataclasses.dataclass
class DataOptions(Section):
    """What each stage trains on (or reads its statistics from), and how examples are drawn and cut."""

    protocol: Literal[PROTOCOLS] = option(DEFAULT_PROTOCOL, "data protocol: authors = the authors' texts and sampling, "
                                          "clean = loss-masked prompts (docs/method.md#the-protocol-setting)", ALL)
    oasst_path: DatasetPath | None = option(None, "local oasst1 train split (jsonl/parquet/save_to_disk)",
                                            RETRO + BG, shown="the hub")
    oasst_languages: str = option("en", "--protocol clean: comma-separated languages of the oasst1 replies used "
                                  "(e.g. en,de), or 'all' (the paper names no filter; English-only may hold under "
                                  "52,000 replies); the authors protocol takes English replies", RETRO + BG)
    medmcqa_path: DatasetPath | None = option(None, "local MedMCQA train split (jsonl/parquet/save_to_disk)",
                                              TRAIN, shown="the hub")
    retrofit_data: DatasetPath | None = option(None, "own retrofit texts, rows {\"text\": str} (docs/own-data.md); "
                                               "instead of --oasst-path / the hub", RETRO, shown="none: oasst1")
    background_data: DatasetPath | None = option(None, "own background-statistics texts, rows {\"text\": str} "
                                                 "(docs/own-data.md)", BG,
                                                 shown="the retrofit's --retrofit-data, else oasst1")
    train_data: DatasetPath | None = option(None, "own finetuning data: text, qa or mc rows (docs/own-data.md); "
                                            "instead of --medmcqa-path / the hub", TRAIN, shown="none: MedMCQA")
    loss_on: Literal[LOSS_ON] = option("all", "--train-data qa/mc rows: the loss on every token (all, as the "
                                       "authors) or on the answer only (answer: the prompt's labels are -100)", TRAIN)
    n_examples: PositiveInt | None = option(None, "training examples (own data: the first N rows, default all); "
                                            "background (--protocol clean): the retrofit set size, which background "
                                            "examples avoid", ALL)
    data_seed: Seed = option(0, "seed choosing the example subset (keep it fixed across runs)", ALL)
    max_length: PositiveInt = option(1024, "tokens per example (longer ones are cut)", ALL)

    @staticmethod
    def unused(config, command: str) -> dict[str, str]:
        unused = {}
        if command == "train" and config.train_data is None:
            unused["loss_on"] = ("only --train-data uses it (MedMCQA's training text is the protocol's: "
                                 "docs/method.md#the-protocol-setting)")
        if command in ("retrofit", "background") and config.own_data(command):
            unused["oasst_languages"] = "it filters oasst1 replies; own data is used as given"
            if command == "background":
                unused["n_examples"] = "own background texts are the first --n-background rows of --background-data"
        elif command in ("retrofit", "background") and config.protocol == "authors":
            unused["oasst_languages"] = ("the authors protocol takes the English replies, as the authors' code does; "
                                         "--protocol clean takes other languages")
            if command == "background":
                unused["n_examples"] = ("the authors protocol draws the background examples from its own pool (the "
                                        "first --n-background of it), whatever the retrofit's size; --protocol clean "
                                        "holds them out of the first --n-examples")
        return unused


@dataclasses.dataclass
class OptimizerOptions(Section):
    """How a retrofit or finetune steps: schedule, rates, batches, clipping, seed."""

    epochs: PositiveInt | None = option(None, "epochs", FIT)
    lr: PositiveFloat | None = option(None, "peak learning rate", FIT)
    alpha_lr: PositiveFloat | None = option(None, "peak learning rate of alpha, the memory branch's scale, in its own "
                                            "parameter group (the schedule scales it like --lr; the paper's +S: "
                                            "5e-4); only where alpha trains", FIT, shown="the run's --lr")
    weight_decay: NonNegativeFloat = option(0.0, "weight decay (AdamW: decoupled; --row-optimizer sgd: added to the "
                                            "selected rows' and alpha's gradient, as torch.optim.SGD)", FIT)
    warmup_steps: NonNegativeInt = option(100, "linear warm-up steps before the cosine decay", FIT)
    global_batch_size: PositiveInt = option(16, "examples per optimizer step, over all processes", FIT)
    micro_batch_size: PositiveInt = option(4, "examples per forward/backward, per process (gradient accumulation)", FIT)
    max_grad_norm: PositiveFloat = option(1.0, "global gradient-norm clip", FIT)
    seed: Seed = option(0, "training seed (memory init, epoch order, dropout)", FIT)

    @staticmethod
    def unused(config, command: str) -> dict[str, str]:
        why = config.frozen_alpha(command) if config.alpha_lr is not None and command in FIT else None
        return {"alpha_lr": why} if why else {}


@dataclasses.dataclass
class ParallelismOptions(Section):
    """How the model and the memories are split over torchrun processes (docs/sharding.md)."""

    shard_memories: bool = option(False, "split every memory's value table and its optimizer state by columns over the "
                                  "torchrun processes, for memories larger than one device (retrofit, --recipe "
                                  "sparse; docs/sharding.md)", FIT)
    fsdp: bool = option(False, "shard the base model (decoder layers, embeddings) and its optimizer state over the "
                        "torchrun processes with FSDP2; the memories stay out of it, replicated or split by "
                        "--shard-memories (docs/sharding.md#the-base-model-under-fsdp2)", TRAIN)


@dataclasses.dataclass
class CheckpointOptions(Section):
    """When a retrofit or finetune saves, stops and resumes."""

    save_every: PositiveInt = option(500, "optimizer steps between checkpoints (one is always written at the end)", FIT)
    max_steps: PositiveInt | None = option(None, "stop at this step (the schedule spans all epochs; see --resume)", FIT,
                                           shown="none: every step")
    resume: bool = option(False, "continue from the checkpoint in --output-dir", FIT)


SECTIONS = {"run": RunOptions, "model": ModelOptions, "memory": MemoryOptions, "sparse": SparseOptions,
            "lora": LoraOptions, "background": BackgroundOptions, "data": DataOptions, "optimizer": OptimizerOptions,
            "parallelism": ParallelismOptions, "checkpoints": CheckpointOptions}
_SHARED = ("run", "model", "data")
_TRAINED = (*_SHARED, "optimizer", "parallelism", "checkpoints")
# The sections each stage takes (a train stage is its --recipe): an option of any other section is not used by it.
STAGE_SECTIONS = {"retrofit": (*_TRAINED, "memory"), "background": (*_SHARED, "background"),
                  "sparse": (*_TRAINED, "memory", "sparse"), "lora": (*_TRAINED, "lora"), "full": _TRAINED}
SECTION_OF = {spec.name: name for name, section in SECTIONS.items() for spec in dataclasses.fields(section)}


def section_users(section: str, command: str) -> list[str]:
    """The stages of ``command`` (its recipes, for train) that take ``section``."""
    stages = TRAIN_RECIPES if command == "train" else (command,)
    return [stage for stage in stages if section in STAGE_SECTIONS[stage]]
