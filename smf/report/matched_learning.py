"""Forgetting at matched learning (docs/science.md): how much old knowledge each method keeps when it has learned the
same amount of the new task, read off each seed's own learning-rate sweep.

For one method and one seed, the sweep's runs are points (learning, kept) ordered by learning rate. The kept value at
a learning level L is interpolated linearly between the two consecutive rates whose learning brackets L (the first
such pair, from the lowest rate up); a level above every rate's learning is *not reached*, one below every rate's
learning is *below the sweep* (not measured: no line is drawn from the base model to the lowest rate). Across seeds:
the mean and the 95% Student-t interval over the seeds that measured the level, with how many did. Differences to a
reference method (full finetuning) are paired by seed (with ``base_per_seed`` a seed is a world and a base, so the
pairing removes the base's own spread).

A method that sweeps several schedules (a ``schedule_sweep``: epochs x rates) has one such curve per schedule
(epochs) and seed; its kept value at L for that seed is the *upper envelope*: the highest of its schedules' kept
values at L (each interpolated along its own rates), with the schedule that gave it. A level no schedule measured is
*below the sweep* if it lies below some schedule's lowest learning, else *not reached*. Every method gets the same
number of configurations (checked by the suite config), since a maximum over more noisy runs is higher.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from smf.report.intervals import t_quantile

NOT_REACHED, BELOW_SWEEP = "not reached", "below the sweep"


def kept_at(points: list[tuple[float, float, float]], level: float) -> float | str:
    """Kept (old-knowledge metric) at learning ``level`` from one seed's ``points`` (rate, learning, kept); or
    :data:`NOT_REACHED` / :data:`BELOW_SWEEP` (module docstring)."""
    ordered = sorted(points)
    for _, learned, kept in ordered:
        if learned == level:
            return kept
    for (_, learn_a, kept_a), (_, learn_b, kept_b) in zip(ordered, ordered[1:]):
        if min(learn_a, learn_b) < level < max(learn_a, learn_b):
            return kept_a + (level - learn_a) / (learn_b - learn_a) * (kept_b - kept_a)
    return NOT_REACHED if all(learned < level for _, learned, _ in ordered) else BELOW_SWEEP


def envelope(by_schedule: dict) -> tuple[float | str, object]:
    """(highest kept value, its schedule) over ``by_schedule`` (schedule -> :func:`kept_at` of that schedule's
    curve); without a measured one (:data:`BELOW_SWEEP` if any schedule is below its sweep, else
    :data:`NOT_REACHED`, None). Ties go to the first schedule in ``by_schedule``'s order."""
    measured = [(value, schedule) for schedule, value in by_schedule.items() if not isinstance(value, str)]
    if measured:
        best = max(value for value, _ in measured)
        return next((value, schedule) for value, schedule in measured if value == best)
    return (BELOW_SWEEP if BELOW_SWEEP in by_schedule.values() else NOT_REACHED), None


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """(mean, 95% Student-t half-width; None for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    return mean, t_quantile(len(values)) * statistics.stdev(values) / math.sqrt(len(values))


def matched_learning(results: list[dict], levels: tuple[float, ...], key: Callable[[dict], tuple],
                     learn: str, kept: str, reference: tuple | None = None,
                     schedule: Callable[[dict], object] = lambda result: result.get("epochs")) -> list[dict]:
    """One row per method (``key`` of a results record; runs without ``lr`` are left out): per level, the seeds'
    kept values (float, or why not measured; the upper envelope over the method's schedules, ``schedule`` of a
    record, with ``envelope_of``: seed -> the schedule that gave it, where a method has several), their mean and
    interval over the measured ones, and, with a ``reference`` method, the paired difference (method - reference)
    over the seeds both measured."""
    sweeps: dict[tuple, dict[int, dict[object, list]]] = {}
    for result in results:
        metrics = result["metrics"]
        if result.get("lr") is None or metrics.get(learn) is None or metrics.get(kept) is None:
            continue
        sweeps.setdefault(key(result), {}).setdefault(result["seed"], {}).setdefault(schedule(result), []).append(
            (result["lr"], metrics[learn], metrics[kept]))
    per_schedule = {method: {seed: {level: envelope({name: kept_at(points, level) for name, points in
                                                     sorted(curves.items(), key=lambda item: str(item[0]))})
                                    for level in levels} for seed, curves in seeds.items()}
                    for method, seeds in sweeps.items()}
    per_seed = {method: {seed: {level: pair[0] for level, pair in by_level.items()} for seed, by_level in seeds.items()}
                for method, seeds in per_schedule.items()}
    rows = []
    for method, seeds in per_seed.items():
        row = {"method": list(method), "seeds": sorted(seeds), "levels": {}}
        several = any(len(curves) > 1 for curves in sweeps[method].values())
        for level in levels:
            values = {seed: by_level[level] for seed, by_level in seeds.items()}
            measured = [v for v in values.values() if not isinstance(v, str)]
            cell = {"per_seed": {str(seed): value for seed, value in sorted(values.items())},
                    "measured": len(measured), "mean": None, "half_width": None}
            if several:
                cell["envelope_of"] = {str(seed): per_schedule[method][seed][level][1] for seed in sorted(values)}
            if measured:
                cell["mean"], cell["half_width"] = mean_interval(measured)
            if reference is not None and reference in per_seed and method != reference:
                paired = [value - per_seed[reference][seed][level] for seed, value in values.items()
                          if not isinstance(value, str) and seed in per_seed[reference]
                          and not isinstance(per_seed[reference][seed][level], str)]
                cell["vs_reference"] = None if not paired else dict(zip(("mean", "half_width"),
                                                                        mean_interval(paired)), pairs=len(paired))
                if paired:
                    cell["vs_reference"]["per_seed"] = paired_values(values, per_seed[reference], level)
            row["levels"][str(level)] = cell
        rows.append(row)
    return rows


def paired_values(values: dict, reference: dict, level: float) -> dict[str, float]:
    """seed (as a string) -> method minus reference at ``level``, over the seeds both measured; ``values``: seed ->
    the method's kept value at ``level``, ``reference``: seed -> level -> the reference's."""
    return {str(seed): value - reference[seed][level] for seed, value in sorted(values.items())
            if not isinstance(value, str) and seed in reference and not isinstance(reference[seed][level], str)}


def format_cell(mean: float | None, half_width: float | None, measured: int, seeds: int, signed: bool = False) -> str:
    """``0.712 ± 0.031`` (with ``k/n`` when only k of n seeds measured the level; no ± for one value)."""
    if mean is None:
        return "—"
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    if half_width is not None:
        text += f" ± {half_width:.3f}"
    return text + ("" if measured == seeds else f" ({measured}/{seeds})")
