"""The experiment-suite configuration, read from YAML (or JSON; keys with ``-`` or ``_``); every key is checked.
The keys are the fields of :class:`SuiteConfig`; ``smf/configs/suite_paper.yaml`` sets every one.

Relative paths: ``data`` paths and a local ``model`` directory resolve against the folder of the config file (so a
config and its data move together); ``output_dir`` against the working directory. ``model`` counts as a local path
only when it starts with ``.``, ``/`` or ``~``. Options the suite sets itself per run (:data:`SUITE_OWNED`) may not
appear in ``train``, ``stages`` or ``variants``.

``variants`` (name -> trainer options and ``lr_sweep``): every sparse condition runs once per variant instead of once,
with the variant's options applied after ``stages.{stage}`` to each stage that takes them, at the variant's own
learning rates (as many as every other recipe's: the equal-budget rule); :mod:`smf.suite.plan` names the runs and the
shared retrofit and background directories. A variant may give ``schedule_sweep`` (epochs -> rates) instead of
``lr_sweep``, and ``conditions`` (the sparse conditions that run it; default every sparse condition of the suite).

``schedule_sweep`` (recipe -> {epochs: rates}, instead of that recipe's ``lr_sweep``): the schedule is part of the
tuning budget; each (epochs, rate) pair is one configuration of the method, run for every seed, its epochs applied to
the training stage only (not the retrofit). Every method (a recipe, or a sparse condition in one variant) gets the same
number of configurations (epochs x rates summed): a maximum over more noisy runs is higher.

``hypotheses`` (name -> {a, b, level, threshold, statement}): contrasts registered before the runs, each "method ``a``
minus method ``b`` keeps at least ``threshold`` more (a negative threshold: less) old knowledge at learned ``level``";
evaluated by :mod:`smf.report.hypotheses` (paired 95% interval over seeds: confirmed, refuted or inconclusive); a
method is a condition, or ``condition/variant``. A side may instead be a list of methods, a factor's level in a
factorial design: per seed, the mean of those cells (its effect: the mean of a's cells minus the mean of b's), with
optional ``aliases`` (the interactions the effect is confounded with, in words). A hypothesis with
``envelope: compute`` is read on the equal-compute envelope instead of the envelope over every configuration.

``equal_compute`` (a method, as in a hypothesis): the report adds an equal-compute envelope, each method's kept value
over only its runs whose compute (CPU seconds, the shared retrofit and background included) is at most that of this
method's costliest run of the seed (:mod:`smf.report.equal_compute`)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (AfterValidator, BeforeValidator, Field, PositiveFloat, PositiveInt, TypeAdapter,
                      ValidationError, ValidationInfo, field_validator)
from pydantic_core import to_jsonable_python

from smf.data.paths import OWN_KEYS, OWN_SCHEMAS, DataPaths
from smf.report.hypotheses import side_methods
from smf.report.paper_results import METRIC_TITLES
from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.data.stream_tasks import StreamOptions
from smf.data.world import WorldOptions
from smf.errors import ConfigError
from smf.eval.settings import EvalSettings
from smf.options import (OPTIONS_CONFIG, AsList, Distinct, Seed, checked, choice_tuple, dataset_path_error, mapping,
                         read_file, takes)
from smf.train.config import (CONFIGS, OPTIONS, STAGE_COMMANDS, RunConfig, build_config, checked_options,
                              migrate_update_options)
from smf.vocabulary import CONDITIONS, SPARSE_CONDITIONS, TASKS, condition_recipe

SUITE_OWNED = ("output_dir", "adapter", "background", "recipe", "mode", "rule", "seed", "resume", "max_steps",
               "model", "device", "protocol", "oasst_path", "medmcqa_path", "retrofit_data", "background_data",
               "train_data", "threads")
TRAIN_KEYS = tuple(name for name in OPTIONS if name not in SUITE_OWNED)
# What a variant may set: the options of the sparse conditions' stages (retrofit, background, train) but the rate,
# which its lr_sweep gives.
VARIANT_KEYS = tuple(name for name in TRAIN_KEYS if name != "lr"
                     and any(name in takes(RunConfig, command) for command in ("retrofit", "background", "train")))
VARIANT_NAME = re.compile(r"[a-z0-9][a-z0-9.+_-]*")  # a piece of a run's name and directory
_RATES = TypeAdapter(tuple[PositiveFloat, ...], config=OPTIONS_CONFIG)
_SCHEDULE = TypeAdapter(dict[PositiveInt, tuple[PositiveFloat, ...]], config=OPTIONS_CONFIG)
VARIANT_SWEEPS = ("lr_sweep", "schedule_sweep")  # how a variant gives its configurations (one of them)
VARIANT_OWN_KEYS = (*VARIANT_SWEEPS, "conditions")  # a variant's keys that are not trainer options


SWEPT_RECIPES = ("sparse", "lora", "full")  # the recipes lr_sweep and schedule_sweep give rates to


def _unknown_recipe(recipe) -> str | None:
    """Why ``recipe`` is not a key of lr_sweep or schedule_sweep, or None when it is one."""
    return None if recipe in SWEPT_RECIPES else f"unknown recipe {recipe!r}; valid: {', '.join(SWEPT_RECIPES)}"


def _distinct_rates(rates) -> bool:
    """Whether ``rates`` (of lr_sweep, a schedule_sweep's epochs, a variant's sweep) are distinct positive rates,
    at least one."""
    return bool(rates) and len(set(rates)) == len(rates) and all(rate > 0 for rate in rates)


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
    # every seed gets a world and a base of its own (world and pretraining seed = the run's seed; smf.suite.science)
    base_per_seed: bool = False
    # variant name -> trainer options and lr_sweep (the rates of that variant): every sparse condition runs once
    # per variant (see the module docstring); empty: once, with lr_sweep.sparse
    variants: dict[str, dict] = field(default_factory=dict)
    # recipe (sparse, lora, full) -> learning rates, each run for every seed; the same number for every recipe the
    # conditions train; Table 1 reports each condition at the rate of its highest mean learning metric
    lr_sweep: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # learning levels at which matched_learning.md reads each method's kept old knowledge off its sweep (needs
    # lr_sweep; smf.report.matched_learning)
    matched_learning: Annotated[tuple[Annotated[float, Field(gt=0, le=1)], ...], AsList, Distinct] = ()
    threads: PositiveInt | None = None  # torch threads of the suite's process (None: 1 for a small model, else torch's)
    # sparse conditions also run with count_reads: loss (only the positions the loss scores count towards the
    # selection), beside the config's count_reads: ablation_reads.md
    count_reads_ablation: Annotated[tuple[str, ...], AsList, Distinct] = ()
    notice: str = ""  # what the numbers mean, at the top of report.md and printed after `smf suite` / `smf report`
    # a stream of tasks (smf.data.stream_tasks.StreamOptions, e.g. {tasks: 3}): the world's new people split into
    # tasks A, B, C, ... trained one after another, each stage from the previous one's result (smf.suite.stream);
    # empty: one task
    stream: dict = field(default_factory=dict)
    # recipe -> {epochs: learning rates}: the schedule as part of the tuning budget (instead of that recipe's
    # lr_sweep; the module docstring)
    schedule_sweep: dict[str, dict[PositiveInt, tuple[PositiveFloat, ...]]] = field(default_factory=dict)
    # name -> {a, b, level, threshold, statement[, envelope]}: contrasts registered before the runs (the module
    # docstring)
    hypotheses: dict[str, dict] = field(default_factory=dict)
    # a method (condition or condition/variant) whose costliest run of a seed is the budget of the equal-compute
    # envelope (the module docstring); empty: no such envelope
    equal_compute: str = ""

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
    def _sweep_rates(cls, sweep: dict, info: ValidationInfo) -> dict:
        variants = info.data.get("variants") or {}
        for recipe, rates in sweep.items():
            if _unknown_recipe(recipe):
                raise ValueError(_unknown_recipe(recipe))
            if not _distinct_rates(rates):
                raise ValueError(f"{recipe}: give distinct positive learning rates, got {list(rates)}")
        if variants and "sparse" in sweep:
            raise ValueError("sparse: not used with variants (each variant runs at its own lr_sweep); remove it")
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

    @property
    def swept(self) -> bool:
        """Whether runs carry learning rates of a sweep (``lr_sweep``, ``schedule_sweep`` or ``variants``): the report
        then gives each method at its chosen rate, with 95% intervals."""
        return bool(self.lr_sweep or self.variants or self.schedule_sweep)

    def variant_options(self, variant: str | None) -> dict:
        """The trainer options ``variant`` sets (its sweep and conditions left out); none for None."""
        return {} if variant is None else {k: v for k, v in self.variants[variant].items()
                                           if k not in VARIANT_OWN_KEYS}

    def variant_runs(self, variant: str, condition: str) -> bool:
        """Whether the sparse ``condition`` runs in ``variant`` (the variant's ``conditions``, default all)."""
        return condition in self.variants[variant].get("conditions", (condition,))

    def configurations(self, recipe: str | None, variant: str | None = None) -> list[tuple[int | None, float]]:
        """(epochs, learning rate) of every configuration a method sweeps: ``recipe``'s (or ``variant``'s)
        ``schedule_sweep`` pairs, else its ``lr_sweep`` rates at epochs None (the stage's configured epochs);
        empty without a sweep."""
        source = self.variants[variant] if variant is not None else {
            "lr_sweep": self.lr_sweep.get(recipe), "schedule_sweep": self.schedule_sweep.get(recipe)}
        if source.get("schedule_sweep"):
            return [(int(epochs), lr) for epochs, rates in source["schedule_sweep"].items() for lr in rates]
        return [(None, lr) for lr in source.get("lr_sweep") or ()]

    def to_dict(self) -> dict:
        """JSON-ready form; :func:`suite_config_from_dict` reads it back. Without a stream (or ``equal_compute``), no
        such key: the record of a suite written before they existed stays equal (:func:`smf.suite.fingerprints.merged_plan`)."""
        saved = to_jsonable_python(self)
        for key in ("stream", "equal_compute"):  # absent from records written before they existed
            if not saved[key]:
                del saved[key]
        return saved


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


def _variants(raw) -> dict[str, dict]:
    """The ``variants`` mapping: name -> its trainer options (checked like ``train``'s, :data:`VARIANT_KEYS`) and
    ``lr_sweep`` (required: distinct positive rates)."""
    if not isinstance(raw, dict | None):
        raise ConfigError(f"variants must be a mapping of variant name -> options, got {type(raw).__name__}")
    variants = {}
    for name, options in (raw or {}).items():  # names kept as given (mapping() would read their - as _)
        where = f"variants.{name}"
        if not isinstance(name, str) or not VARIANT_NAME.fullmatch(name):
            raise ConfigError(f"{where}: a variant's name is part of its runs' names: lower-case letters, digits and "
                              ". + _ - (starting with a letter or digit)")
        options = mapping(options, where)
        own = {key: options.pop(key) for key in VARIANT_OWN_KEYS if key in options}
        if not any(key in own for key in VARIANT_SWEEPS):
            raise ConfigError(f"{where}.lr_sweep is required (or schedule_sweep: epochs -> rates): each variant runs "
                              "at its own learning rates")
        if all(key in own for key in VARIANT_SWEEPS):
            raise ConfigError(f"{where}: give lr_sweep or schedule_sweep, not both")
        sweep_key = next(key for key in VARIANT_SWEEPS if key in own)
        try:
            sweep = (_RATES if sweep_key == "lr_sweep" else _SCHEDULE).validate_python(
                {str(k): v for k, v in own[sweep_key].items()} if isinstance(own[sweep_key], dict) else own[sweep_key])
        except ValidationError as err:
            raise ConfigError(f"{where}.{sweep_key}: give positive finite learning rates"
                              f"{'' if sweep_key == 'lr_sweep' else ' per positive number of epochs'} "
                              f"({err.errors()[0]['msg']})") from None
        if not sweep or not all(map(_distinct_rates, sweep.values() if isinstance(sweep, dict) else [sweep])):
            raise ConfigError(f"{where}.{sweep_key}: give distinct positive learning rates, got {sweep}")
        own[sweep_key] = sweep
        if "conditions" in own:
            chosen = own["conditions"]
            chosen = [chosen] if isinstance(chosen, str) else chosen
            if not isinstance(chosen, list | tuple) or not chosen or any(c not in SPARSE_CONDITIONS for c in chosen) \
                    or len(set(chosen)) != len(chosen):
                raise ConfigError(f"{where}.conditions: give distinct sparse conditions "
                                  f"({', '.join(SPARSE_CONDITIONS)}), got {own['conditions']!r}")
            own["conditions"] = tuple(chosen)
        options = migrate_update_options(options, where)
        for key in options:
            if key not in VARIANT_KEYS:
                why = "is set by the suite for each run" if key in SUITE_OWNED else \
                    "comes from the variant's lr_sweep" if key == "lr" else \
                    "is not an option of the sparse conditions' stages" if key in OPTIONS else "is unknown"
                raise ConfigError(f"{where}: option {key!r} {why}; valid keys: {', '.join(VARIANT_OWN_KEYS)}, "
                                  f"{', '.join(VARIANT_KEYS)}")
        variants[name] = {**checked_options(options, where), **own}
    same = {}
    for name, options in variants.items():
        twins = same.setdefault(repr(sorted((k, v) for k, v in options.items() if k not in VARIANT_OWN_KEYS)), [])
        for twin in twins:  # the same options: a second grid of one method, so no configuration may be in both
            common = _common_configurations(options, variants[twin])
            if common:
                raise ConfigError(f"variants.{name}: the same options as variants.{twin} and a configuration in "
                                  f"common with it (epochs, lr) {common[0]}; give each variant its own options or "
                                  "its own configurations")
        twins.append(name)
    return variants


def _common_configurations(a: dict, b: dict) -> list[tuple[int | None, float]]:
    """(epochs, lr) of checked variant ``a``'s configurations that variant ``b`` runs too; an ``lr_sweep`` rate
    (epochs None: the stage's) counts as at every schedule."""
    def grid(variant):
        if "schedule_sweep" in variant:
            return [(epochs, lr) for epochs, rates in variant["schedule_sweep"].items() for lr in rates]
        return [(None, lr) for lr in variant["lr_sweep"]]
    theirs = grid(b)
    return [(epochs, lr) for epochs, lr in grid(a)
            if any(lr == other_lr and (epochs == other_epochs or None in (epochs, other_epochs))
                   for other_epochs, other_lr in theirs)]


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
    roles = [key.removeprefix("eval_") for key in ("eval_learn", "eval_heldout", "eval_retain", "eval_retain_heldout")
             if data.get(key)]
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
    if data.background is not None and not sparse and not config.world:  # a world writes every role
        raise ConfigError("data.background is not used: no sparse condition computes background statistics")


WORLD_ROLES = ("retrofit", "background", "train", "eval_learn", "eval_heldout", "eval_retain")


def base_root(output_dir: Path, seed: int | None) -> Path:
    """Where the world and the base of ``seed`` live (``seed`` None: the suite's one shared world and base)."""
    return output_dir if seed is None else output_dir / "bases" / f"seed{seed}"


def science_paths(output_dir: Path, seed: int | None, world: dict | None = None) -> tuple[dict[str, str], str]:
    """(own-data role -> world file, base model directory) of ``seed``'s world (see :func:`base_root`); ``world``
    (its options) adds ``eval_retain_heldout`` where it has ``retain_heldout``."""
    root = base_root(output_dir, seed)
    roles = WORLD_ROLES + (("eval_retain_heldout",) if (world or {}).get("retain_heldout") else ())
    return ({role: str(root / "world" / f"{role}.jsonl") for role in roles},
            str(root / "pretrain" / "final"))


def seed_config(config, seed: int):
    """``config`` (a SuiteConfig) as the runs of ``seed`` see it: with ``base_per_seed``, that seed's world (data
    files and world.seed), base (model and pretrain.seed); otherwise ``config`` itself."""
    if not (config.world and config.base_per_seed):
        return config
    data, model = science_paths(config.output_dir, seed, config.world)
    return dataclasses.replace(config, data=dataclasses.replace(config.data, **data),
                               model=model if config.pretrain else config.model,
                               world={**config.world, "seed": seed},
                               pretrain={**config.pretrain, "seed": seed} if config.pretrain else {})


def pretrained_adapter(config) -> Path | None:
    """The memory adapter of a base pretrained with its memories (``pretrain.memory``): the base's own folder
    (:func:`smf.train.pretrain.save_base`), which the sparse runs finetune and the base condition, LoRA and full
    finetuning load, in place of a retrofit; None for a plain base (``config`` as :func:`seed_config` gives it)."""
    return Path(config.model) if config.pretrain and config.pretrain.get("memory") else None


def _check_pretrained_memories(raw: dict, memory) -> None:
    """ConfigError for what a base pretrained with its memories (``memory``: a PretrainMemory, or None for a plain
    base) cannot run: replacement conditions (their memory would stand in for an MLP the base pretrained with) and
    memory sizes or an ``alpha_init`` in ``train``, ``stages`` or ``variants`` other than the pretrained ones (no
    retrofit makes such memories: the runs would load the pretrained ones and ignore them)."""
    if memory is None:
        return
    conditions = raw.get("conditions")
    replaced = [c for c in (conditions if isinstance(conditions, list) else [conditions])
                if str(c).startswith("replacement")]
    if replaced:
        raise ConfigError(f"conditions {replaced}: a base pretrained with its memories (pretrain.memory) has additive "
                          "memories; drop the replacement conditions")
    sources = {"train": mapping(raw.get("train"), "train"),
               **{f"stages.{stage}": mapping(options, f"stages.{stage}")
                  for stage, options in mapping(raw.get("stages"), "stages").items()},
               **{f"variants.{name}": mapping(options, f"variants.{name}")
                  for name, options in mapping(raw.get("variants"), "variants").items()}}
    for where, train in sources.items():
        for name in ("layers", "n_keys", "heads", "topk", "key_dim", "alpha_init"):
            pretrained = getattr(memory, name)
            if name in train and (list(train[name]) if isinstance(train[name], (list, tuple)) else train[name]) != \
                    (list(pretrained) if name == "layers" else pretrained):
                raise ConfigError(f"{where}: option {name!r} is {train[name]!r} but pretrain.memory.{name} is "
                                  f"{pretrained!r}: the runs use the pretrained memories (no retrofit); make them "
                                  "equal")


def _check_own_files(config: SuiteConfig) -> None:
    """Every own-data file read and checked now, before any model loads (ConfigError naming the key, the file, the
    line and what was expected): its schema for its role, and a training file's rows (the first ``n_examples``)
    against one global batch of every stage that trains on it. A world's sets (written later) by their sizes."""
    from smf.data.own_data import load_own, one_batch_or_more  # torch: `smf suite`/`smf eval` parse without it

    trained = {condition_recipe(c) for c in config.conditions} - {None}
    stages = {"retrofit": ["retrofit"] if "sparse" in trained else [],
              "train": [stage for stage in ("sparse", "lora", "full") if stage in trained]}
    defaults = {field.name: field.default for field in dataclasses.fields(RunConfig)}
    sizes = WorldOptions.from_dict(config.world).sizes() if config.world else {}
    for key in OWN_KEYS:
        path = getattr(config.data, key)
        if path is None or (config.world and not stages.get(key)):
            continue
        if config.world:
            rows, where = range(sizes[key]), f"world: the {key} set"
        else:
            (rows, _), where = load_own(path, f"data.{key}", OWN_SCHEMAS[key]), f"data.{key} {path!r}"
        for stage in stages.get(key, ()):
            options = {**defaults, **config.train, **config.stages.get(stage, {})}
            one_batch_or_more(rows, options["n_examples"], options["global_batch_size"], where,
                              f"global_batch_size (train or stages.{stage})")


def _science_inputs(raw: dict) -> dict:
    """``raw`` with the world's files as its own data and the pretrained model as its model, when ``world`` /
    ``pretrain`` are given (the suite writes them: :mod:`smf.suite.science`; with ``base_per_seed``, those of the
    first seed); ConfigError for what they replace."""
    for key in ("world", "pretrain"):
        mapping(raw.get(key), key)  # a mapping or absent: `pretrain: 0` is refused, not read as no pretraining
    if not raw.get("world") and not raw.get("pretrain"):
        if raw.get("base_per_seed"):
            raise ConfigError("base_per_seed needs world (and pretrain): it gives every seed a world of its own")
        return raw
    from smf.train.pretrain import PretrainOptions  # torch: only for a config with a world

    if raw.get("pretrain") and not raw.get("world"):
        raise ConfigError("pretrain needs world: the model is pretrained on the world's old knowledge")
    per_seed = bool(raw.get("base_per_seed"))
    seeds = raw.get("seeds")
    first = (seeds[0] if isinstance(seeds, list) and seeds else seeds) if per_seed else None
    for key in ("world", "pretrain"):
        if per_seed and isinstance(raw.get(key), dict) and "seed" in raw[key]:
            raise ConfigError(f"base_per_seed: the {key} seed is each run's seed; remove {key}.seed")
    seeded = {"seed": first} if per_seed and isinstance(first, int) else {}
    for seed in (seeds if per_seed and isinstance(seeds, list) else [None]):  # every seed's world must build
        WorldOptions.from_dict({**mapping(raw["world"], "world"), **({"seed": seed} if isinstance(seed, int) else {})})
    root = Path(str(raw.get("output_dir", ""))).expanduser().resolve()
    data, model = science_paths(root, first if isinstance(first, int) else None, mapping(raw["world"], "world"))
    given = {key: value for key, value in mapping(raw.get("data"), "data").items() if value is not None}
    if given and given != data:  # a saved config holds the derived paths
        raise ConfigError("world and data cannot both be given: the world's files are the suite's data")
    raw = {**raw, "data": data}
    if raw.get("pretrain"):
        options = PretrainOptions.from_dict({**mapping(raw["pretrain"], "pretrain"), **seeded})
        _check_pretrained_memories(raw, options.memory)
        if raw.get("model") not in (None, model):
            raise ConfigError("pretrain and model cannot both be given: the pretrained model is the suite's model")
        raw["model"] = model
    return raw


def _stream_options(raw: dict) -> dict:
    """``stream`` checked (:class:`~smf.data.stream_tasks.StreamOptions`; empty: no stream) against the world whose
    new people it splits (ConfigError in one line)."""
    if raw.get("stream", {}) == {}:  # not `not raw["stream"]`: stream: 0 (or false) is refused, not read as none
        return {}
    options = StreamOptions.from_dict(raw["stream"])
    if not raw.get("world"):
        raise ConfigError("stream needs world: it splits the world's new people into tasks")
    n_new = WorldOptions.from_dict({key: value for key, value in mapping(raw["world"], "world").items()
                                    if key != "seed"}).n_new
    if options.tasks > n_new:
        raise ConfigError(f"stream: option 'tasks' {options.tasks} exceeds world.n_new {n_new}: every task needs at "
                          "least one new person")
    return dataclasses.asdict(options)


def _check_stream(config: SuiteConfig) -> None:
    """ConfigError unless ``config``'s stream evaluates each task (eval.tasks has learn) and its smallest task fills
    one global batch of every trained stage."""
    if not config.stream:
        return
    if "learn" not in config.eval.tasks:
        raise ConfigError(f"stream: eval.tasks {list(config.eval.tasks)} must include learn (each task's accuracy)")
    options, world = StreamOptions.from_dict(config.stream), WorldOptions.from_dict(config.world)
    rows = options.train_rows(world.n_new, world.new_kind)
    stages = sorted({condition_recipe(c) for c in config.conditions} - {None})
    for stage, variant in [(stage, None) for stage in stages] + [  # a variant's batch size too
            ("sparse", name) for name in config.variants if "sparse" in stages]:
        batch = {**config.train, **config.stages.get(stage, {}), **config.variant_options(variant)}.get(
            "global_batch_size", RunConfig.__dataclass_fields__["global_batch_size"].default)
        if rows < batch:
            raise ConfigError(f"stream: the smallest of {options.tasks} tasks has {rows} "
                              f"training rows, fewer than one global batch of {batch} "
                              f"({f'variants.{variant}' if variant else f'stages.{stage}'}); lower "
                              "stream.tasks or global_batch_size, or raise world.n_new")


def _check_schedules(config: SuiteConfig) -> None:
    """ConfigError for a ``schedule_sweep`` entry that is not a recipe with distinct positive rates per epochs, or
    one given beside its recipe's ``lr_sweep`` (or for sparse beside ``variants``)."""
    for recipe, schedule in config.schedule_sweep.items():
        where = f"schedule_sweep.{recipe}"
        if _unknown_recipe(recipe):
            raise ConfigError(f"schedule_sweep: {_unknown_recipe(recipe)}")
        if recipe in config.lr_sweep:
            raise ConfigError(f"{where} and lr_sweep.{recipe} cannot both be given: the schedule sweep gives the "
                              "rates of each epochs count")
        if recipe == "sparse" and config.variants:
            raise ConfigError(f"{where}: not used with variants (give each variant its own schedule_sweep)")
        if not schedule or not all(map(_distinct_rates, schedule.values())):
            raise ConfigError(f"{where}: give epochs -> distinct positive learning rates (e.g. {{10: [1e-3, 3e-3], "
                              f"40: [3e-4, 1e-3]}}), got {schedule}")


def _check_variant_conditions(config: SuiteConfig) -> None:
    """ConfigError for a sparse condition of the suite that runs in no variant. (A variant whose conditions the
    suite does not run, e.g. after ``--conditions``, has no runs; so have all variants of a suite narrowed to its
    baselines, ``--conditions base full``.)"""
    sparse = [c for c in config.conditions if c in SPARSE_CONDITIONS]
    if config.variants:
        idle = [c for c in sparse if not any(config.variant_runs(name, c) for name in config.variants)]
        if idle:
            raise ConfigError(f"conditions: {', '.join(idle)} run in no variant (each variant's conditions leave "
                              "them out); add them to a variant's conditions or remove them")


def _check_budget(config: SuiteConfig) -> None:
    """ConfigError unless every trained recipe of the conditions has a sweep (with any sweep or variant) and every
    method gets the same number of configurations (epochs x learning rates; the equal tuning budget)."""
    trained = sorted({condition_recipe(c) for c in config.conditions if c != "base"})
    swept = {**config.lr_sweep, **config.schedule_sweep}
    if not (swept or config.variants):
        return
    missing = [recipe for recipe in trained if recipe not in swept and not (recipe == "sparse" and config.variants)]
    if missing:
        raise ConfigError(f"lr_sweep: no learning rates for {', '.join(missing)}: every trained recipe of the "
                          "conditions gets a sweep (lr_sweep or schedule_sweep)")
    sizes = {recipe: len(config.configurations(recipe)) for recipe in trained if recipe in swept}
    if "sparse" in trained:
        sizes.update({f"variant {name}": len(config.configurations("sparse", name)) for name in config.variants})
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"lr_sweep: every recipe gets the same number of learning rates x epochs (the same tuning "
                          f"budget: a maximum over more noisy runs is higher), got {sizes}")
    if not {"learn", "medmcqa"} & set(config.eval.tasks):
        raise ConfigError(f"lr_sweep: the sweep chooses each rate by the learning metric: eval.tasks "
                          f"{list(config.eval.tasks)} must include learn (own data) or medmcqa")


