"""The experiment-suite configuration, read from YAML (or JSON; keys with ``-`` or ``_``); every key is checked.
The keys are the fields of :class:`SuiteConfig`; ``smf/configs/suite_paper.yaml`` sets every one.

Relative paths: ``data`` paths and a local ``model`` directory resolve against the folder of the config file (so a
config and its data move together); ``output_dir`` against the working directory. ``model`` counts as a local path
only when it starts with ``.``, ``/`` or ``~``. Options the suite sets itself per run (:data:`SUITE_OWNED`) may not
appear in ``train`` or ``stages``."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, PositiveInt, ValidationInfo, field_validator
from pydantic_core import to_jsonable_python

from smf.data.paths import DataPaths
from smf.report.paper_results import METRIC_TITLES
from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.errors import ConfigError
from smf.eval.settings import EvalSettings
from smf.options import (OPTIONS_CONFIG, AsList, Distinct, Seed, checked, choice_tuple, dataset_path_error, mapping,
                         read_file, takes)
from smf.train.config import (CONFIGS, OPTIONS, STAGE_COMMANDS, RunConfig, build_config, checked_options,
                              migrate_update_options)
from smf.vocabulary import CONDITIONS, SPARSE_CONDITIONS, TASKS, condition_recipe

SUITE_OWNED = ("output_dir", "adapter", "background", "recipe", "mode", "rule", "seed", "resume", "max_steps",
               "model", "device", "protocol", "oasst_path", "medmcqa_path", "retrofit_data", "background_data",
               "train_data")
TRAIN_KEYS = tuple(name for name in OPTIONS if name not in SUITE_OWNED)


@dataclass(frozen=True)
class SuiteConfig:
    """A validated suite configuration (paths absolute; see the module docstring)."""

    __pydantic_config__ = OPTIONS_CONFIG

    name: str  # default: the config file's name
    model: Annotated[str, Field(min_length=1)]  # hub id, local directory or 'tiny'
    output_dir: Annotated[Path, AfterValidator(lambda path: path.expanduser().resolve())]
    seeds: Annotated[tuple[Seed, ...], AsList, Field(min_length=1), Distinct]
    conditions: choice_tuple(CONDITIONS) = CONDITIONS  # default: all nine of Table 1
    authors_update: Annotated[tuple[str, ...], AsList, Distinct] = ()  # sparse ones re-run with the authors' update
    device: str = "auto"
    protocol: Literal[PROTOCOLS] = DEFAULT_PROTOCOL  # smf/data/protocol.py
    data: DataPaths = field(default_factory=DataPaths)  # local copies of the datasets in the hub schema; null: the hub;
    # or own-data files by role (docs/own-data.md)
    train: dict = field(default_factory=dict)  # options of the trainer shared by every stage
    stages: dict = field(default_factory=dict)  # per-stage overrides of train
    eval: EvalSettings = field(default_factory=EvalSettings)
    labels: dict[str, str] = field(default_factory=dict)  # metric key -> column title in Table 1 and the figure
    # The science preset (docs/science.md): a synthetic world written to {output_dir}/world as the own data, and a
    # model pretrained on it in {output_dir}/pretrain (smf.suite.science); empty: not used.
    world: dict = field(default_factory=dict)  # smf.data.world.WorldOptions
    pretrain: dict = field(default_factory=dict)  # smf.train.pretrain.PretrainOptions
    # recipe (sparse, lora, full) -> learning rates, each run for every seed; the same number for every recipe the
    # conditions train; Table 1 reports each condition at the rate of its highest mean learning metric
    lr_sweep: dict[str, tuple[float, ...]] = field(default_factory=dict)
    threads: PositiveInt | None = None  # torch.set_num_threads for the suite's process (None: torch's default)
    # sparse conditions also run with count_reads: loss (only the positions the loss scores count towards the
    # selection), beside the config's count_reads: ablation_reads.md
    count_reads_ablation: Annotated[tuple[str, ...], AsList, Distinct] = ()
    notice: str = ""  # what the numbers mean, at the top of report.md and printed after `smf suite` / `smf report`

    @field_validator("labels")
    @classmethod
    def _known_metrics(cls, labels: dict) -> dict:
        for key, title in labels.items():
            if key not in METRIC_TITLES:
                raise ValueError(f"labels: unknown metric key {key!r}; valid keys: {', '.join(METRIC_TITLES)}")
            if not title.strip():
                raise ValueError(f"labels: the title of {key!r} is empty")
        return labels

    @field_validator("lr_sweep")
    @classmethod
    def _equal_sweeps(cls, sweep: dict, info: ValidationInfo) -> dict:
        trained = sorted({condition_recipe(c) for c in info.data.get("conditions", ()) if c != "base"})
        for recipe, rates in sweep.items():
            if recipe not in ("sparse", "lora", "full"):
                raise ValueError(f"unknown recipe {recipe!r}; valid: sparse, lora, full")
            if not rates or len(set(rates)) != len(rates) or any(not rate > 0 for rate in rates):
                raise ValueError(f"{recipe}: give distinct positive learning rates, got {list(rates)}")
        if sweep:
            missing = [recipe for recipe in trained if recipe not in sweep]
            if missing:
                raise ValueError(f"no learning rates for {', '.join(missing)}: every trained recipe of the conditions "
                                 "gets a sweep")
            sizes = {recipe: len(sweep[recipe]) for recipe in trained}
            if len(set(sizes.values())) > 1:
                raise ValueError(f"every recipe gets the same number of learning rates (the same tuning budget), "
                                 f"got {sizes}")
        return sweep

    @field_validator("authors_update", "count_reads_ablation")
    @classmethod
    def _sparse_conditions_of_the_suite(cls, chosen: tuple, info: ValidationInfo) -> tuple:
        sparse = [c for c in info.data.get("conditions", ()) if c in SPARSE_CONDITIONS]
        for condition in chosen:
            if condition not in sparse:
                raise ValueError(f"{condition!r} is not a sparse condition of this suite; choose from "
                                 f"{', '.join(sparse) or '(none: add a sparse condition to conditions)'}")
        return tuple(c for c in sparse if c in chosen)

    def to_dict(self) -> dict:
        """JSON-ready form; :func:`suite_config_from_dict` reads it back."""
        return to_jsonable_python(self)


def _train_options(raw, where: str, stage: str | None = None) -> dict:
    """The trainer options in ``train`` (``stage`` None) or ``stages.{stage}``, checked and coerced."""
    valid = [name for name in TRAIN_KEYS if stage is None or name in takes(RunConfig, STAGE_COMMANDS[stage])]
    options = migrate_update_options(mapping(raw, where), where)
    for key in options:
        if key not in valid:
            why = ("is set by the suite for each run (seeds, conditions, model, device and data are top-level keys)"
                   if key in SUITE_OWNED else "does not apply to this stage")
            known = f"option {key!r} {why}" if key in OPTIONS else f"unknown key {key!r}"
            raise ConfigError(f"{where}: {known}; valid keys: {', '.join(valid)}")
    return checked_options(options, where)


def _input_path(value, base_dir: Path, where: str, check_exists: bool, kind: str = "dataset"):
    """``value`` resolved against ``base_dir``; with ``check_exists``, a ``kind`` ("dataset": a file or directory
    that smf.data.load_split reads; "directory") that is there, else ConfigError naming ``where``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a path string or null (the hub), got {value!r}")
    path = (base_dir / Path(value).expanduser()).resolve()
    if check_exists and kind == "directory" and not path.is_dir():
        raise ConfigError(f"{where}: no such {kind} {str(path)!r}")
    if check_exists and kind == "dataset" and dataset_path_error(str(path)) is not None:
        raise ConfigError(f"{where}: {dataset_path_error(str(path))}")
    return str(path)


