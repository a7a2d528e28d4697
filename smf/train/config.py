"""The run configuration of every training command: one dataclass with the paper's defaults (SPEC §3),
a tiny preset for CPU runs, YAML/JSON config files and command-line overrides.

Precedence, lowest first: dataclass defaults < ``preset`` < config file < command-line flags.
Options left at None get the paper default of the recipe (learning rate, epochs, number of
examples) when the run starts: :meth:`RunConfig.resolved`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.errors import ConfigError
from smf.vocabulary import (DEFAULT_MODEL, MEMORY_MODES, RECIPES, RULES, SPARSE_BACKWARDS, SPARSE_OPTIMIZERS,
                            TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, TINY_MODEL, TRAIN_RECIPES, canonical, check_layers)

BF16_CHOICES = ("auto", "on", "off")
PRESETS = ("tiny",)

# Paper defaults that depend on the recipe (SPEC §3).
RECIPE_LR = {"retrofit": 5e-4, "sparse": 5e-4, "lora": 2e-4, "full": 5e-5}
RECIPE_EPOCHS = {"retrofit": 2, "sparse": 3, "lora": 3, "full": 3}
RECIPE_EXAMPLES = {"retrofit": 50_000, "sparse": 60_000, "lora": 60_000, "full": 60_000}

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"


def _opt(default, help: str, commands: tuple[str, ...], choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "commands": commands, "choices": choices})


ALL = ("retrofit", "background", "train")


@dataclass
class RunConfig:
    """Options of ``smf retrofit``, ``smf background`` and ``smf train`` (metadata: help, commands, choices)."""

    output_dir: str | None = _opt(None, "run directory: checkpoints, train_log.jsonl, final artefact (required)", ALL)
    preset: str | None = _opt(None, "'tiny': tiny Qwen-2, byte tokenizer, tiny memories, tests/fixtures data, "
                              "small batches, so every recipe runs on CPU in seconds", ALL, PRESETS)
    model: str = _opt(DEFAULT_MODEL, "base model: hub id, local save_pretrained directory, or 'tiny'", ALL)
    recipe: str = _opt("sparse", "what to train (SPEC §3)", ("train",), TRAIN_RECIPES)
    # memories (retrofit)
    mode: str | None = _opt(None, "how memories join the layer's MLP (retrofit; default additive). --recipe sparse: "
                            "default the adapter's mode; additive+s on an additive adapter also trains alpha (the "
                            "paper's +S starts from the additive retrofit)", ("retrofit", "train"), MEMORY_MODES)
    layers: list[int] = _opt((6, 12, 18), "0-based decoder layers that get a memory", ("retrofit",))
    n_keys: int = _opt(128, "sub-keys per half (slots = n_keys**2)", ("retrofit",))
    heads: int = _opt(4, "memory query heads", ("retrofit",))
    topk: int = _opt(16, "slots read per head per token", ("retrofit",))
    key_dim: int = _opt(256, "query/key width", ("retrofit",))
    alpha_init: float = _opt(0.01, "initial alpha of the memory branch (additive modes)", ("retrofit",))
    backend: str | None = _opt(None, "memory kernel backend (torch, triton, ext; default: automatic)", ALL)
    # sparse memory finetuning
    adapter: str | None = _opt(None, "retrofit memory adapter: the retrofit run directory or its final/ folder "
                               "(required for background and --recipe sparse)", ("background", "train"))
    background: str | None = _opt(None, "background statistics: a file written by `smf background` or its run "
                                  "directory (required for --recipe sparse)", ("train",))
    rule: str = _opt("tfidf", "slot scoring rule (--recipe sparse)", ("train",), RULES)
    rows_per_step: int = _opt(512, "T: value rows trained per layer per step (--recipe sparse)", ("train",))
    optimizer: str = _opt("row_sparse", "row_sparse: only selected rows and their AdamW state move (default); "
                          "dense_masked: one selection per step, masked dense gradient, torch AdamW; authors: the "
                          "authors' update, rows selected per micro-batch counting padding, each backward masked, "
                          "dense AdamW (one process only) (--recipe sparse)", ("train",), SPARSE_OPTIMIZERS)
    sparse_backward: str = _opt("selected-rows", "selected-rows: rows are chosen before any backward of the step "
                                "(under gradient accumulation after a no-grad counting forward over its micro-batches), "
                                "so each backward writes only the T selected rows; read-rows: each backward writes "
                                "every row its micro-batch read and the step keeps the selected ones (no extra "
                                "forward; nearly dense gradients at large batches) (--recipe sparse)",
                                ("train",), SPARSE_BACKWARDS)
    # LoRA
    lora_r: int = _opt(16, "LoRA rank (--recipe lora)", ("train",))
    lora_alpha: int = _opt(32, "LoRA alpha (--recipe lora)", ("train",))
    lora_dropout: float = _opt(0.05, "LoRA dropout (--recipe lora)", ("train",))
    # data
    protocol: str = _opt(DEFAULT_PROTOCOL, "data protocol: authors = the authors' training texts and sampling "
                         "(smf/data/protocol.py, docs/method.md); clean = loss-masked prompts, held-out background",
                         ALL, PROTOCOLS)
    oasst_path: str | None = _opt(None, "local oasst1 train split (jsonl/parquet/save_to_disk); default: the hub",
                                  ("retrofit", "background"))
    oasst_languages: str = _opt("en", "comma-separated oasst1 languages of the assistant replies used (e.g. en,de), "
                                "or 'all' (SPEC names no filter; English-only may hold fewer than 52,000 replies)",
                                ("retrofit", "background"))
    medmcqa_path: str | None = _opt(None, "local MedMCQA train split (jsonl/parquet/save_to_disk); default: the hub",
                                    ("train",))
    n_examples: int | None = _opt(None, "training examples (default: 50000 retrofit, 60000 train); background: "
                                  "the retrofit set size, which background examples avoid", ALL)
    n_background: int = _opt(2000, "single-example background batches", ("background",))
    data_seed: int = _opt(0, "seed choosing the example subset (keep it fixed across runs)", ALL)
    max_length: int = _opt(1024, "tokens per example (longer ones are cut)", ALL)
    # optimisation
    epochs: int | None = _opt(None, "epochs (default: 2 retrofit, 3 train)", ("retrofit", "train"))
    lr: float | None = _opt(None, "peak learning rate (default: 5e-4 retrofit/sparse, 2e-4 lora, 5e-5 full)",
                            ("retrofit", "train"))
    weight_decay: float = _opt(0.0, "AdamW weight decay", ("retrofit", "train"))
    warmup_steps: int = _opt(100, "linear warm-up steps before the cosine decay", ("retrofit", "train"))
    global_batch_size: int = _opt(16, "examples per optimizer step, over all processes", ("retrofit", "train"))
    micro_batch_size: int = _opt(4, "examples per forward/backward on one process (gradient accumulation fills "
                                 "the global batch)", ("retrofit", "train"))
    max_grad_norm: float = _opt(1.0, "global gradient-norm clip", ("retrofit", "train"))
    seed: int = _opt(0, "training seed (memory init, epoch order, dropout)", ("retrofit", "train"))
    bf16: str = _opt("auto", "bf16 autocast: auto = on for CUDA devices with bf16, off on CPU",
                     ("retrofit", "train"), BF16_CHOICES)
    device: str = _opt("auto", "torch device (auto: cuda if available, else cpu)", ALL)
    # checkpoints
    save_every: int = _opt(500, "optimizer steps between checkpoints (one is always written at the end)",
                           ("retrofit", "train"))
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (the schedule still spans all "
                                 "epochs; resume later with --resume)", ("retrofit", "train"))
    resume: bool = _opt(False, "continue from the checkpoint in --output-dir", ("retrofit", "train"))

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
        return {name: value for name, value in dataclasses.asdict(self).items()
                if name == "recipe" or command in FIELDS[name].metadata["commands"]}


FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}

TINY_PRESET = {
    "model": TINY_MODEL,
    "layers": list(TINY_MEMORY_LAYERS),
    **TINY_MEMORY_KWARGS,
    "oasst_path": str(FIXTURES / "oasst1_train.jsonl"),
    "medmcqa_path": str(FIXTURES / "medmcqa_train.jsonl"),
    "rows_per_step": 32,
    "n_examples": 20,  # of the fixtures' 28 English oasst1 pairs: 20 retrofit, 8 background
    "n_background": 8,
    "max_length": 256,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "warmup_steps": 2,
    "save_every": 10,
    "bf16": "off",
    "device": "cpu",
}


def field_type(name: str):
    """The scalar type of option ``name``: int, float, str or bool (layers: list of int)."""
    annotation = FIELDS[name].type
    for kind, scalar in (("bool", bool), ("int", int), ("float", float)):
        if annotation.startswith(kind) or annotation.startswith(f"list[{kind}"):
            return scalar
    return str


def coerce_option(name: str, value, source: str):
    """``value`` from a config file as option ``name``'s type; ConfigError naming ``source`` otherwise."""
    kind = field_type(name)
    value = canonical(value, f"{source}: option {name!r}")
    if value is None:
        if FIELDS[name].default is not None:
            raise ConfigError(f"{source}: option {name!r} cannot be null")
        return None
    if name == "layers":
        values = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{source}: 'layers' must be a list of ints, got {value!r}")
        return list(values)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: option {name!r} must be true or false, got {value!r}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{source}: option {name!r} must be an int, got {value!r}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{source}: option {name!r} must be a number, got {value!r}")
        try:
            return float(value)  # YAML reads 5e-4 (no dot) as a string
        except ValueError:
            raise ConfigError(f"{source}: option {name!r} must be a number, got {value!r}") from None
    if kind is str and not isinstance(value, str):
        raise ConfigError(f"{source}: option {name!r} must be a string, got {value!r}")
    return value


