"""What a suite runs: one run per (condition, seed), the training stages each needs, where each
stage writes, and the fingerprints that tell whether something on disk came from this config.

Directory layout of a suite (``output_dir``)::

    suite_config.json                      the resolved config of the last `smf suite`
    hypotheses_registered.json             the config's hypotheses, when and after how many runs they were recorded
    retrofit/{mode}{tag}-seed{s}/          stage 1, shared by both selection rules of a mode and seed
    background/{mode}{tag}-seed{s}/        background statistics of that retrofit
    train/{run name}/                      stage 2 (sparse), or the LoRA / full-finetune baseline
    eval/{run name}/{task}.jsonl           per-example evaluation output
    results/{run name}.json                one finished run (written last, atomically)

A run's name is ``{condition}[-{variant}][-authors-update][-loss-reads][-ep{epochs}][-lr{rate}]-seed{s}``
(``additive-tfidf-s1024-t16-sgd-lr0.1-seed0``); ``-ep{epochs}`` marks a configuration of a ``schedule_sweep`` whose
epochs differ from the training stage's configured ones (at the configured epochs a run keeps the name, and the
hash, it had before schedule sweeps existed). ``{tag}`` is empty without ``variants``; with them, it names the
options of the run's variant that change the stage (:func:`stage_tag`: ``retrofit/additive-nkeys128-seed0``), so
variants that retrofit alike (``rows_per_step`` or the row optimizer apart) share a retrofit and its background.

The retrofit is done once per (mode family, seed): the seed drives the fresh memories'
initialisation, so each seed of a sparse condition starts from its own retrofit. The families are
replacement and additive: additive+s starts from the additive retrofit of the same seed (as in the
paper and the authors' slurm/train_med_additive_sparse_values_scale.sh), and the KL and TF-IDF
runs of a family and seed share it and its background statistics.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path

from smf.options import only
from smf.suite.config import (STAGE_COMMANDS, SuiteConfig, pretrained_adapter, seed_config,
                              suite_config_from_dict)
from smf.train.config import RECIPE_DEFAULTS, RECORDED_ORDER, RunConfig, build_config, fingerprint_form
from smf.vocabulary import CONDITIONS, FINGERPRINT_SPELLINGS, RETROFIT_MODE, condition_recipe, split_condition

SUITE_CONFIG_FILE = "suite_config.json"
# Options that say where a stage lives and runs, whether it resumed and how often it saved, not what it computes.
IGNORED_OPTIONS = ("output_dir", "adapter", "background", "resume", "save_every", "device", "threads")


def number_label(value: float) -> str:
    """``value`` as run and stage directory names print it: ``f"{value:g}"`` (6 significant digits: ``0.02``,
    ``0.0002``, the names suites were first written under) when that reads back as ``value``, else the shortest
    decimal that does (``repr``: ``0.1000001``), so that distinct values never share a directory (a ``:g`` label
    has at most 6 significant digits, a ``repr`` one then at least 7)."""
    shown = f"{value:g}"
    return shown if float(shown) == value else repr(float(value))


@dataclass(frozen=True)
class Run:
    """One cell of Table 1: a condition (see :data:`smf.vocabulary.CONDITIONS`) trained with one seed; or,
    with ``update="authors"``, a sparse condition of the update ablation."""

    condition: str
    seed: int
    update: str = "exact"
    lr: float | None = None  # a learning rate of the suite's lr_sweep (None: the configured one)
    reads: str | None = None  # "loss": a count_reads ablation run (None: the configured count_reads)
    variant: str | None = None  # a key of the suite's variants (None: the suite has none, or not a sparse run)
    epochs: int | None = None  # epochs of a schedule_sweep configuration (None: the stage's configured epochs)

    @property
    def name(self) -> str:
        suffix = ("-authors-update" if self.update == "authors" else "") + (f"-{self.reads}-reads" if self.reads
                                                                             else "")
        suffix += "" if self.epochs is None else f"-ep{self.epochs}"
        rate = "" if self.lr is None else f"-lr{number_label(self.lr)}"
        variant = "" if self.variant is None else f"-{self.variant}"
        return f"{self.condition}{variant}{suffix}{rate}-seed{self.seed}"

    @classmethod
    def of_results(cls, record: dict) -> Run:
        """The run a results record (:meth:`smf.suite.runner.SuiteRunner.run_one`) was written for."""
        return cls(record["condition"], record["seed"], record.get("update", "exact"), record.get("lr"),
                   record.get("reads"), record.get("variant"), record.get("epochs"))

    @property
    def recipe(self) -> str | None:
        """None (base: no training), 'lora', 'full' or 'sparse'."""
        return condition_recipe(self.condition)

    @property
    def mode(self) -> str | None:
        """Memory mode of a sparse condition (replacement, additive, additive+s), else None."""
        return split_condition(self.condition)[0] if self.recipe == "sparse" else None

    @property
    def retrofit_mode(self) -> str | None:
        """Mode of the retrofit a sparse condition starts from (additive for additive+s), else None."""
        return RETROFIT_MODE.get(self.mode)

    @property
    def rule(self) -> str | None:
        """Selection rule of a sparse condition (kl, tfidf), else None."""
        return split_condition(self.condition)[1] if self.recipe == "sparse" else None


def _settings(config: SuiteConfig, condition: str) -> list[tuple[str | None, float | None, int | None]]:
    """(variant, learning rate, epochs) of every run ``condition`` makes per seed: a sparse condition once per variant
    that runs it, at the variant's configurations (with ``variants``), else at every configuration of its recipe's
    ``lr_sweep`` or ``schedule_sweep`` (rate None for base or without a sweep; epochs None at the training stage's
    configured epochs)."""
    recipe = condition_recipe(condition)
    if recipe is None:
        return [(None, None, None)]
    variants = [name for name in config.variants if config.variant_runs(name, condition)] \
        if recipe == "sparse" and config.variants else [None]
    settings = []
    for variant in variants:
        configured = {**_configured(config, recipe), **config.variant_options(variant)}.get(
            "epochs") or RECIPE_DEFAULTS[recipe]["epochs"]  # what the stage resolves to
        settings += [(variant, lr, None if epochs == configured else epochs)
                     for epochs, lr in config.configurations(recipe, variant) or [(None, None)]]
    return settings


def plan_runs(config: SuiteConfig) -> list[Run]:
    """Every run of the suite, seed by seed (a partial suite has whole seeds done first): the Table 1
    conditions (each at every configuration of its ``lr_sweep`` or ``schedule_sweep``, and a sparse one for every
    variant that runs it), then the ``authors_update`` and ``count_reads_ablation`` runs of that seed."""
    return [run for seed in config.seeds
            for run in [Run(c, seed, lr=lr, variant=v, epochs=e) for c in config.conditions
                        for v, lr, e in _settings(config, c)]
            + [Run(c, seed, "authors", lr, variant=v, epochs=e) for c in config.authors_update
               for v, lr, e in _settings(config, c)]
            + [Run(c, seed, lr=lr, reads="loss", variant=v, epochs=e) for c in config.count_reads_ablation
               for v, lr, e in _settings(config, c)]]


@dataclass(frozen=True)
class SuiteLayout:
    """Paths inside a suite directory (see the module docstring)."""

    root: Path

    @property
    def config_file(self) -> Path:
        return self.root / SUITE_CONFIG_FILE

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def hypotheses_file(self) -> Path:
        """The registration record of the suite's hypotheses (:meth:`smf.suite.runner.SuiteRunner.register_hypotheses`)."""
        return self.root / "hypotheses_registered.json"

    def retrofit_dir(self, mode: str, seed: int, tag: str = "") -> Path:
        return self.root / "retrofit" / f"{mode}{tag}-seed{seed}"

    def background_dir(self, mode: str, seed: int, tag: str = "") -> Path:
        return self.root / "background" / f"{mode}{tag}-seed{seed}"

    def train_dir(self, run: Run) -> Path:
        return self.root / "train" / run.name

    def eval_dir(self, run: Run) -> Path:
        return self.root / "eval" / run.name

    def results_path(self, run: Run) -> Path:
        return self.results_dir / f"{run.name}.json"


