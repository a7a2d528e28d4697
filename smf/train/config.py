"""The options of ``smf retrofit``, ``smf background`` and ``smf train``: one dataclass with the paper's defaults
(docs/method.md#two-stage-training), a tiny preset for CPU runs, and :func:`build_config`, which layers defaults <
``preset`` < config file < command-line flags. Options left at None get the recipe's paper default when the run
starts (:meth:`RunConfig.resolved`)."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.errors import ConfigError
from smf.options import (OPTIONS_CONFIG, AsList, DatasetPath, ExistingDir, ExistingPath, Seed, checked, flag, only,
                         option, read_file)
from smf.vocabulary import (BACKENDS, COUNT_READS, DEFAULT_MODEL, LOSS_ON, MEMORY_MODES, ROW_OPTIMIZERS, RULES,
                            SPARSE_UPDATES, TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, TINY_MODEL, TRAIN_RECIPES,
                            check_layers)

logger = logging.getLogger(__name__)

# Paper defaults of the options a recipe leaves at None (docs/method.md#two-stage-training; background: see n_examples).
RECIPE_LR = {"retrofit": 5e-4, "sparse": 5e-4, "lora": 2e-4, "full": 5e-5}
RECIPE_DEFAULTS = {"retrofit": {"mode": "additive", "lr": RECIPE_LR["retrofit"], "epochs": 2, "n_examples": 50_000},
                   "background": {"n_examples": 50_000},
                   **{recipe: {"lr": RECIPE_LR[recipe], "epochs": 3, "n_examples": 60_000} for recipe in TRAIN_RECIPES}}
# The command that runs each stage, the ``recipe`` of a resolved RunConfig.
STAGE_COMMANDS = {"retrofit": "retrofit", "background": "background", **dict.fromkeys(TRAIN_RECIPES, "train")}
CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # shipped configs and the tiny preset (package data)

ALL, FIT = ("retrofit", "background", "train"), ("retrofit", "train")
RETRO, BG, TRAIN = ("retrofit",), ("background",), ("train",)


SCALED = "scaled to the model (docs/own-data.md#memory-sizes); {} at Qwen-2.5-0.5B"
MEMORY_SIZES = ("layers", "n_keys", "heads", "topk", "key_dim")


def model_config(model: str):
    """The transformers config of base model ``model`` (:func:`smf.model.sizes.model_architecture`), or a
    ConfigError saying which options to give instead."""
    from smf.model.sizes import model_architecture

    try:
        return model_architecture(model)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {model!r}: cannot read its config to scale the memory sizes to it ({err}); give "
                          "--layers, --n-keys, --heads, --topk and --key-dim") from None


@dataclasses.dataclass
class RunConfig:
    """Options of ``smf retrofit``, ``smf background`` and ``smf train`` (see :func:`smf.options.option`)."""

    __pydantic_config__ = OPTIONS_CONFIG  # every float finite

    output_dir: str | None = option(None, "run directory: checkpoints, train_log.jsonl, final artefact (required)", ALL)
    preset: Literal["tiny"] | None = option(None, "'tiny': every recipe on CPU in seconds (tiny Qwen-2, byte "
                                            "tokenizer, tiny memories, small batches, the data in smf/assets)", ALL)
    model: str = option(DEFAULT_MODEL, "base model: hub id, local save_pretrained directory, or 'tiny'", ALL)
    recipe: Literal[TRAIN_RECIPES] = option("sparse", "what to train (docs/method.md#two-stage-training)", TRAIN)
    # memories (retrofit)
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
    backend: Literal[BACKENDS] | None = option(None, "memory kernel backend; it must run on --device", ALL,
                                               shown="automatic: triton on CUDA, else ext when built, else torch")
    # sparse memory finetuning
    adapter: ExistingDir | None = option(None, "retrofit memory adapter: the retrofit run directory or its final/ "
                                         "folder (required for background and --recipe sparse; --recipe full: "
                                         "finetune the model with these memories, every parameter; --recipe lora: "
                                         "LoRA on the model with these memories, frozen)", BG + TRAIN)
    background: ExistingPath | None = option(None, "background statistics: a file written by `smf background` or its "
                                             "run directory (required for --recipe sparse)", TRAIN)
    rule: Literal[RULES] = option("tfidf", "slot scoring rule (--recipe sparse)", TRAIN)
    rows_per_step: PositiveInt | None = option(None, "T: value rows trained per layer per step (--recipe sparse)",
                                               TRAIN, shown="3.1%% of each memory's slots, at least 1: the paper's "
                                               "512 of 16,384")
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
    shard_memories: bool = option(False, "split every memory's value table and its optimizer state by columns over the "
                                  "torchrun processes, for memories larger than one device (retrofit, --recipe "
                                  "sparse; docs/sharding.md)", FIT)
    fsdp: bool = option(False, "shard the base model (decoder layers, embeddings) and its optimizer state over the "
                        "torchrun processes with FSDP2; the memories stay out of it, replicated or split by "
                        "--shard-memories (docs/sharding.md#the-base-model-under-fsdp2)", TRAIN)
    # LoRA
    lora_r: PositiveInt = option(16, "LoRA rank (--recipe lora)", TRAIN)
    lora_alpha: PositiveInt = option(32, "LoRA alpha (--recipe lora)", TRAIN)
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = option(0.05, "LoRA dropout (--recipe lora)", TRAIN)
    # data
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
    n_examples: PositiveInt | None = option(None, "training examples (own data: the first N rows, default all); background (--protocol clean): the retrofit "
                                            "set size, which background examples avoid", ALL)
    n_background: PositiveInt = option(2000, "background documents (the paper's single-example batches)", BG)
    batch_size: PositiveInt = option(1, "background documents per forward, each counted apart (the same statistics "
                                     "as one per forward up to last-bit rounding; benchmarks/RESULTS.md)", BG)
    data_seed: Seed = option(0, "seed choosing the example subset (keep it fixed across runs)", ALL)
    max_length: PositiveInt = option(1024, "tokens per example (longer ones are cut)", ALL)
    # optimisation
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
    bf16: Literal["auto", "on", "off"] = option("auto", "bf16 autocast (auto: on if the CUDA device has bf16)", FIT)
    device: str = option("auto", "torch device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...", ALL)
    threads: PositiveInt | None = option(None, "torch threads of this process", ALL,
                                         shown="1 for a small model (tiny, or local of hidden size <= 256)")
    compile: bool = option(False, "torch.compile the model, mode reduce-overhead (CUDA graphs on a GPU); --recipe "
                           "sparse then selects the rows before (or, one micro-batch, in) the backward, a step "
                           "without graph breaks (one process)", FIT)
    # checkpoints
    save_every: PositiveInt = option(500, "optimizer steps between checkpoints (one is always written at the end)", FIT)
    max_steps: PositiveInt | None = option(None, "stop at this step (the schedule spans all epochs; see --resume)", FIT,
                                           shown="none: every step")
    resume: bool = option(False, "continue from the checkpoint in --output-dir", FIT)

    def __post_init__(self) -> None:
        self.layers = None if self.layers is None else list(self.layers)

    def resolved(self, recipe: str) -> "RunConfig":
        """A copy with ``recipe`` set and the recipe's paper defaults filled in where options are None."""
        defaults = {name: value for name, value in RECIPE_DEFAULTS[recipe].items() if getattr(self, name) is None}
        if self.own_data(recipe):  # own files are used whole unless --n-examples cuts them
            defaults.pop("n_examples", None)
        if recipe == "retrofit" and any(getattr(self, name) is None for name in MEMORY_SIZES):
            defaults.update(self._scaled_sizes())
        return dataclasses.replace(self, recipe=recipe, **defaults)

    def _scaled_sizes(self) -> dict:
        """The memory sizes left at None, scaled to the model (:mod:`smf.model.sizes`); topk by the rule for a
        given n_keys."""
        from smf.model.sizes import scaled_memory_sizes

        scaled = scaled_memory_sizes(model_config(self.model))
        scaled["layers"] = list(scaled["layers"])
        if self.topk is None and self.n_keys is not None:
            scaled["topk"] = max(1, min(scaled["topk"], self.n_keys // 2))
        return {name: scaled[name] for name in MEMORY_SIZES if getattr(self, name) is None}

    def own_data(self, recipe: str | None = None) -> bool:
        """Whether stage ``recipe`` (default: this config's) reads a user's own files (docs/own-data.md)."""
        recipe = recipe or self.recipe
        if recipe == "retrofit":
            return self.retrofit_data is not None
        if recipe == "background":
            return self.background_data is not None
        return self.train_data is not None

    def to_dict(self) -> dict:
        """The options the run's command takes (plus ``recipe``), e.g. for run_config.json."""
        return {"recipe": self.recipe, **only(RunConfig, STAGE_COMMANDS[self.recipe], dataclasses.asdict(self))}


OPTIONS = tuple(field.name for field in dataclasses.fields(RunConfig))
# (own-data option, the paper's dataset option it replaces): not both (docs/own-data.md).
OWN_INSTEAD_OF = (("retrofit_data", "oasst_path"), ("background_data", "oasst_path"), ("train_data", "medmcqa_path"))

# The options --update replaced (docs/method.md#migrating-from---optimizer): --optimizer row_sparse | dense_masked |
# authors is --update exact | dense_masked | authors; --sparse-backward and --fused-update are gone (one exact path,
# which fills the rows' gradient by itself: smf_kernels.sparse.controller).
LEGACY_UPDATE_OPTIONS = ("optimizer", "sparse_backward", "fused_update")
_UPDATE_OF_OPTIMIZER = {"row_sparse": "exact", "row-sparse": "exact", "dense_masked": "dense_masked",
                        "dense-masked": "dense_masked", "authors": "authors"}


def migrate_update_options(options: dict, where: str) -> dict:
    """``options`` with the keys --update replaced (:data:`LEGACY_UPDATE_OPTIONS`) mapped to ``update`` or dropped,
    with one warning naming them; an unknown ``optimizer`` value is left for the check to refuse."""
    legacy = [name for name in LEGACY_UPDATE_OPTIONS if name in options]
    if not legacy:
        return options
    migrated = {name: value for name, value in options.items() if name not in LEGACY_UPDATE_OPTIONS}
    if options.get("optimizer") is not None and "update" not in migrated:
        migrated["update"] = _UPDATE_OF_OPTIMIZER.get(str(options["optimizer"]), options["optimizer"])
    message = (f"{where}: {', '.join(legacy)} {'is' if len(legacy) == 1 else 'are'} replaced by 'update' (exact, "
               "dense_masked or authors; the exact update fills the rows' gradient by itself): read as update "
               f"{migrated.get('update', 'exact')!r}")
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    logger.warning(message)
    return migrated


def fingerprint_form(options: dict) -> dict:
    """Resolved train options in the form suite fingerprints hashed before --update existed (``optimizer``,
    ``sparse_backward`` and ``fused_update`` in their defaults), so that stage directories written then still
    match: new options (``update``) and old ones (run_config.json files of earlier runs) give the same dict."""
    if "update" not in options and "optimizer" not in options:
        return options
    if "update" in options:
        optimizer = {"exact": "row_sparse"}.get(options["update"], options["update"])
    else:
        optimizer = _UPDATE_OF_OPTIMIZER.get(options["optimizer"], options["optimizer"])
        optimizer = {"exact": "row_sparse"}.get(optimizer, optimizer)
    form = {name: value for name, value in options.items() if name != "update"}
    form.update(optimizer=optimizer, sparse_backward="selected-rows" if options.get("compile") else "deferred",
                fused_update=False)
    return form
# The tiny preset: the tiny model and memories of smf.vocabulary and the options in smf/configs/preset_tiny.yaml.
TINY_PRESET = {"model": TINY_MODEL, "layers": list(TINY_MEMORY_LAYERS), **TINY_MEMORY_KWARGS, **{
    name: str((CONFIGS / value).resolve()) if name.endswith("_path") else value
    for name, value in read_file(CONFIGS / "preset_tiny.yaml", OPTIONS).items()}}


def checked_options(options: dict, where: str) -> dict:
    """``options`` (of RunConfig) checked and coerced to their types; ConfigError: ``{where}: option 'name': ...``."""
    config = checked(RunConfig, options, lambda name: f"{where}: option {name!r}")
    return {name: getattr(config, name) for name in options}


def read_config_file(path: str | Path, command: str) -> dict:
    """The options in a YAML or JSON file whose keys are option names (``output-dir`` or ``output_dir``), checked.
    Keys of options ``command`` does not take are skipped (one file serves every command); unknown ones: ConfigError."""
    where = f"--config {str(path)!r}"
    options = migrate_update_options(read_file(path, OPTIONS + LEGACY_UPDATE_OPTIONS), where)
    return checked_options(only(RunConfig, command, options), where)


def check_device_and_backend(device: str, backend: str | None) -> None:
    """ConfigError unless ``device`` is a device of this machine and ``backend`` (None: automatic) runs on it."""
    from smf.train.distributed import pick_device
    from smf_kernels.backends import unavailable_reason

    resolved = pick_device(device)
    reason = None if backend is None else unavailable_reason(backend, resolved)
    if reason is not None:
        raise ConfigError(f"--backend {backend} cannot run on {resolved.type} (--device {device}): {reason}")


def unused_options(config: RunConfig, command: str) -> dict[str, str]:
    """The options of ``command`` that a run of ``config`` does not use, each with the reason."""
    unused = {}
    if command == "train":
        if config.recipe != "sparse":
            why = f"only --recipe sparse uses it (this run is --recipe {config.recipe})"
            unused.update(dict.fromkeys(("adapter", "background", "rule", "rows_per_step", "update", "row_optimizer",
                                         "mode", "backend"), why))
        if config.recipe != "lora":
            unused.update(dict.fromkeys(("lora_r", "lora_alpha", "lora_dropout"),
                                        f"only --recipe lora uses it (this run is --recipe {config.recipe})"))
    if command in ("retrofit", "background") and config.protocol == "authors":
        unused["oasst_languages"] = ("the authors protocol takes the English replies, as the authors' code does; "
                                     "--protocol clean takes other languages")
    if command == "background" and config.protocol == "authors":
        unused["n_examples"] = ("the authors protocol draws the background examples from its own pool (the first "
                                "--n-background of it), whatever the retrofit's size; --protocol clean holds them "
                                "out of the first --n-examples")
    if command == "train" and config.recipe in ("full", "lora") and config.adapter is not None:
        for name in ("adapter", "backend"):  # full finetuning or LoRA from a checkpoint holding memories
            unused.pop(name, None)
    if command == "train" and config.recipe != "sparse":
        unused["count_reads"] = f"only --recipe sparse selects rows (this run is --recipe {config.recipe})"
    if command == "train" and config.train_data is None:
        unused["loss_on"] = ("only --train-data uses it (MedMCQA's training text is the protocol's: docs/method.md"
                             "#the-protocol-setting)")
    if command in ("retrofit", "background") and config.own_data(command):
        unused["oasst_languages"] = "it filters oasst1 replies; own data is used as given"
        if command == "background":
            unused["n_examples"] = "own background texts are the first --n-background rows of --background-data"
    if command == "retrofit" and config.mode == "replacement":
        unused["alpha_init"] = "--mode replacement has no alpha (the memory replaces the MLP)"
    if command == "train" and config.recipe == "sparse" and config.update != "exact":
        unused["row_optimizer"] = f"--update {config.update} steps torch AdamW; only --update exact steps rows with it"
    if command in ("retrofit", "train") and config.alpha_lr is not None:
        why = frozen_alpha(config, command)
        if why:
            unused["alpha_lr"] = why
    return unused


def frozen_alpha(config: RunConfig, command: str) -> str | None:
    """Why a ``command`` run of ``config`` trains no alpha (so that --alpha-lr has nothing to set), or None when
    it trains one: a retrofit in an additive mode, --recipe sparse in mode additive+s, --recipe full from an adapter
    with an alpha. Reads the adapter's config (a small JSON file) when the mode is the adapter's."""
    if command == "retrofit":
        return "--mode replacement has no alpha (the memory replaces the MLP)" if config.mode == "replacement" else None
    if config.recipe == "lora" or (config.recipe == "full" and config.adapter is None):
        return f"--recipe {config.recipe} trains no memory, so no alpha"
    from smf.model.adapter import read_adapter_config  # deferred: smf.model imports torch
    from smf.model.loading import adapter_dir

    directory = adapter_dir(config.adapter)  # ConfigError naming --adapter
    try:
        saved = read_adapter_config(directory)["mode"]
    except ValueError as err:
        raise ConfigError(f"--adapter: {err}") from None
    mode = (config.mode or saved) if config.recipe == "sparse" else saved
    if mode == "replacement":
        return "the adapter's memories are in mode replacement, which has no alpha"
    if config.recipe == "sparse" and mode != "additive+s":
        return f"--recipe sparse in mode {mode} keeps alpha frozen (mode additive+s trains it: --mode additive+s)"
    return None


def refuse_unused(config: RunConfig, command: str, cli_options: dict, file_options: dict) -> None:
    """ConfigError for a command-line flag the run would ignore (whatever its value: ``--recipe lora --update exact``
    too), with the reason; a logged warning for such a key of a config file given a value other than its default
    (one file may serve several commands and recipes)."""
    defaults = {field.name: field.default for field in dataclasses.fields(RunConfig)}
    for name, why in unused_options(config, command).items():
        if name in cli_options:
            raise ConfigError(f"{flag(name)} is not used by this run: {why}; drop it")
        if name in file_options and file_options[name] != defaults[name]:
            logger.warning("--config: %s %r is not used by this run: %s", name, file_options[name], why)


def build_config(command: str, file_options: dict, cli_options: dict) -> RunConfig:
    """Defaults < preset (from file or flags) < file options < command-line options, checked (ConfigError): each value
    by its type (choices, bounds, existing paths), then combinations, the model directory, what ``command`` needs,
    and that the device exists and the backend runs on it."""
    preset = cli_options.get("preset", file_options.get("preset"))
    options = {**(only(RunConfig, command, TINY_PRESET) if preset == "tiny" else {}), **file_options, **cli_options}
    given = {**file_options, **cli_options}
    for own, paper in OWN_INSTEAD_OF:
        if given.get(own) is not None and given.get(paper) is not None:
            raise ConfigError(f"{flag(own)} and {flag(paper)} cannot both be given: own data replaces the paper's "
                              "dataset (docs/own-data.md)")
        if options.get(own) is not None:
            options.pop(paper, None)  # the preset's paper data gives way to the user's own
    config = checked(RunConfig, options)
    if config.output_dir is None:
        raise ConfigError("--output-dir is required")
    if config.layers is not None:
        check_layers(config.layers, argument="--layers")
    if config.topk is not None and config.n_keys is not None and config.topk > config.n_keys:
        raise ConfigError(f"--topk {config.topk} must be <= --n-keys {config.n_keys}")
    if config.global_batch_size % config.micro_batch_size:
        raise ConfigError(f"--global-batch-size {config.global_batch_size} is not a multiple of "
                          f"--micro-batch-size {config.micro_batch_size}")
    if config.model != TINY_MODEL and (config.model.startswith((".", "/", "~")) or Path(config.model).exists()):
        if not Path(config.model).is_dir():
            raise ConfigError(f"--model: no such directory {config.model!r}")
    sparse = command == "train" and config.recipe == "sparse"
    if (command == "background" or sparse) and config.adapter is None:
        raise ConfigError(f"--adapter (the retrofit run directory) is required for "
                          f"{'background' if command == 'background' else '--recipe sparse'}")
    if sparse and config.background is None:
        raise ConfigError("--background (file from `smf background`) is required for --recipe sparse")
    if config.shard_memories and command == "train" and (not sparse or config.update == "authors"):
        raise ConfigError(f"--shard-memories splits the memories of retrofit and --recipe sparse runs, not of --recipe "
                          f"{config.recipe}{' --update authors (one process)' if sparse else ''}")
    if command == "train" and config.fsdp and config.compile:
        raise ConfigError("--fsdp is not available with --compile (the compiled step is not written for FSDP2's "
                          "hooks); drop one of them")
    if command == "train" and config.count_reads == "loss" and config.compile:
        raise ConfigError("--count-reads loss is not available with --compile (its mask is set by a forward hook); "
                          "drop one of them")
    check_device_and_backend(config.device, config.backend)
    return config
