"""Every rule on the options of ``smf retrofit``, ``smf background`` and ``smf train`` that a single option's type
cannot state (combinations, what a stage needs, what the adapter or the number of processes allows), in one place,
checked by :func:`check_run` before any model loads.

Each rule guards one section of :mod:`smf.train.sections` and is checked only for the stages that take it (a rule of
the sparse section never stops a LoRA run). The configuration (:func:`smf.train.config.build_config`, the command
line's and the suite's) checks the rules of the options; the trainer (:func:`smf.train.loop.train`) checks them again
with the rules of its start (``at_start``: what the number of processes or the adapter's saved mode allows), before it
claims the output directory or loads the model. What a recipe or a sparse update supports is read off its entry in
:data:`smf.vocabulary.RECIPE_KINDS` or :data:`~smf.vocabulary.UPDATE_KINDS`; the rule that a compiled sparse step runs
in one process is :func:`smf_kernels.sparse.fill_plan.check_one_process`, which the step's planner and the HF Trainer
call too. Adding a rule: one function here, registered with :func:`rule`.

This module imports neither torch nor the model code (the command line checks a config without them)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from smf.errors import ConfigError
from smf.train.sections import STAGE_SECTIONS
from smf.vocabulary import RECIPE_KINDS, RETROFIT_MODE, TINY_MODEL, UPDATE_KINDS, check_layers


@dataclass(frozen=True)
class Rule:
    """``check(config, command, world_size)`` raises a ConfigError when a ``command`` run of ``config`` breaks the
    rule; it runs for the stages that take ``section``, and with ``at_start`` only when the trainer starts (it reads
    ``world_size``, the number of processes, or the adapter's files)."""

    section: str
    check: Callable[..., None]
    at_start: bool = False


RULES: list[Rule] = []


def rule(section: str, *, at_start: bool = False):
    """Registers the decorated ``check(config, command, world_size)`` as a rule of ``section``."""
    def register(check):
        RULES.append(Rule(section, check, at_start))
        return check
    return register


def check_run(config, command: str, world_size: int | None = None) -> None:
    """ConfigError for the first rule that a ``command`` run of ``config`` (a :class:`~smf.train.config.RunConfig`)
    breaks: the rules of each section its stage takes, in the stage's section order; those of the trainer's start
    too when ``world_size`` (the number of processes) is given."""
    for section in STAGE_SECTIONS[config.stage(command)]:
        for checked in RULES:
            if checked.section == section and (world_size is not None or not checked.at_start):
                checked.check(config, command, world_size)


def adapter_mode(adapter: str) -> str:
    """The memory mode the adapter in ``adapter`` (a retrofit run directory or its final/ folder) was saved in;
    ConfigError naming --adapter when it holds none. Reads its config, a small JSON file."""
    from smf.model.adapter import read_adapter_config  # deferred: smf.model imports torch
    from smf.model.loading import adapter_dir

    directory = adapter_dir(adapter)  # ConfigError naming --adapter
    try:
        return read_adapter_config(directory)["mode"]
    except ValueError as err:
        raise ConfigError(f"--adapter: {err}") from None


BACKGROUND_FILE = "background.safetensors"  # what `smf background` writes in its output directory


def background_file(path: str) -> Path:
    """The background statistics file of --background ``path``: ``path`` itself, or ``path``/background.safetensors
    when ``path`` is a directory (`smf background`'s output directory); ConfigError naming --background when there is
    none."""
    candidate = Path(path) / BACKGROUND_FILE if Path(path).is_dir() else Path(path)
    if not candidate.is_file():
        raise ConfigError(f"--background {path!r}: no background statistics file ({BACKGROUND_FILE}) there")
    return candidate


def check_sparse_mode(mode: str | None, saved: str) -> None:
    """ConfigError unless --recipe sparse can finetune an adapter saved in mode ``saved`` in ``mode`` (None: the
    adapter's own): a mode other than the adapter's must start from a retrofit in the adapter's mode
    (:data:`smf.vocabulary.RETROFIT_MODE`: additive -> additive+s, alpha training too, how the paper's +S starts)."""
    if mode is not None and mode != saved and RETROFIT_MODE.get(mode) != saved:
        raise ConfigError(f"--mode {mode} cannot finetune an adapter retrofitted in mode {saved!r}; only an additive "
                          "adapter can be finetuned as additive+s (omit --mode to keep the adapter's mode)")


def check_batch_split(global_batch_size: int, micro_batch_size: int, processes: int = 1) -> None:
    """ConfigError unless a step's ``global_batch_size`` examples split into whole micro-batches of
    ``micro_batch_size`` on each of ``processes`` processes (the options' rule, and the trainer's at its start)."""
    if global_batch_size % (micro_batch_size * processes):
        over = f" x {processes} processes" if processes > 1 else ""
        raise ConfigError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                          f"{micro_batch_size}{over}")