def stage_config(config: SuiteConfig, stage: str, seed: int, output_dir: Path, *, mode: str | None = None,
                 rule: str | None = None, adapter: Path | None = None, background: Path | None = None,
                 update: str | None = None, lr: float | None = None,
                 count_reads: str | None = None, variant: str | None = None,
                 epochs: int | None = None) -> RunConfig:
    """The resolved trainer options of one stage (retrofit, background, sparse, lora, full).

    Options: ``train`` < ``stages.{stage}`` < the options of ``variant`` (a key of ``variants``) < what the suite sets
    (model, device, data, seed, mode, rule, directories; ``update`` "authors" for the update ablation; ``lr`` a rate
    of the sweep; ``epochs`` those of a schedule_sweep configuration). The background stage also inherits ``stages.retrofit`` (its examples must be drawn exactly as the
    retrofit's were).
    """
    command = STAGE_COMMANDS[stage]
    options = {**_configured(config, stage), **config.variant_options(variant), **({} if lr is None else {"lr": lr}),
               **({} if count_reads is None else {"count_reads": count_reads}),
               **({} if epochs is None else {"epochs": epochs})}
    suite_set = {"output_dir": str(output_dir), "model": config.model, "device": config.device, "seed": seed,
                 "protocol": config.protocol,
                 "oasst_path": config.data.oasst, "medmcqa_path": config.data.medmcqa_train,
                 "retrofit_data": config.data.retrofit, "background_data": config.data.background or config.data.retrofit,
                 "train_data": config.data.train, "recipe": stage,
                 "mode": mode, "rule": rule, "update": update,
                 "adapter": None if adapter is None else str(adapter),
                 "background": None if background is None else str(background)}
    suite_set = {name: value for name, value in suite_set.items()
                 if value is not None or name in ("oasst_path", "medmcqa_path", "retrofit_data", "background_data",
                                                   "train_data")}
    run_config = build_config(command, only(RunConfig, command, options), only(RunConfig, command, suite_set))
    return run_config.resolved(stage if command == "train" else command)


