"""The science preset's additions to a suite (docs/science.md): the synthetic world and the pretrained model it
starts from, the learning-rate sweep's choice of the reported rate, and confidence intervals.

- :func:`prepare_science_inputs`: before any run, ``{output_dir}/world/`` receives the world's files (rewritten only
  when ``world.json`` records other options) and ``{output_dir}/pretrain/`` the model pretrained on them
  (:func:`smf.train.pretrain.pretrain_world`: reused when finished, resumed from its checkpoint otherwise).
- :func:`chosen_rates`: with an ``lr_sweep``, each condition is reported at the rate whose mean learning metric over
  the seeds is highest (ties: the lower rate). The same rule for every method; it is chosen on the reported seeds,
  which flatters every method alike.
"""
from __future__ import annotations

import json
import logging
import statistics

from smf.report.intervals import with_intervals
from smf.report.table import summarize

logger = logging.getLogger(__name__)


def prepare_science_inputs(config) -> dict | None:
    """Write the world and pretrain the model of ``config`` (a SuiteConfig) when it has ``world`` / ``pretrain``;
    returns the pretraining marker (None without ``pretrain``)."""
    if not config.world:
        return None
    from smf.data.world import WorldOptions, build_world, write_world
    from smf.train.pretrain import PretrainOptions, pretrain_world

    options = WorldOptions.from_dict(config.world)
    world_dir = config.output_dir / "world"
    record = world_dir / "world.json"
    if not (record.is_file() and json.loads(record.read_text()).get("options") == options.to_dict()):
        logger.info("writing the world (%s) to %s", options, world_dir)
        write_world(build_world(options), world_dir)
    if not config.pretrain:
        return None
    marker = pretrain_world(options, PretrainOptions.from_dict(config.pretrain), config.output_dir / "pretrain")
    logger.info("pretrained model: old-QA accuracy %.3f (chance %.3f), %s", marker["old_qa_accuracy"],
                marker["chance"], "reused" if marker["skipped"] else f"{marker['seconds']:.0f} s")
    return marker


def learning_metric(results: list[dict]) -> str:
    """The metric a sweep maximises: ``learn_acc`` (own data) or ``medmcqa_acc`` (the paper's)."""
    keys = {key for result in results for key in result["metrics"]}
    return "learn_acc" if "learn_acc" in keys else "medmcqa_acc"


def variant(result: dict) -> tuple[str, str, str, str | None]:
    """(condition, update, reads, variant) of a results record: a method, its ablation and its suite variant (None
    without ``variants``)."""
    return result["condition"], result.get("update", "exact"), result.get("reads") or "all", result.get("variant")


def chosen_rates(results: list[dict]) -> dict[tuple[str, str, str, str | None], float]:
    """:func:`variant` -> the swept rate with the highest mean learning metric over its seeds (ties: the lower
    rate); runs without a rate are left out."""
    metric = learning_metric(results)
    means: dict[tuple[str, str, str, str | None], dict[float, list[float]]] = {}
    for result in results:
        if result.get("lr") is None:
            continue
        key = variant(result)
        means.setdefault(key, {}).setdefault(result["lr"], []).append(result["metrics"][metric])
    return {key: max(sorted(by_rate), key=lambda rate: statistics.fmean(by_rate[rate]))
            for key, by_rate in means.items()}


def at_chosen_rates(results: list[dict]) -> list[dict]:
    """The runs of ``results`` at their condition's chosen rate (:func:`chosen_rates`), and every run without one."""
    chosen = chosen_rates(results)
    return [r for r in results if r.get("lr") is None or chosen[variant(r)] == r["lr"]]


def sweep_rows(results: list[dict]) -> list[dict]:
    """One row per (condition, update, reads, variant, rate): seeds, and per metric (mean, 95% half-width), with
    ``chosen`` (rate None: runs without a sweep)."""
    chosen = chosen_rates(results)
    groups: dict[tuple, list[dict]] = {}
    for result in results:
        groups.setdefault((*variant(result), result.get("lr")), []).append(result)
    rows = []
    for (condition, update, reads, name, rate), runs in groups.items():
        records = [{"condition": condition, "seed": r["seed"], **r["metrics"]} for r in runs]
        (summary,) = with_intervals(summarize(records), records)
        rows.append({"condition": condition, "update": update, "reads": reads, "variant": name, "lr": rate,
                     "seeds": len(runs), "chosen": rate is None or chosen[(condition, update, reads, name)] == rate,
                     "metrics": summary.stats})
    return rows
