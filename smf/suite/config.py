"""The experiment-suite configuration: which model, data, seeds and conditions, the training options
of each stage, and the evaluation sizes. Read from YAML (or JSON); every key is checked.

Schema (keys may be spelled with ``-`` or ``_``)::

    name: tiny                       # label used in logs and the report
    model: tiny                      # hub id, local save_pretrained directory, or 'tiny'
    output_dir: runs/suite-tiny      # the suite directory
    seeds: [0, 1]
    conditions: [base, replacement-kl, ...]   # default: all nine of Table 1
    authors_update: [additive-kl]    # sparse conditions also run with the authors' update (the ablation
                                     # table of `smf report`); default none
    device: auto                     # torch device for training and evaluation
    protocol: authors                # data and eval protocol (smf/data/protocol.py): authors (default) | clean
    data:                            # local copies in the hub schema; null or absent = the hub
      oasst: ...                     # oasst1 train (retrofit + background)
      medmcqa_train: ...
      medmcqa_validation: ...
      wikitext: ...                  # wikitext-103-v1 test (protocol authors) or -raw-v1 (clean)
      triviaqa: ...                  # trivia_qa rc.nocontext validation
    train: {...}                     # options of smf retrofit/background/train shared by every stage
    stages:                          # per-stage overrides of ``train``
      retrofit: {...}
      background: {...}
      sparse: {...}
      lora: {...}
      full: {...}
    eval: {...}                      # see EvalSettings

Relative paths: ``data`` paths and a local ``model`` directory resolve against the folder of
the config file (so a config and its data can move together, and shipped configs work from any
working directory); ``output_dir`` resolves against the current working directory, like any
output flag. ``model`` counts as a local path only when it starts with ``.``, ``/`` or ``~``.

Options the suite sets itself per run (seed, mode, rule, recipe, output/adapter/background
directories, resume, model, device, protocol, data paths) may not appear in ``train`` or ``stages``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.vocabulary import CONDITIONS, SPARSE_CONDITIONS, TASKS
from smf.errors import ConfigError
from smf.train.config import FIELDS, build_config
from smf.train.config import coerce_option, parse_config_file

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SHIPPED_PREFIX = "suite_"

STAGES = ("retrofit", "background", "sparse", "lora", "full")
STAGE_COMMANDS = {"retrofit": "retrofit", "background": "background", "sparse": "train", "lora": "train",
                  "full": "train"}
DATA_KEYS = ("oasst", "medmcqa_train", "medmcqa_validation", "wikitext", "triviaqa")
TOP_KEYS = ("name", "model", "output_dir", "seeds", "conditions", "authors_update", "device", "protocol", "data",
            "train", "stages", "eval")
# RunConfig options the suite fills in per run; a config may not set them.
SUITE_OWNED = ("output_dir", "adapter", "background", "recipe", "mode", "rule", "seed", "resume", "max_steps",
               "model", "device", "protocol", "oasst_path", "medmcqa_path")
TRAIN_KEYS = tuple(name for name in FIELDS if name not in SUITE_OWNED)


@dataclass(frozen=True)
class EvalSettings:
    """How each evaluation runs (SPEC §6); the defaults are the paper's."""

    tasks: tuple[str, ...] = TASKS
    medmcqa_examples: int = 1000  # first N single-answer validation questions
    triviaqa_examples: int = 1000  # first N validation questions
    wikitext_window: int = 1024
    wikitext_stride: int = 512
    triviaqa_max_new_tokens: int = 32
    medmcqa_questions_per_batch: int = 8
    wikitext_windows_per_batch: int = 8
    triviaqa_batch_size: int = 32


EVAL_KEYS = tuple(f.name for f in dataclasses.fields(EvalSettings))


@dataclass(frozen=True)
class DataPaths:
    """Local dataset files (absolute), or None for the public hub dataset."""

    oasst: str | None = None
    medmcqa_train: str | None = None
    medmcqa_validation: str | None = None
    wikitext: str | None = None
    triviaqa: str | None = None