def method_of(spec: str) -> tuple[str, str | None]:
    """(condition, variant or None) of a hypothesis's method ``condition`` or ``condition/variant``."""
    condition, _, variant = spec.partition("/")
    return condition, variant or None


def _given(kind: str, test):
    """A validator run before pydantic's: the value if ``test(value)``, else ValueError "give {kind}, got ..."."""
    def given(value):
        if not test(value):
            raise ValueError(f"give {kind}, got {value!r}")
        return value
    return BeforeValidator(given)


_Text = Annotated[str, _given("a non-empty string", lambda value: isinstance(value, str) and value.strip())]
_Number = Annotated[float, _given("a number", lambda value: isinstance(value, int | float)
                                  and not isinstance(value, bool))]


def _threshold(value: float) -> float:
    if not 0 < abs(value) <= 1:
        raise ValueError(f"give the smallest difference a - b that matters, nonzero and in [-1, 1] (negative: a keeps "
                         f"less), got {value!r}")
    return value


ENVELOPES = ("configurations", "compute")  # a hypothesis's envelope: over every configuration, or equal compute


def _is_side(value) -> bool:
    """A hypothesis's side: a method, or a non-empty list of distinct methods (a factor's level)."""
    methods = [value] if isinstance(value, str) else value if isinstance(value, list) and value else [None]
    return all(isinstance(method, str) and method.strip() for method in methods) and len(set(methods)) == len(methods)


