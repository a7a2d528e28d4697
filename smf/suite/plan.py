"""What a suite runs: one run per (condition, seed), the training stages each needs, where each
stage writes, and the fingerprints that tell whether something on disk came from this config.

Directory layout of a suite (``output_dir``)::

    suite_config.json                      the resolved config of the last `smf suite`
    retrofit/{mode}{tag}-seed{s}/          stage 1, shared by both selection rules of a mode and seed
    background/{mode}{tag}-seed{s}/        background statistics of that retrofit
    train/{run name}/                      stage 2 (sparse), or the LoRA / full-finetune baseline
    eval/{run name}/{task}.jsonl           per-example evaluation output
    results/{run name}.json                one finished run (written last, atomically)

A run's name is ``{condition}[-{variant}][-authors-update][-loss-reads][-lr{rate}]-seed{s}``
(``additive-tfidf-s1024-t16-sgd-lr0.1-seed0``). ``{tag}`` is empty without ``variants``; with them, it names the
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
from dataclasses import dataclass
from pathlib import Path

from smf.options import only
from smf.suite.config import (STAGE_COMMANDS, SuiteConfig, pretrained_adapter, seed_config,
                              suite_config_from_dict)
from smf.train.config import RunConfig, build_config, fingerprint_form
from smf.vocabulary import CONDITIONS, FINGERPRINT_SPELLINGS, RETROFIT_MODE, condition_recipe, split_condition

SUITE_CONFIG_FILE = "suite_config.json"
# Options that say where a stage lives and runs, whether it resumed and how often it saved, not what it computes.
IGNORED_OPTIONS = ("output_dir", "adapter", "background", "resume", "save_every", "device", "threads")


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

    @property
    def name(self) -> str:
        suffix = ("-authors-update" if self.update == "authors" else "") + (f"-{self.reads}-reads" if self.reads
                                                                             else "")
        rate = "" if self.lr is None else f"-lr{self.lr:g}"
        variant = "" if self.variant is None else f"-{self.variant}"
        return f"{self.condition}{variant}{suffix}{rate}-seed{self.seed}"

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


def _settings(config: SuiteConfig, condition: str) -> list[tuple[str | None, float | None]]:
    """(variant, learning rate) of every run ``condition`` makes per seed: a sparse condition once per variant at
    the variant's rates (with ``variants``), else at every rate of its recipe's ``lr_sweep`` (None for base or
    without a sweep)."""
    recipe = condition_recipe(condition)
    if recipe == "sparse" and config.variants:
        return [(name, lr) for name, options in config.variants.items() for lr in options["lr_sweep"]]
    return [(None, lr) for lr in (config.lr_sweep.get(recipe, (None,)) if recipe is not None else (None,))]


def plan_runs(config: SuiteConfig) -> list[Run]:
    """Every run of the suite, seed by seed (a partial suite has whole seeds done first): the Table 1
    conditions (each at every rate of its ``lr_sweep``, and a sparse one for every variant), then the
    ``authors_update`` and ``count_reads_ablation`` runs of that seed."""
    return [run for seed in config.seeds
            for run in [Run(c, seed, lr=lr, variant=v) for c in config.conditions for v, lr in _settings(config, c)]
            + [Run(c, seed, "authors", lr, variant=v) for c in config.authors_update for v, lr in _settings(config, c)]
            + [Run(c, seed, lr=lr, reads="loss", variant=v) for c in config.count_reads_ablation
               for v, lr in _settings(config, c)]]


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
                 count_reads: str | None = None, variant: str | None = None) -> RunConfig:
    """The resolved trainer options of one stage (retrofit, background, sparse, lora, full).

    Options: ``train`` < ``stages.{stage}`` < the options of ``variant`` (a key of ``variants``) < what the suite sets
    (model, device, data, seed, mode, rule, directories; ``update`` "authors" for the update ablation; ``lr`` a rate
    of the sweep). The background stage also inherits ``stages.retrofit`` (its examples must be drawn exactly as the
    retrofit's were).
    """
    command = STAGE_COMMANDS[stage]
    options = {**_configured(config, stage), **config.variant_options(variant), **({} if lr is None else {"lr": lr}),
               **({} if count_reads is None else {"count_reads": count_reads})}
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
                    f"{value:g}" if isinstance(value, float) else str(value)
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
# existed: left out of the fingerprint at that value, so suite directories written before them still match.
LATER_OPTIONS = {"retrofit_data": None, "background_data": None, "train_data": None, "loss_on": "all",
                 "count_reads": "all", "batch_size": 1, "row_optimizer": "adamw", "alpha_lr": None, "fsdp": False}


def options_fingerprint(options: dict) -> str:
    """Hash of a stage's resolved trainer options, without :data:`IGNORED_OPTIONS` (nor :data:`LATER_OPTIONS` at
    their old behaviour); the update options in the form hashed before ``--update`` replaced ``--optimizer``
    (:func:`smf.train.config.fingerprint_form`)."""
    return _digest({name: value for name, value in fingerprint_form(options).items() if name not in IGNORED_OPTIONS
                    and not (name in LATER_OPTIONS and value == LATER_OPTIONS[name])})


def run_hash(config: SuiteConfig, run: Run) -> str:
    """Hash of everything that decides ``run``'s numbers: model, data, the options of its stages
    as configured, its seed and condition, and the evaluation settings (of the world and base of its seed, with
    ``base_per_seed``)."""
    config = seed_config(config, run.seed)
    stages = {"base": (), "lora": ("lora",), "full": ("full",)}.get(run.condition,
                                                                      ("retrofit", "background", "sparse"))
    trained = condition_recipe(run.condition)
    data = config.data  # own-data files enter the hash only when given (paper suites keep their hashes)
    own_train = [data.retrofit, data.background, data.train] if data.own else []
    own_eval = [data.eval_learn, data.eval_heldout, data.eval_retain] if data.own else []
    science = {"world": config.world, "pretrain": config.pretrain} if config.world else {}
    return _digest({
        **science, "model": config.model, "condition": run.condition, "seed": run.seed, "protocol": config.protocol,
        "update": run.update, **({"reads": run.reads} if run.reads else {}),
        **({"variant": config.variant_options(run.variant)} if run.variant else {}),
        "train_data": ([config.data.oasst, config.data.medmcqa_train] + own_train) if stages else [],
        "stages": {stage: {name: value for name, value in {
            **config.train, **config.stages.get(stage, {}),
            **({"lr": run.lr} if run.lr is not None and stage == trained else {})}.items()
            if name not in IGNORED_OPTIONS} for stage in stages},
        "eval": config.to_dict()["eval"],
        "eval_data": [config.data.medmcqa_validation, config.data.wikitext, config.data.triviaqa] + own_eval,
    })


PLAN_KEYS = ("seeds", "conditions", "authors_update")  # what --seeds / --conditions / --authors-update narrow
_NOT_SETTINGS = (*PLAN_KEYS, "name", "device", "output_dir")  # where and under which name, not what is computed


def merged_plan(recorded: dict | None, config: SuiteConfig) -> SuiteConfig | None:
    """The suite ``config`` joined with the one recorded in its directory (``suite_config.json``, as a dict):
    when both compute the same (every setting but seeds, conditions, authors_update, name and device equal),
    a config whose plan holds the runs of both, so that a call on a subset never narrows what the directory
    reports; None when the recorded suite computes something else (``config`` then replaces it)."""
    if recorded is None:
        return config
    new = config.to_dict()
    if {k: v for k, v in recorded.items() if k not in _NOT_SETTINGS} != \
            {k: v for k, v in new.items() if k not in _NOT_SETTINGS}:
        return None
    merged = dict(new)
    merged["seeds"] = list(recorded.get("seeds") or []) + [s for s in new["seeds"] if s not in (recorded.get("seeds")
                                                                                                  or [])]
    for key in ("conditions", "authors_update"):
        chosen = set(recorded.get(key) or []) | set(new[key] or [])
        merged[key] = [condition for condition in CONDITIONS if condition in chosen]
    return suite_config_from_dict(merged)