def _eval_settings(raw: dict) -> dict:
    """The ``eval`` mapping; with own data and no ``tasks`` given, the roles with a file (docs/own-data.md)."""
    settings = mapping(raw.get("eval"), "eval", EvalSettings.__dataclass_fields__)
    data = mapping(raw.get("data"), "data")
    roles = [key.removeprefix("eval_") for key in ("eval_learn", "eval_heldout", "eval_retain") if data.get(key)]
    if "tasks" not in settings and roles:
        settings["tasks"] = roles
    return settings


def _check_own_data(config: SuiteConfig) -> None:
    """ConfigError where own data lacks a file a planned stage or evaluation needs, or paper tasks meet own data."""
    data = config.data
    if not data.own:
        roles = [task for task in config.eval.tasks if task not in TASKS]
        if roles:
            raise ConfigError(f"eval.tasks {roles} are own-data roles: give data.eval_{roles[0]} (docs/own-data.md)")
        return
    if not data.eval_roles:
        raise ConfigError("data: own data needs at least one evaluation file (eval_learn, eval_heldout, eval_retain)")
    missing = [task for task in config.eval.tasks if task in TASKS or task not in data.eval_roles]
    if missing:
        raise ConfigError(f"eval.tasks {missing}: own data is evaluated by the roles given "
                          f"({', '.join(data.eval_roles)})")
    trained = [c for c in config.conditions if c != "base"]
    if trained and data.train is None:
        raise ConfigError(f"data.train is required: conditions {trained} finetune on it")
    sparse = [c for c in config.conditions if c in SPARSE_CONDITIONS]
    if sparse and data.retrofit is None:
        raise ConfigError(f"data.retrofit is required: conditions {sparse} retrofit memories on it")
    if data.background is not None and not sparse:
        raise ConfigError("data.background is not used: no sparse condition computes background statistics")


