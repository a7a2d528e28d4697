"""The options of ``smf retrofit``, ``smf background`` and ``smf train``: one dataclass with the paper's
defaults (docs/method.md#two-stage-training), a tiny preset for CPU runs, config files and flags.

Precedence, lowest first: dataclass defaults < ``preset`` < config file < command-line flags.
Options left at None get the paper default of the recipe (learning rate, epochs, number of
examples) when the run starts: :meth:`RunConfig.resolved`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.errors import ConfigError
from smf.options import check, coerce, flag, mapping, only, option, read_file
from smf.vocabulary import (DEFAULT_MODEL, MEMORY_MODES, RECIPES, RULES, SPARSE_BACKWARDS, SPARSE_OPTIMIZERS,
                            TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, TINY_MODEL, TRAIN_RECIPES, canonical, check_layers)

# Paper defaults that depend on the recipe (docs/method.md#two-stage-training).
RECIPE_LR = {"retrofit": 5e-4, "sparse": 5e-4, "lora": 2e-4, "full": 5e-5}
RECIPE_EPOCHS = {"retrofit": 2, "sparse": 3, "lora": 3, "full": 3}
RECIPE_EXAMPLES = {"retrofit": 50_000, "sparse": 60_000, "lora": 60_000, "full": 60_000}
TINY_DATA = Path(__file__).resolve().parents[1] / "assets" / "tiny"  # package data, see smf/assets/README.md

ALL, FIT = ("retrofit", "background", "train"), ("retrofit", "train")
RETRO, BG, TRAIN = ("retrofit",), ("background",), ("train",)
POS, NONNEG = "positive", "non-negative"


@dataclass
class RunConfig:
    """Options of ``smf retrofit``, ``smf background`` and ``smf train`` (see :func:`smf.options.option`)."""

    output_dir: str | None = option(None, "run directory: checkpoints, train_log.jsonl, final artefact (required)", ALL)
    preset: str | None = option(None, "'tiny': tiny Qwen-2, byte tokenizer, tiny memories, the tiny data shipped in "
                                "smf/assets, small batches, so every recipe runs on CPU in seconds", ALL,
                                choices=("tiny",))
    model: str = option(DEFAULT_MODEL, "base model: hub id, local save_pretrained directory, or 'tiny'", ALL)
    recipe: str = option("sparse", "what to train (docs/method.md#two-stage-training)", TRAIN, choices=TRAIN_RECIPES)
    # memories (retrofit)
    mode: str | None = option(None, "how memories join the layer's MLP (retrofit; default additive). --recipe sparse: "
                              "default the adapter's mode; additive+s on an additive adapter also trains alpha (the "
                              "paper's +S starts from the additive retrofit)", FIT, choices=MEMORY_MODES)
    layers: list[int] = option((6, 12, 18), "0-based decoder layers that get a memory", RETRO)
    n_keys: int = option(128, "sub-keys per half (slots = n_keys**2)", RETRO, bound=POS)
    heads: int = option(4, "memory query heads", RETRO, bound=POS)
    topk: int = option(16, "slots read per head per token", RETRO, bound=POS)
    key_dim: int = option(256, "query/key width", RETRO, bound=POS)
    alpha_init: float = option(0.01, "initial alpha of the memory branch (additive modes)", RETRO, bound=NONNEG)
    backend: str | None = option(None, "memory kernel backend (torch, triton, ext; default: automatic)", ALL)
    # sparse memory finetuning
    adapter: str | None = option(None, "retrofit memory adapter: the retrofit run directory or its final/ folder "
                                 "(required for background and --recipe sparse)", ("background", "train"), path="dir")
    background: str | None = option(None, "background statistics: a file written by `smf background` or its run "
                                    "directory (required for --recipe sparse)", TRAIN, path="any")
    rule: str = option("tfidf", "slot scoring rule (--recipe sparse)", TRAIN, choices=RULES)
    rows_per_step: int = option(512, "T: value rows trained per layer per step (--recipe sparse)", TRAIN, bound=POS)
    optimizer: str = option("row_sparse", "row_sparse: only selected rows and their AdamW state move (default); "
                            "dense_masked: one selection per step, masked dense gradient, torch AdamW; authors: the "
                            "authors' update, rows selected per micro-batch counting padding, each backward masked, "
                            "dense AdamW (one process only) (--recipe sparse)", TRAIN, choices=SPARSE_OPTIMIZERS)
    sparse_backward: str = option("selected-rows", "selected-rows: rows are chosen before any backward of the step "
                                  "(under gradient accumulation after a no-grad counting forward over its "
                                  "micro-batches), so each backward writes only the T selected rows; read-rows: each "
                                  "backward writes every row its micro-batch read and the step keeps the selected ones "
                                  "(no extra forward; nearly dense gradients at large batches) (--recipe sparse)",
                                  TRAIN, choices=SPARSE_BACKWARDS)
    # LoRA
    lora_r: int = option(16, "LoRA rank (--recipe lora)", TRAIN, bound=POS)
    lora_alpha: int = option(32, "LoRA alpha (--recipe lora)", TRAIN, bound=POS)
    lora_dropout: float = option(0.05, "LoRA dropout (--recipe lora)", TRAIN, bound=NONNEG)
    # data
    protocol: str = option(DEFAULT_PROTOCOL, "data protocol: authors = the authors' training texts and sampling "
                           "(smf/data/protocol.py, docs/method.md); clean = loss-masked prompts, held-out background",
                           ALL, choices=PROTOCOLS)
    oasst_path: str | None = option(None, "local oasst1 train split (jsonl/parquet/save_to_disk); default: the hub",
                                    ("retrofit", "background"), path="any")
    oasst_languages: str = option("en", "comma-separated oasst1 languages of the assistant replies used (e.g. en,de), "
                                  "or 'all' (the paper names no filter; English-only may hold fewer than 52,000 "
                                  "replies)", ("retrofit", "background"))
    medmcqa_path: str | None = option(None, "local MedMCQA train split (jsonl/parquet/save_to_disk); default: the "
                                      "hub", TRAIN, path="any")
    n_examples: int | None = option(None, "training examples (default: 50000 retrofit, 60000 train); background: "
                                    "the retrofit set size, which background examples avoid", ALL, bound=POS)
    n_background: int = option(2000, "single-example background batches", BG, bound=POS)
    data_seed: int = option(0, "seed choosing the example subset (keep it fixed across runs)", ALL)
    max_length: int = option(1024, "tokens per example (longer ones are cut)", ALL, bound=POS)
    # optimisation
    epochs: int | None = option(None, "epochs (default: 2 retrofit, 3 train)", FIT, bound=POS)
    lr: float | None = option(None, "peak learning rate (default: 5e-4 retrofit/sparse, 2e-4 lora, 5e-5 full)", FIT,
                              bound=POS)
    weight_decay: float = option(0.0, "AdamW weight decay", FIT, bound=NONNEG)
    warmup_steps: int = option(100, "linear warm-up steps before the cosine decay", FIT, bound=NONNEG)
    global_batch_size: int = option(16, "examples per optimizer step, over all processes", FIT, bound=POS)
    micro_batch_size: int = option(4, "examples per forward/backward on one process (gradient accumulation fills "
                                   "the global batch)", FIT, bound=POS)
    max_grad_norm: float = option(1.0, "global gradient-norm clip", FIT, bound=POS)
    seed: int = option(0, "training seed (memory init, epoch order, dropout)", FIT)
    bf16: str = option("auto", "bf16 autocast: auto = on for CUDA devices with bf16, off on CPU", FIT,
                       choices=("auto", "on", "off"))
    device: str = option("auto", "torch device (auto: cuda if available, else cpu)", ALL)
    # checkpoints
    save_every: int = option(500, "optimizer steps between checkpoints (one is always written at the end)", FIT,
                             bound=POS)
    max_steps: int | None = option(None, "stop after this many optimizer steps (the schedule still spans all "
                                   "epochs; resume later with --resume)", FIT, bound=POS)
    resume: bool = option(False, "continue from the checkpoint in --output-dir", FIT)

    def __post_init__(self) -> None:
        self.layers = list(self.layers)

    def resolved(self, recipe: str) -> "RunConfig":
        """A copy with ``recipe`` set and the recipe's paper defaults filled in where options are None."""
        config = dataclasses.replace(self, recipe=recipe)
        if recipe == "retrofit" and config.mode is None:
            config.mode = "additive"
        if recipe in RECIPES:
            config.lr = RECIPE_LR[recipe] if config.lr is None else config.lr
            config.epochs = RECIPE_EPOCHS[recipe] if config.epochs is None else config.epochs
        if config.n_examples is None:
            config.n_examples = RECIPE_EXAMPLES["retrofit" if recipe == "background" else recipe]
        return config

    def to_dict(self) -> dict:
        """The options the run's command takes (plus ``recipe``), e.g. for run_config.json."""
        command = self.recipe if self.recipe in ("retrofit", "background") else "train"
        return {"recipe": self.recipe, **only(RunConfig, command, dataclasses.asdict(self))}