_Side = Annotated[str | list[str], _given("a method, or a non-empty list of distinct methods (a factor's level: the "
                                          "mean of those cells)", _is_side)]


@dataclass(frozen=True)
class Hypothesis:
    """One of ``hypotheses``: methods ``a`` and ``b`` (a condition, or ``condition/variant``; or each a list of them,
    a factor's two levels), the matched_learning ``level`` it is read at, the difference a - b that confirms it
    (``threshold``) and the claim in words (what they name is checked against the suite: :func:`_check_hypotheses`)."""

    a: _Side
    b: _Side
    level: _Number
    threshold: Annotated[_Number, AfterValidator(_threshold)]
    statement: _Text
    envelope: Literal[ENVELOPES] = "configurations"  # which envelope it is read on (compute: needs equal_compute)
    aliases: _Text | None = None  # a factor's effect: what it is confounded with in a fractional design

    @classmethod
    def checked(cls, raw, where: str) -> dict:
        """The entry ``raw`` of ``hypotheses`` named ``where`` (``hypotheses.h``), checked: its keys in the order
        given, level and threshold as floats; a one-line ConfigError naming the key otherwise."""
        entry = mapping(raw, where, HYPOTHESIS_KEYS)
        missing = [key for key in HYPOTHESIS_KEYS if key not in entry and key not in ("envelope", "aliases")]
        if missing:
            raise ConfigError(f"{where}: {', '.join(missing)} required (a, b: methods as condition or "
                              "condition/variant; level: a matched_learning level; threshold: the difference a - b "
                              "that confirms, nonzero; statement: the claim in words; optional envelope: "
                              f"{' or '.join(ENVELOPES)}; optional aliases: a factor's confounded interactions)")
        values = dataclasses.asdict(checked(cls, entry, lambda key: f"{where}.{key}"))
        return {key: values[key] for key in entry}