def stage_settings(config: SuiteConfig, stage: str) -> RunConfig:
    """The options a retrofit, sparse, lora or full stage resolves to, without its directories (for
    reporting sizes such as ``rows_per_step``); validated like a LoRA run, which needs no adapter."""
    command = STAGE_COMMANDS[stage]
    if command not in ("retrofit", "train"):
        raise ValueError(f"stage must be one of retrofit, sparse, lora, full; got {stage!r}")
    options = only(RunConfig, command, {**config.train, **config.stages.get(stage, {})})
    given = {"output_dir": str(config.output_dir), "model": config.model, "protocol": config.protocol}
    if command == "train":
        given["recipe"] = "lora"
    return build_config(command, options, given).resolved(stage)


def _configured(config: SuiteConfig, stage: str) -> dict:
    """The options ``train`` and ``stages`` give ``stage`` (the background stage inherits ``stages.retrofit``)."""
    inherited = config.stages.get("retrofit", {}) if stage == "background" else {}
    return {**config.train, **inherited, **config.stages.get(stage, {})}


def stage_tag(config: SuiteConfig, variant: str | None, stage: str) -> str:
    """What the directory of the shared ``stage`` (retrofit, background) adds to its name for ``variant``: each
    option of the variant that this stage, or the retrofit it starts from, takes with a value other than the
    configured one (or the default), as ``-{option without underscores}{value}`` in option order
    (``-nkeys128``); empty when there is none."""
    options, changed = config.variant_options(variant), {}
    for where in ("retrofit", "background")[:("retrofit", "background").index(stage) + 1]:
        configured = _configured(config, where)
        for name, value in only(RunConfig, STAGE_COMMANDS[where], options).items():
            if value != configured.get(name, RunConfig.__dataclass_fields__[name].default):
                changed[name] = "_".join(map(str, value)) if isinstance(value, (list, tuple)) else \
                    number_label(value) if isinstance(value, float) else str(value)
    return "".join(f"-{name.replace('_', '')}{shown}" for name, shown in changed.items())


def sparse_stage_dirs(layout: SuiteLayout, run: Run, config: SuiteConfig) -> tuple[Path, Path]:
    """(retrofit directory, background directory) that the sparse ``run`` of ``config`` trains from; on a base
    pretrained with its memories, the base's own adapter (:func:`smf.suite.config.pretrained_adapter`) stands for
    the retrofit."""
    return (pretrained_adapter(config) or
            layout.retrofit_dir(run.retrofit_mode, run.seed, stage_tag(config, run.variant, "retrofit")),
            layout.background_dir(run.retrofit_mode, run.seed, stage_tag(config, run.variant, "background")))