TINY_PRESET = {
    "model": TINY_MODEL,
    "layers": list(TINY_MEMORY_LAYERS),
    **TINY_MEMORY_KWARGS,
    "oasst_path": str(TINY_DATA / "oasst1_train.jsonl"),
    "medmcqa_path": str(TINY_DATA / "medmcqa_train.jsonl"),
    "rows_per_step": 32,
    "n_examples": 20,  # of the 28 English oasst1 pairs: 20 retrofit, 8 background
    "n_background": 8,
    "max_length": 256,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "warmup_steps": 2,
    "save_every": 10,
    "bf16": "off",
    "device": "cpu",
}
OPTIONS = tuple(field.name for field in dataclasses.fields(RunConfig))


def read_config_file(path: str | Path, command: str) -> dict:
    """Options from a YAML or JSON file whose keys are the option names (``output-dir`` or ``output_dir``).

    Keys of options that ``command`` does not take are skipped (one file can serve every command);
    unknown keys raise ConfigError.
    """
    where = f"--config {str(path)!r}"
    options = only(RunConfig, command, mapping(read_file(path), where, OPTIONS))
    return {name: coerce(RunConfig, name, value, f"{where}: option {name!r}") for name, value in options.items()}


def build_config(command: str, file_options: dict, cli_options: dict) -> RunConfig:
    """Defaults < preset (from file or flags) < file options < command-line options, validated."""
    preset = cli_options.get("preset", file_options.get("preset"))
    options = only(RunConfig, command, TINY_PRESET) if preset == "tiny" else {}
    options.update(file_options)
    options.update(cli_options)
    config = RunConfig(**{name: canonical(value, flag(name)) for name, value in options.items()})
    validate(config, command)
    return config


def validate(config: RunConfig, command: str) -> None:
    """Raise ConfigError for a bad value, a missing path, or an option missing for ``command``."""
    if config.output_dir is None:
        raise ConfigError("--output-dir is required")
    check(config)
    check_layers(config.layers, argument="--layers")
    if config.topk > config.n_keys:
        raise ConfigError(f"--topk {config.topk} must be <= --n-keys {config.n_keys}")
    if config.key_dim % 2:
        raise ConfigError(f"--key-dim must be even (it is split into two halves), got {config.key_dim}")
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
