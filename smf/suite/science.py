"""The science preset's additions to a suite (docs/science.md): the synthetic worlds and the pretrained bases they
start from, the learning-rate sweep's choice of the reported rate, and confidence intervals.

- :func:`prepare_science_inputs`: before any run, the world's files go to ``world/`` and the base pretrained on them
  to ``pretrain/`` (:func:`smf.train.pretrain.pretrain_world`: reused when finished and intact, copied from the
  shipped bases when one has the same fingerprint, resumed from its checkpoint otherwise). With ``base_per_seed``,
  every seed has a world and a base of its own (world seed and pretraining seed = the run's seed), in
  ``bases/seed{S}/world`` and ``bases/seed{S}/pretrain``; :func:`smf.suite.config.seed_config` is the suite as
  one seed's runs see it.
- :func:`chosen_rates`: with an ``lr_sweep``, each condition is reported at the rate whose mean learning metric over
  the seeds is highest (ties: the lower rate). The same rule for every method; it is chosen on the reported seeds,
  which flatters every method alike. With a ``schedule_sweep`` the choice is over (epochs, rate) configurations
  (:func:`chosen_settings`; ties: the configured epochs, then fewer, then the lower rate).
"""
from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from smf.data.world import WorldOptions, build_world, world_digest, write_world
from smf.report.intervals import with_intervals
from smf.suite.config import WORLD_ROLES, base_root, seed_config
from smf.report.table import summarize
from smf.train.pretrain import PretrainOptions, pretrain_world

logger = logging.getLogger(__name__)


def _write_world_if_changed(options, world_dir: Path) -> None:
    """Build the world of ``options`` (fast) and write its files unless ``world.json`` records the same digest."""
    world = build_world(options)
    digest = world_digest(world)
    record = world_dir / "world.json"
    try:
        recorded = json.loads(record.read_text()).get("digest") if record.is_file() else None
    except (OSError, ValueError, AttributeError):
        logger.warning("%s cannot be read: the world's files are written again", record)
        recorded = None
    if recorded != digest or not all((world_dir / f"{role}.jsonl").is_file() for role in (*WORLD_ROLES,
                                                                                           *world.datasets)):
        logger.info("writing the world (%s) to %s", options, world_dir)
        write_world(world, world_dir)


def prepare_science_inputs(config) -> dict[int | None, dict] | None:
    """Write the world(s) and pretrain (or reuse, or copy) the base(s) of ``config`` (a SuiteConfig) when it has
    ``world`` / ``pretrain``; returns seed (None: shared) -> pretraining marker, None without ``pretrain``."""
    if not config.world:
        return None
    markers = {}
    for seed in (config.seeds if config.base_per_seed else (None,)):
        own = config if seed is None else seed_config(config, seed)
        options = WorldOptions.from_dict(own.world)
        root = base_root(config.output_dir, seed)
        _write_world_if_changed(options, root / "world")
        if not config.pretrain:
            continue
        marker = pretrain_world(options, PretrainOptions.from_dict(own.pretrain), root / "pretrain")
        logger.info("base%s %s: old-QA accuracy %.3f (chance %.3f), %s", "" if seed is None else f" of seed {seed}",
                    marker["fingerprint"], marker["old_qa_accuracy"], marker["chance"],
                    marker.get("source", "pretrained here") if marker["skipped"] else f"{marker['seconds']:.0f} s")
        markers[seed] = marker
    return markers or None


def learning_metric(results: list[dict]) -> str:
    """The metric a sweep maximises: ``learn_acc`` (own data) or ``medmcqa_acc`` (the paper's)."""
    keys = {key for result in results for key in result["metrics"]}
    return "learn_acc" if "learn_acc" in keys else "medmcqa_acc"


def variant(result: dict) -> tuple[str, str, str, str | None]:
    """(condition, update, reads, variant) of a results record: a method, its ablation and its suite variant (None
    without ``variants``)."""
    return result["condition"], result.get("update", "exact"), result.get("reads") or "all", result.get("variant")


def setting(result: dict) -> tuple[int | None, float | None]:
    """(epochs, learning rate) of a results record: its configuration in its method's sweep (epochs None: the
    stage's configured epochs)."""
    return result.get("epochs"), result.get("lr")


def _order(configuration: tuple[int | None, float]) -> tuple[int, float]:
    epochs, rate = configuration
    return (-1 if epochs is None else epochs), rate


def chosen_settings(results: list[dict]) -> dict[tuple[str, str, str, str | None], tuple[int | None, float]]:
    """:func:`variant` -> the swept configuration (:func:`setting`) with the highest mean learning metric over its
    seeds (ties: the configured epochs, then fewer epochs, then the lower rate); runs without a rate are left out."""
    metric = learning_metric(results)
    means: dict[tuple[str, str, str, str | None], dict[tuple, list[float]]] = {}
    for result in results:
        if result.get("lr") is None:
            continue
        means.setdefault(variant(result), {}).setdefault(setting(result), []).append(result["metrics"][metric])
    return {key: max(sorted(by_setting, key=_order), key=lambda chosen: statistics.fmean(by_setting[chosen]))
            for key, by_setting in means.items()}


def chosen_rates(results: list[dict]) -> dict[tuple[str, str, str, str | None], float]:
    """:func:`variant` -> the rate of its chosen configuration (:func:`chosen_settings`; without a schedule sweep the
    swept rate with the highest mean learning metric, ties: the lower rate)."""
    return {key: rate for key, (_, rate) in chosen_settings(results).items()}


def at_chosen_rates(results: list[dict]) -> list[dict]:
    """The runs of ``results`` at their condition's chosen configuration (:func:`chosen_settings`), and every run
    without a rate."""
    chosen = chosen_settings(results)
    return [r for r in results if r.get("lr") is None or chosen[variant(r)] == setting(r)]


def sweep_rows(results: list[dict]) -> list[dict]:
    """One row per (condition, update, reads, variant, epochs, rate): seeds, and per metric (mean, 95% half-width),
    with ``chosen`` (rate None: runs without a sweep; epochs None: the stage's configured epochs)."""
    chosen = chosen_settings(results)
    groups: dict[tuple, list[dict]] = {}
    for result in results:
        groups.setdefault((*variant(result), *setting(result)), []).append(result)
    rows = []
    for (condition, update, reads, name, epochs, rate), runs in groups.items():
        records = [{"condition": condition, "seed": r["seed"], **r["metrics"]} for r in runs]
        (summary,) = with_intervals(summarize(records), records)
        rows.append({"condition": condition, "update": update, "reads": reads, "variant": name, "lr": rate,
                     "seeds": len(runs), "chosen": rate is None or chosen[(condition, update, reads, name)]
                     == (epochs, rate), "metrics": summary.stats, **({} if epochs is None else {"epochs": epochs})})
    return rows