def start_name(run: Run, config: SuiteConfig) -> str:
    """The name under which the diagnostics file the memories the sparse ``run`` starts from: its retrofit
    directory's, or ``pretrained-seed{S}`` on bases pretrained with their memories (whose folders are all ``final``)."""
    return f"pretrained-seed{run.seed}" if pretrained_adapter(config) else \
        f"{run.retrofit_mode}{stage_tag(config, run.variant, 'retrofit')}-seed{run.seed}"


def _digest(obj) -> str:
    """16 hex digits of ``obj``'s JSON; renamed option values are hashed in their old spelling
    (:data:`smf.vocabulary.FINGERPRINT_SPELLINGS`), so suite directories written before a rename still match."""
    text = json.dumps(obj, sort_keys=True, default=str)
    for new, old in FINGERPRINT_SPELLINGS.items():
        text = text.replace(json.dumps(new), json.dumps(old))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Options added after suites were first fingerprinted, with the value that computes what was computed before they
# existed: left out of the fingerprint at that value, so suite directories written before them still match. An
# option added after RunConfig's recorded order is left out at its default in the same way, without a line here.
LATER_OPTIONS = {"retrofit_data": None, "background_data": None, "train_data": None, "loss_on": "all",
                 "count_reads": "all", "batch_size": 1, "row_optimizer": "adamw", "alpha_lr": None, "fsdp": False}


IN_SUITE = "<suite>"  # how run hashes and stage fingerprints write the suite folder (the folder can move)


