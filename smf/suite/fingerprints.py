"""Whether something on disk came from a suite's config, in one place: the fingerprint of a stage's options (its
directory holds the stage that config would run), the hash of everything that decides a run's numbers (its results
record is that run's), and whether a suite directory's recorded config computes what a config computes (a call on
some of its seeds or conditions joins it, :func:`merged_plan`).

Each rule keeps what was written before a change matching: option values renamed since are hashed in their old
spelling (:data:`FINGERPRINT_SPELLINGS`), the update options in the form hashed before ``--update`` replaced
``--optimizer`` (:func:`fingerprint_form`, from each update's entry in :data:`smf.vocabulary.UPDATE_KINDS`), options
added since are left out at the value that computes what was computed before them (:data:`LATER_OPTIONS`, and any
option newer than :data:`smf.train.config.RECORDED_ORDER` at its default), and paths inside the suite folder are
hashed relative to it (:func:`in_suite`) beside the absolute form written before issue 57. A new option, spelling or
record key that must leave old directories matching is one entry here."""
from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from pathlib import Path

from smf.suite.config import SuiteConfig, seed_config, suite_config_from_dict
from smf.suite.plan import Run
from smf.train.config import RECORDED_ORDER, UPDATE_OF_OPTIMIZER, RunConfig
from smf.vocabulary import CONDITIONS, UPDATE_KINDS, condition_recipe

# What the fingerprints hash instead of a renamed option value, so that directories written before the renames match.
FINGERPRINT_SPELLINGS = {"row_sparse": "row-sparse", "dense_masked": "dense-masked"}

# Options that say where a stage lives and runs, whether it resumed and how often it saved, not what it computes.
IGNORED_OPTIONS = ("output_dir", "adapter", "background", "resume", "save_every", "device", "threads")


def _digest(obj) -> str:
    """16 hex digits of ``obj``'s JSON; renamed option values are hashed in their old spelling
    (:data:`FINGERPRINT_SPELLINGS`), so suite directories written before a rename still match."""
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


def recorded_fingerprint(options: dict, output_dir: Path, root: Path) -> str:
    """The fingerprint (:func:`stage_fingerprints`) of the options the stage directory ``output_dir`` of the suite
    folder ``root`` recorded (its run_config.json): paths inside the folder relative to where it lay when they were
    written (its recorded ``output_dir``, less the stage's place in the folder), so a stage stopped and then moved
    with its folder resumes."""
    root = Path(root).absolute()
    place = Path(output_dir).absolute().relative_to(root).parts
    written = Path(options.get("output_dir") or "")
    if place and written.is_absolute() and written.parts[-len(place):] == place:
        root = Path(*written.parts[:-len(place)])
    return stage_fingerprints(options, root)[0]


def fingerprint_form(options: dict) -> dict:
    """Resolved train options in the form suite fingerprints hashed before --update existed (``optimizer``,
    ``sparse_backward`` and ``fused_update`` in their defaults), so that stage directories written then still
    match: new options (``update``) and old ones (run_config.json files of earlier runs) give the same dict."""
    if "update" not in options and "optimizer" not in options:
        return options
    update = options["update"] if "update" in options else UPDATE_OF_OPTIMIZER.get(options["optimizer"],
                                                                                     options["optimizer"])
    form = {name: value for name, value in options.items() if name != "update"}
    form.update(optimizer=UPDATE_KINDS[update].optimizer if update in UPDATE_KINDS else update,
                sparse_backward="selected-rows" if options.get("compile") else "deferred", fused_update=False)
    return form


def options_fingerprint(options: dict) -> str:
    """Hash of a stage's resolved trainer options, without :data:`IGNORED_OPTIONS` (nor :data:`LATER_OPTIONS` at
    their old behaviour, nor options newer than :data:`smf.train.config.RECORDED_ORDER` at their default); the
    update options in the form hashed before ``--update`` replaced ``--optimizer``
    (:func:`fingerprint_form`)."""
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


_OPTIONAL_SECTIONS = ("stream", "schedule_sweep", "hypotheses", "equal_compute")  # absent from records before them


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