@dataclass(frozen=True)
class SuiteConfig:
    """A validated suite configuration (paths absolute; see the module docstring)."""

    name: str
    model: str
    output_dir: Path
    seeds: tuple[int, ...]
    conditions: tuple[str, ...]
    authors_update: tuple[str, ...] = ()
    device: str = "auto"
    protocol: str = DEFAULT_PROTOCOL
    data: DataPaths = field(default_factory=DataPaths)
    train: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)
    eval: EvalSettings = field(default_factory=EvalSettings)

    def to_dict(self) -> dict:
        """JSON-ready form; :func:`suite_config_from_dict` reads it back."""
        return {"name": self.name, "model": self.model, "output_dir": str(self.output_dir),
                "seeds": list(self.seeds), "conditions": list(self.conditions),
                "authors_update": list(self.authors_update), "device": self.device, "protocol": self.protocol,
                "data": dataclasses.asdict(self.data), "train": dict(self.train),
                "stages": {stage: dict(options) for stage, options in self.stages.items()},
                "eval": {**dataclasses.asdict(self.eval), "tasks": list(self.eval.tasks)}}


def _normalise_keys(mapping, where: str) -> dict:
    if mapping is None:
        return {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(mapping).__name__}")
    return {str(key).replace("-", "_"): value for key, value in mapping.items()}


def _check_keys(mapping: dict, valid, where: str) -> None:
    for key in mapping:
        if key not in valid:
            if key in SUITE_OWNED and where.startswith(("train", "stages")):
                raise ConfigError(f"{where}: option {key!r} is set by the suite for each run (seeds, conditions, "
                                  f"model, device and data are top-level keys); valid options here: "
                                  f"{', '.join(valid)}")
            if key in TRAIN_KEYS and where.startswith("stages."):
                raise ConfigError(f"{where}: option {key!r} does not apply to this stage; valid keys: "
                                  f"{', '.join(valid)}")
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {', '.join(valid)}")


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a positive int, got {value!r}")
    return value


def _resolve_input_path(value, base_dir: Path, where: str, check: bool) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a path string or null (the hub), got {value!r}")
    path = (base_dir / Path(value).expanduser()).resolve()
    if check and not path.exists():
        raise ConfigError(f"{where}: no such file or directory {str(path)!r}")
    return str(path)


def _parse_seeds(value) -> tuple[int, ...]:
    seeds = value if isinstance(value, (list, tuple)) else [value]
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be a non-empty list of distinct non-negative ints, got {value!r}")
    return tuple(seeds)


def _parse_conditions(value) -> tuple[str, ...]:
    conditions = value if isinstance(value, (list, tuple)) else [value]
    for condition in conditions:
        if condition not in CONDITIONS:
            raise ConfigError(f"unknown condition {condition!r}; valid conditions: {', '.join(CONDITIONS)}")
    if not conditions or len(set(conditions)) != len(conditions):
        raise ConfigError(f"conditions must be a non-empty list of distinct conditions, got {value!r}")
    return tuple(c for c in CONDITIONS if c in conditions)  # the paper's order


def _parse_authors_update(value, conditions: tuple[str, ...]) -> tuple[str, ...]:
    chosen = value if isinstance(value, (list, tuple)) else [value]
    sparse = [c for c in conditions if c in SPARSE_CONDITIONS]
    for condition in chosen:
        if condition not in sparse:
            raise ConfigError(f"authors_update: {condition!r} is not a sparse condition of this suite; choose from "
                              f"{', '.join(sparse) or '(none: add a sparse condition to conditions)'}")
    if len(set(chosen)) != len(chosen):
        raise ConfigError(f"authors_update must list distinct conditions, got {value!r}")
    return tuple(c for c in conditions if c in chosen)


def _parse_train_options(raw, where: str, valid) -> dict:
    options = _normalise_keys(raw, where)
    _check_keys(options, valid, where)
    return {name: coerce_option(name, value, where) for name, value in options.items()}


def _parse_eval(raw) -> EvalSettings:
    options = _normalise_keys(raw, "eval")
    _check_keys(options, EVAL_KEYS, "eval")
    if "tasks" in options:
        tasks = options["tasks"]
        tasks = tasks.split(",") if isinstance(tasks, str) else tasks
        if not isinstance(tasks, (list, tuple)) or not tasks or any(t not in TASKS for t in tasks):
            raise ConfigError(f"eval.tasks must be a non-empty list drawn from {', '.join(TASKS)}; got {tasks!r}")
        options["tasks"] = tuple(t for t in TASKS if t in tasks)
    for name, value in options.items():
        if name != "tasks":
            options[name] = _positive_int(value, f"eval.{name}")
    settings = EvalSettings(**options)
    if not settings.wikitext_stride < settings.wikitext_window:
        raise ConfigError(f"eval.wikitext_stride ({settings.wikitext_stride}) must be smaller than "
                          f"eval.wikitext_window ({settings.wikitext_window})")
    return settings