def _science_inputs(raw: dict) -> dict:
    """``raw`` with the world's files as its own data and the pretrained model as its model, when ``world`` /
    ``pretrain`` are given (the suite writes them: :mod:`smf.suite.science`); ConfigError for what they replace."""
    if not raw.get("world") and not raw.get("pretrain"):
        return raw
    from smf.data.world import WorldOptions
    from smf.train.pretrain import PretrainOptions

    if raw.get("pretrain") and not raw.get("world"):
        raise ConfigError("pretrain needs world: the model is pretrained on the world's old knowledge")
    WorldOptions.from_dict(mapping(raw["world"], "world"))
    root = Path(str(raw.get("output_dir", ""))).expanduser().resolve()
    data = {role: str(root / "world" / f"{role}.jsonl") for role in
            ("retrofit", "background", "train", "eval_learn", "eval_heldout", "eval_retain")}
    given = {key: value for key, value in mapping(raw.get("data"), "data").items() if value is not None}
    if given and given != data:  # a saved config holds the derived paths
        raise ConfigError("world and data cannot both be given: the world's files are the suite's data")
    raw = {**raw, "data": data}
    if raw.get("pretrain"):
        PretrainOptions.from_dict(mapping(raw["pretrain"], "pretrain"))
        model = str(root / "pretrain" / "final")
        if raw.get("model") not in (None, model):
            raise ConfigError("pretrain and model cannot both be given: the pretrained model is the suite's model")
        raw["model"] = model
    return raw


def parse_suite_config(raw, base_dir: Path, *, source: str = "config", check_paths: bool = True) -> SuiteConfig:
    """Validate a config mapping (see the module docstring); relative input paths resolve against
    ``base_dir``. ``check_paths=False`` skips the checks that need the data and model on disk."""
    raw = mapping(raw, source, SuiteConfig.__dataclass_fields__)
    raw = {key: value for key, value in raw.items() if value is not None}
    raw = _science_inputs(raw)
    if isinstance(raw.get("model"), str) and raw["model"].startswith((".", "/", "~")) \
            and not raw.get("pretrain"):  # a local model (a pretrained one is written by the suite)
        raw["model"] = _input_path(raw["model"], base_dir, "model", check_paths, "directory")
    config = checked(SuiteConfig, {
        "name": Path(source).stem, **raw,
        "data": {key: value if raw.get("world") else _input_path(value, base_dir, f"data.{key}", check_paths)
                 for key, value in mapping(raw.get("data"), "data", DataPaths.__dataclass_fields__).items()},
        "train": _train_options(raw.get("train"), "train"),
        "stages": {stage: _train_options(options, f"stages.{stage}", stage)
                   for stage, options in mapping(raw.get("stages"), "stages", STAGE_COMMANDS).items()},
        "eval": _eval_settings(raw),
        "labels": mapping(raw.get("labels"), "labels"),
        "lr_sweep": mapping(raw.get("lr_sweep"), "lr_sweep"),
    }, str)
    for stage in config.lr_sweep:
        if "lr" in config.stages.get(stage, {}) or "lr" in config.train:
            raise ConfigError(f"lr_sweep.{stage} and an lr in train or stages.{stage} cannot both be given")
    _check_own_data(config)
    if check_paths:  # the trainer's checks of combinations (batch sizes, layers, device, backend) on every stage's
        for stage in STAGE_COMMANDS:  # options now; the retrofit command's checks need no adapter
            options = {**config.train, **config.stages.get(stage, {})}
            build_config("retrofit", options, {"output_dir": str(config.output_dir), "device": config.device})
            if config.protocol == "authors" and options.get("oasst_languages", "en") != "en":
                raise ConfigError(f"oasst_languages {options['oasst_languages']!r} is not used under protocol authors "
                                  "(it takes the English replies, as the authors' code does); use protocol clean")
    return config


def suite_config_path(name_or_path: str) -> Path:
    """The suite config file ``name_or_path`` names: a file, or a shipped config by name (``tiny``:
    ``smf/configs/suite_tiny.yaml``); ConfigError if neither."""
    path = Path(name_or_path).expanduser().resolve()
    if not path.is_file():
        path = CONFIGS / f"suite_{name_or_path}.yaml"
        if "/" in name_or_path or not path.is_file():
            names = sorted(p.stem.removeprefix("suite_") for p in CONFIGS.glob("suite_*.yaml"))
            raise ConfigError(f"--config {name_or_path!r}: no such file, nor a shipped suite config "
                              f"(shipped: {', '.join(names)})")
    return path


def read_suite_file(name_or_path: str) -> dict:
    """The top-level keys of a suite config file (see :func:`suite_config_path`), not yet validated."""
    return read_file(suite_config_path(name_or_path))


def load_suite_config(name_or_path: str, overrides: dict | None = None) -> SuiteConfig:
    """Read and validate a suite config file, or a shipped one by name (:func:`suite_config_path`);
    ``overrides`` replace top-level keys (e.g. from command-line flags) before validation."""
    path = suite_config_path(name_or_path)
    return parse_suite_config({**read_file(path), **(overrides or {})}, path.parent, source=str(path))


def suite_config_from_dict(saved: dict) -> SuiteConfig:
    """Read back :meth:`SuiteConfig.to_dict` (paths in it are already absolute and need not exist
    here: a suite directory copied to another machine can still be reported)."""
    return parse_suite_config(saved, Path("/"), source="suite_config.json", check_paths=False)