HYPOTHESIS_KEYS = tuple(Hypothesis.__dataclass_fields__)


def _hypotheses(raw) -> dict[str, dict]:
    """The ``hypotheses`` mapping: name -> its :class:`Hypothesis`, as a dict (what the names name:
    :func:`_check_hypotheses`)."""
    if not isinstance(raw, dict | None):
        raise ConfigError(f"hypotheses must be a mapping of name -> hypothesis, got {type(raw).__name__}")
    hypotheses = {}
    for name, entry in (raw or {}).items():
        where = f"hypotheses.{name}"
        if not isinstance(name, str) or not VARIANT_NAME.fullmatch(name):
            raise ConfigError(f"{where}: a hypothesis's name: lower-case letters, digits and . + _ - (starting with a "
                              "letter or digit)")
        hypotheses[name] = Hypothesis.checked(entry, where)
    return hypotheses


def _check_hypotheses(config: SuiteConfig) -> None:
    """ConfigError for a hypothesis whose methods no suite of these variants runs (a method of a condition left out,
    e.g. by ``--conditions``, is evaluated as inconclusive), whose level is not a matched_learning level, or that
    compares a method with itself (with fewer than two seeds they are evaluated as inconclusive); or for an
    ``equal_compute`` that names no trained method, or a hypothesis on the compute envelope without it."""
    if not (config.hypotheses or config.equal_compute):
        return
    if not config.matched_learning:
        what = "hypotheses are evaluated" if config.hypotheses else "equal_compute is read"
        raise ConfigError(f"{what} at matched learning: give matched_learning (and a sweep) too")
    trained = [c for c in CONDITIONS if c != "base"]  # not only the suite's: --conditions may narrow it
    methods = [c for c in trained if not (c in SPARSE_CONDITIONS and config.variants)]
    methods += [f"{c}/{v}" for c in trained if c in SPARSE_CONDITIONS for v in config.variants
                if config.variant_runs(v, c)]
    if config.equal_compute and config.equal_compute not in methods:
        raise ConfigError(f"equal_compute: {config.equal_compute!r} is not a trained method of this suite; choose "
                          f"from {', '.join(methods)}")
    for name, entry in config.hypotheses.items():
        where = f"hypotheses.{name}"
        if entry.get("envelope") == "compute" and not config.equal_compute:
            raise ConfigError(f"{where}.envelope: compute needs equal_compute (the method whose costliest run is "
                              "the budget)")
        for key in ("a", "b"):
            for method in side_methods(entry[key]):
                if method not in methods:  # as written: 'additive-kl/' names no method
                    raise ConfigError(f"{where}.{key}: {method!r} is not a trained method of this suite; choose "
                                      f"from {', '.join(methods)}")
        shared = {method_of(m) for m in side_methods(entry["a"])} & {method_of(m) for m in side_methods(entry["b"])}
        if shared and isinstance(entry["a"], str) and isinstance(entry["b"], str):
            raise ConfigError(f"{where}: a and b are the same method")
        if shared:
            raise ConfigError(f"{where}: a and b both hold {'/'.join(filter(None, min(shared)))} (a factor's two "
                              "levels are disjoint sets of cells)")
        if entry["level"] not in config.matched_learning:
            raise ConfigError(f"{where}.level: {entry['level']:g} is not a matched_learning level "
                              f"({', '.join(f'{level:g}' for level in config.matched_learning)})")


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
        "variants": _variants(raw.get("variants")),
        "lr_sweep": mapping(raw.get("lr_sweep"), "lr_sweep"),
        "stream": _stream_options(raw),
        "schedule_sweep": {str(recipe): {str(epochs): rates for epochs, rates in (  # epochs as written (-1, not _1)
            schedule.items() if isinstance(schedule, dict) else mapping(schedule, f"schedule_sweep.{recipe}").items())}
            for recipe, schedule in mapping(raw.get("schedule_sweep"), "schedule_sweep").items()},
        "hypotheses": _hypotheses(raw.get("hypotheses")),
    }, str)
    _check_schedules(config)
    _check_variant_conditions(config)
    _check_budget(config)
    _check_hypotheses(config)
    if config.matched_learning and not config.swept:
        raise ConfigError("matched_learning reads each method's sweep: give lr_sweep (or variants) too")
    for stage in (*config.lr_sweep, *config.schedule_sweep, *(["sparse"] if config.variants else [])):
        if "lr" in config.stages.get(stage, {}) or "lr" in config.train:
            swept = "variants" if stage == "sparse" and config.variants else f"lr_sweep.{stage}"
            raise ConfigError(f"{swept} and an lr in train or stages.{stage} cannot both be given")
    _check_own_data(config)
    _check_stream(config)
    if check_paths and config.data.own:
        _check_own_files(config)
    if check_paths:  # the trainer's checks of combinations (batch sizes, layers, device, backend) on every stage's
        for stage, variant in [(stage, None) for stage in STAGE_COMMANDS] + [  # options now (a variant's on the
                (stage, name) for name in config.variants  # sparse stages); the retrofit command's checks need no
                for stage in ("retrofit", "background", "sparse")]:  # adapter
            options = {**config.train, **config.stages.get(stage, {}), **config.variant_options(variant)}
            try:
                build_config("retrofit", options, {"output_dir": str(config.output_dir), "device": config.device})
            except ConfigError as err:
                if variant is None:
                    raise
                raise ConfigError(f"variants.{variant}: {err}") from None
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