def _stage_keys(stage: str) -> tuple[str, ...]:
    return tuple(name for name in TRAIN_KEYS if STAGE_COMMANDS[stage] in FIELDS[name].metadata["commands"])


def _check_stage_values(config: SuiteConfig) -> None:
    """Run the trainer's value checks on every stage's options now, not hours into the suite."""
    for stage in STAGES:
        options = {**config.train, **config.stages.get(stage, {})}
        # The retrofit command's checks need no adapter: values, choices, batch sizes, paths.
        build_config("retrofit", options, {"output_dir": str(config.output_dir)})


def _resolve_model(value, base_dir: Path, check: bool) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"model must be a hub id, a local directory or 'tiny', got {value!r}")
    if value.startswith((".", "/", "~")):
        path = (base_dir / Path(value).expanduser()).resolve()
        if check and not path.is_dir():
            raise ConfigError(f"model: no such directory {str(path)!r}")
        return str(path)
    return value


def parse_suite_config(raw, base_dir: Path, *, source: str = "config", check_paths: bool = True) -> SuiteConfig:
    """Validate a config mapping (see the module docstring); relative input paths resolve against
    ``base_dir``. ``check_paths=False`` skips the checks that need the data and model on disk."""
    raw = _normalise_keys(raw, source)
    _check_keys(raw, TOP_KEYS, source)
    for key in ("model", "output_dir", "seeds"):
        if raw.get(key) is None:
            raise ConfigError(f"{source}: key {key!r} is required")
    data = _normalise_keys(raw.get("data"), "data")
    _check_keys(data, DATA_KEYS, "data")
    stages = _normalise_keys(raw.get("stages"), "stages")
    _check_keys(stages, STAGES, "stages")
    device = raw.get("device", "auto")
    if not isinstance(device, str):
        raise ConfigError(f"device must be a string such as auto, cpu or cuda, got {device!r}")
    conditions = _parse_conditions(raw.get("conditions", list(CONDITIONS)))
    protocol = raw.get("protocol", DEFAULT_PROTOCOL)
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{source}: protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    config = SuiteConfig(
        name=str(raw.get("name", Path(source).stem)),
        model=_resolve_model(raw["model"], base_dir, check_paths),
        output_dir=Path(str(raw["output_dir"])).expanduser().resolve(),
        seeds=_parse_seeds(raw["seeds"]),
        conditions=conditions,
        authors_update=_parse_authors_update(raw.get("authors_update", []), conditions),
        device=device,
        protocol=protocol,
        data=DataPaths(**{key: _resolve_input_path(value, base_dir, f"data.{key}", check_paths)
                          for key, value in data.items()}),
        train=_parse_train_options(raw.get("train"), "train", TRAIN_KEYS),
        stages={stage: _parse_train_options(options, f"stages.{stage}", _stage_keys(stage))
                for stage, options in stages.items()},
        eval=_parse_eval(raw.get("eval")),
    )
    if check_paths:
        _check_stage_values(config)
    return config


def resolve_config_path(name_or_path: str) -> Path:
    """A config file path, or the name of a shipped one: ``tiny`` -> ``smf/configs/suite_tiny.yaml``."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path.resolve()
    shipped = CONFIG_DIR / f"{SHIPPED_PREFIX}{name_or_path}.yaml"
    if "/" not in name_or_path and shipped.is_file():
        return shipped
    names = sorted(p.stem[len(SHIPPED_PREFIX):] for p in CONFIG_DIR.glob(f"{SHIPPED_PREFIX}*.yaml"))
    raise ConfigError(f"--config {name_or_path!r}: no such file, nor a shipped suite config "
                      f"(shipped: {', '.join(names)})")


def load_suite_config(name_or_path: str, overrides: dict | None = None) -> SuiteConfig:
    """Read and validate a suite config file (or shipped name); ``overrides`` replace top-level keys
    (e.g. from command-line flags) before validation."""
    path = resolve_config_path(name_or_path)
    raw = parse_config_file(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(path)!r} must hold a mapping of suite keys ({', '.join(TOP_KEYS)})")
    raw = {**_normalise_keys(raw, str(path)), **(overrides or {})}
    return parse_suite_config(raw, path.parent, source=str(path))


def suite_config_from_dict(saved: dict) -> SuiteConfig:
    """Read back :meth:`SuiteConfig.to_dict` (paths in it are already absolute and need not exist
    here: a suite directory copied to another machine can still be reported)."""
    return parse_suite_config(saved, Path("/"), source="suite_config.json", check_paths=False)