def parse_config_file(path: Path):
    """The parsed contents of a YAML (or, by suffix, JSON) config file; ConfigError if unreadable."""
    text = path.read_text()
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--config {str(path)!r} is not valid JSON: {err}") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {str(path)!r} is not valid YAML: {str(err).splitlines()[0]}") from None


def read_config_file(path: str | Path, command: str) -> dict:
    """Options from a YAML or JSON file whose keys are the option names (``output-dir`` or ``output_dir``).

    Keys of options that ``command`` does not take are skipped (one file can serve every command);
    unknown keys raise ConfigError.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    raw = parse_config_file(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(path)!r} must hold a mapping of option names to values")
    options = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"--config {str(path)!r}: unknown option {key!r}")
        if command in FIELDS[name].metadata["commands"]:
            options[name] = coerce_option(name, value, f"--config {str(path)!r}")
    return options


def build_config(command: str, file_options: dict, cli_options: dict) -> RunConfig:
    """Defaults < preset (from file or flags) < file options < command-line options, validated."""
    preset = cli_options.get("preset", file_options.get("preset"))
    options = {}
    if preset == "tiny":
        options.update({k: v for k, v in TINY_PRESET.items() if command in FIELDS[k].metadata["commands"]})
    elif preset is not None:
        raise ConfigError(f"--preset must be one of {PRESETS}, got {preset!r}")
    options.update(file_options)
    options.update(cli_options)
    config = RunConfig(**{name: canonical(value, f"--{name.replace('_', '-')}") for name, value in options.items()})
    validate(config, command)
    return config


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"--{name.replace('_', '-')} must be one of {', '.join(choices)}; got {value!r}")


def _check_positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"--{name.replace('_', '-')} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_path(name: str, value, kind: str = "any") -> None:
    if value is None:
        return
    path = Path(value)
    exists = path.is_dir() if kind == "dir" else path.exists()
    if not exists:
        what = "directory" if kind == "dir" else "path"
        raise ConfigError(f"--{name.replace('_', '-')}: no such {what} {value!r}")


def validate(config: RunConfig, command: str) -> None:
    """Raise ConfigError for a bad value, a missing path, or an option missing for ``command``."""
    if config.output_dir is None:
        raise ConfigError("--output-dir is required")
    for name, spec in FIELDS.items():
        if spec.metadata["choices"] and getattr(config, name) is not None:
            _check_choice(name, getattr(config, name), spec.metadata["choices"])
    for name in ("n_keys", "heads", "topk", "key_dim", "rows_per_step", "lora_r", "lora_alpha", "n_examples",
                 "n_background", "max_length", "epochs", "lr", "global_batch_size", "micro_batch_size",
                 "max_grad_norm", "save_every", "max_steps"):
        _check_positive(name, getattr(config, name))
    for name in ("weight_decay", "warmup_steps", "lora_dropout", "alpha_init"):
        _check_positive(name, getattr(config, name), allow_zero=True)
    if config.topk > config.n_keys:
        raise ConfigError(f"--topk {config.topk} must be <= --n-keys {config.n_keys}")
    if config.key_dim % 2:
        raise ConfigError(f"--key-dim must be even (it is split into two halves), got {config.key_dim}")
    check_layers(config.layers, argument="--layers")
    if config.global_batch_size % config.micro_batch_size:
        raise ConfigError(f"--global-batch-size {config.global_batch_size} is not a multiple of "
                          f"--micro-batch-size {config.micro_batch_size}")
    for name in ("oasst_path", "medmcqa_path", "background"):
        _check_path(name, getattr(config, name))
    _check_path("adapter", config.adapter, "dir")
    if config.model != TINY_MODEL and (config.model.startswith((".", "/", "~")) or Path(config.model).exists()):
        _check_path("model", config.model, "dir")
    needs_adapter = command == "background" or (command == "train" and config.recipe == "sparse")
    if needs_adapter and config.adapter is None:
        raise ConfigError(f"--adapter (the retrofit run directory) is required for "
                          f"{'background' if command == 'background' else '--recipe sparse'}")
    if command == "train" and config.recipe == "sparse" and config.background is None:
        raise ConfigError("--background (file from `smf background`) is required for --recipe sparse")