def _sharding_recipes() -> str:
    """The recipes whose memories --shard-memories splits, as its messages name them."""
    return " and ".join(name if kind.command == name else f"--recipe {name}"
                        for name, kind in RECIPE_KINDS.items() if kind.shards_memories)


# ---------------------------------------------------------------------------------------------------- run, model


@rule("run")
def _output_dir_given(config, command: str, world_size: int | None) -> None:
    if config.output_dir is None:
        raise ConfigError("--output-dir is required")


@rule("model")
def _model_directory_exists(config, command: str, world_size: int | None) -> None:
    model = config.model
    if model != TINY_MODEL and (model.startswith((".", "/", "~")) or Path(model).exists()) \
            and not Path(model).is_dir():
        raise ConfigError(f"--model: no such directory {model!r}")


# ---------------------------------------------------------------------------------------------------- memory


@rule("memory")
def _memory_sizes(config, command: str, world_size: int | None) -> None:
    if config.layers is not None:
        check_layers(config.layers, argument="--layers")
    if config.topk is not None and config.n_keys is not None and config.topk > config.n_keys:
        raise ConfigError(f"--topk {config.topk} must be <= --n-keys {config.n_keys}")


# ---------------------------------------------------------------------------------------------------- sparse


@rule("sparse")
def _sparse_inputs_given(config, command: str, world_size: int | None) -> None:
    if config.adapter is None:
        raise ConfigError("--adapter (the retrofit run directory) is required for --recipe sparse")
    if config.background is None:
        raise ConfigError("--background (file from `smf background`) is required for --recipe sparse")


@rule("sparse", at_start=True)
def _background_file_exists(config, command: str, world_size: int | None) -> None:
    background_file(config.background)


@rule("sparse")
def _loss_reads(config, command: str, world_size: int | None) -> None:
    if config.count_reads != "loss":
        return
    if config.compile:
        raise ConfigError("--count-reads loss is not available with --compile (its mask is set by a forward "
                          "hook); drop one of them")
    every_position = UPDATE_KINDS[config.update].counts_every_position
    if every_position:
        raise ConfigError(f"--count-reads loss: {every_position}; use the exact sparse update")


@rule("sparse", at_start=True)
def _mode_of_the_adapter(config, command: str, world_size: int | None) -> None:
    if config.mode is not None:
        check_sparse_mode(config.mode, adapter_mode(config.adapter))


@rule("sparse")
def _update_with_sharded_memories(config, command: str, world_size: int | None) -> None:
    if config.shard_memories and UPDATE_KINDS[config.update].one_process:
        raise ConfigError(f"--shard-memories splits the memories of {_sharding_recipes()} runs, not of --recipe "
                          f"{config.recipe} --update {config.update} (one process)")


@rule("sparse", at_start=True)
def _compiled_in_one_process(config, command: str, world_size: int | None) -> None:
    from smf_kernels.sparse.fill_plan import check_one_process  # deferred: torch, when the trainer runs

    try:
        check_one_process(config.compile, world_size, subject="--compile with --recipe sparse")
    except ValueError as err:
        raise ConfigError(str(err)) from None


@rule("sparse", at_start=True)
def _update_in_one_process(config, command: str, world_size: int | None) -> None:
    one_process = UPDATE_KINDS[config.update].one_process
    if one_process and world_size > 1:
        raise ConfigError(f"--update {config.update} runs in one process ({one_process}); drop torchrun or choose "
                          "--update exact")


# ---------------------------------------------------------------------------------------------------- background


@rule("background")
def _background_adapter_given(config, command: str, world_size: int | None) -> None:
    if config.adapter is None:
        raise ConfigError("--adapter (the retrofit run directory) is required for background")


# ---------------------------------------------------------------------------------------------------- optimizer


@rule("optimizer")
def _whole_micro_batches(config, command: str, world_size: int | None) -> None:
    check_batch_split(config.global_batch_size, config.micro_batch_size, world_size or 1)


# ---------------------------------------------------------------------------------------------------- parallelism


@rule("parallelism")
def _sharded_memories(config, command: str, world_size: int | None) -> None:
    if config.shard_memories and not RECIPE_KINDS[config.stage(command)].shards_memories:
        raise ConfigError(f"--shard-memories splits the memories of {_sharding_recipes()} runs, not of --recipe "
                          f"{config.recipe}")


@rule("parallelism")
def _fsdp_not_compiled(config, command: str, world_size: int | None) -> None:
    if command == "train" and config.fsdp and config.compile:
        raise ConfigError("--fsdp is not available with --compile (the compiled step is not written for FSDP2's "
                          "hooks); drop one of them")


@rule("parallelism", at_start=True)
def _fsdp_over_processes(config, command: str, world_size: int | None) -> None:
    if command == "train" and config.fsdp and world_size == 1:
        raise ConfigError("--fsdp shards the base model over the torchrun processes; this run has one process "
                          "(launch it with torchrun --nproc-per-node N, N >= 2, or drop --fsdp)")
