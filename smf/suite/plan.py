"""What a suite runs: one run per (condition, seed), the training stages each needs, and where each
stage writes (whether something on disk came from this config: :mod:`smf.suite.fingerprints`).

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

from dataclasses import dataclass
from pathlib import Path

from smf.options import only
from smf.suite.config import STAGE_COMMANDS, SuiteConfig, pretrained_adapter
from smf.train.config import RECIPE_DEFAULTS, RunConfig, build_config
from smf.vocabulary import RETROFIT_MODE, condition_recipe, split_condition

SUITE_CONFIG_FILE = "suite_config.json"


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