def in_suite(value, root: Path | None):
    """``value`` (options, or a run's hashed settings) with every path inside the suite folder ``root`` written
    relative to it (``<suite>/bases/seed0/pretrain/final``), in nested dicts and lists too; ``root`` None: as it is
    (folders written before issue 57 hashed these paths absolute: :func:`run_hashes`, :func:`stage_fingerprints`)."""
    if root is None:
        return value
    if isinstance(value, dict):
        return {key: in_suite(item, root) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [in_suite(item, root) for item in value]
    if isinstance(value, (str, Path)) and Path(value).is_absolute() and Path(value).is_relative_to(root):
        return f"{IN_SUITE}/{Path(value).relative_to(root).as_posix()}".removesuffix("/.")
    return value


def stage_fingerprints(options: dict, root: Path) -> tuple[str, str]:
    """(fingerprint, as written before issue 57) of a stage's ``options`` in the suite folder ``root``: paths inside
    the folder relative to it (:func:`in_suite`), or absolute; the same where no option names a path inside."""
    return options_fingerprint(in_suite(options, Path(root))), options_fingerprint(options)


def options_fingerprint(options: dict) -> str:
    """Hash of a stage's resolved trainer options, without :data:`IGNORED_OPTIONS` (nor :data:`LATER_OPTIONS` at
    their old behaviour, nor options newer than :data:`smf.train.config.RECORDED_ORDER` at their default); the
    update options in the form hashed before ``--update`` replaced ``--optimizer``
    (:func:`smf.train.config.fingerprint_form`)."""
    newer = {spec.name: spec.default for spec in fields(RunConfig) if spec.name not in RECORDED_ORDER}
    later = {**LATER_OPTIONS, **newer}
    return _digest({name: value for name, value in fingerprint_form(options).items() if name not in IGNORED_OPTIONS
                    and not (name in later and value == later[name])})


def run_hashes(config: SuiteConfig, run: Run) -> tuple[str, str]:
    """(:func:`run_hash`, the hash written before issue 57, with the paths inside the suite folder absolute): the
    hashes a results record of ``run`` may hold in its folder; the same where no path lies inside the folder."""
    return run_hash(config, run), run_hash(config, run, relative=False)


def run_hash(config: SuiteConfig, run: Run, relative: bool = True) -> str:
    """Hash of everything that decides ``run``'s numbers: model, data, the options of its stages
    as configured, its seed and condition, and the evaluation settings (of the world and base of its seed, with
    ``base_per_seed``); paths inside the suite folder relative to it (:func:`in_suite`; ``relative`` False: all
    absolute, as before issue 57)."""
    config = seed_config(config, run.seed)
    stages = {"base": (), "lora": ("lora",), "full": ("full",)}.get(run.condition,
                                                                      ("retrofit", "background", "sparse"))
    trained = condition_recipe(run.condition)
    data = config.data  # own-data files enter the hash only when given (paper suites keep their hashes)
    own_train = [data.retrofit, data.background, data.train] if data.own else []
    own_eval = [data.eval_learn, data.eval_heldout, data.eval_retain] if data.own else []
    own_eval += [data.eval_retain_heldout] if data.eval_retain_heldout else []  # issue 48: other suites keep hashes
    science = {"world": config.world, "pretrain": config.pretrain} if config.world else {}
    return _digest(in_suite({
        **science, "model": config.model, "condition": run.condition, "seed": run.seed, "protocol": config.protocol,
        "update": run.update, **({"reads": run.reads} if run.reads else {}),
        **({"variant": config.variant_options(run.variant)} if run.variant else {}),
        **({"stream": config.stream} if config.stream else {}),  # a stream's runs: its tasks one after another
        "train_data": ([config.data.oasst, config.data.medmcqa_train] + own_train) if stages else [],
        "stages": {stage: {name: value for name, value in {
            **config.train, **config.stages.get(stage, {}),
            **({"lr": run.lr} if run.lr is not None and stage == trained else {}),
            **({"epochs": run.epochs} if run.epochs is not None and stage == trained else {})}.items()
            if name not in IGNORED_OPTIONS} for stage in stages},
        "eval": config.to_dict()["eval"],
        "eval_data": [config.data.medmcqa_validation, config.data.wikitext, config.data.triviaqa] + own_eval,
    }, Path(config.output_dir).absolute() if relative else None))


PLAN_KEYS = ("seeds", "conditions", "authors_update")  # what --seeds / --conditions / --authors-update narrow
_NOT_SETTINGS = (*PLAN_KEYS, "name", "device", "output_dir")  # where and under which name, not what is computed


_OPTIONAL_SECTIONS = ("stream", "schedule_sweep", "hypotheses", "equal_compute")  # absent from records written before they existed


def _computed_settings(saved: dict) -> dict:
    """What a suite record (:meth:`SuiteConfig.to_dict`) computes, in a form that a record written before a section
    or data role existed compares equal to: empty optional sections and data roles not given left out; with a base
    per seed, the data files, model and world/pretraining seed left out (they follow the first seed of the call,
    :func:`smf.suite.config.seed_config` gives each seed its own)."""
    root = Path(saved["output_dir"]).absolute() if saved.get("output_dir") else None
    settings = {k: in_suite(v, root) for k, v in saved.items() if k not in _NOT_SETTINGS  # the folder can move
                and not (k in _OPTIONAL_SECTIONS and not v)}
    settings["data"] = {k: in_suite(v, root) for k, v in (saved.get("data") or {}).items() if v is not None}
    if saved.get("base_per_seed") and saved.get("world"):
        for key in ("data", "model"):
            settings.pop(key, None)
        for key in ("world", "pretrain"):
            settings[key] = {k: v for k, v in (saved.get(key) or {}).items() if k != "seed"}
    return settings


def merged_plan(recorded: dict | None, config: SuiteConfig) -> SuiteConfig | None:
    """The suite ``config`` joined with the one recorded in its directory (``suite_config.json``, as a dict):
    when both compute the same (every setting but seeds, conditions, authors_update, name and device equal),
    a config whose plan holds the runs of both, so that a call on a subset never narrows what the directory
    reports; None when the recorded suite computes something else (``config`` then replaces it)."""
    if recorded is None:
        return config
    new = config.to_dict()
    recorded = {**{key: {} for key in ("schedule_sweep", "hypotheses")}, **recorded}  # keys added later: empty
    if _computed_settings(recorded) != _computed_settings(new):
        return None
    merged = dict(new)
    merged["seeds"] = list(recorded.get("seeds") or []) + [s for s in new["seeds"] if s not in (recorded.get("seeds")
                                                                                                  or [])]
    for key in ("conditions", "authors_update"):
        chosen = set(recorded.get(key) or []) | set(new[key] or [])
        merged[key] = [condition for condition in CONDITIONS if condition in chosen]
    if merged.get("base_per_seed") and merged.get("world"):  # derived again from the merged first seed (the call's
        merged.update(data={}, model=None)                    # are its own first seed's: they would not match)
    return suite_config_from_dict(merged)
