"""The equal-compute envelope (issue 58 item 3; docs/science.md): each method's kept value at matched learning read
over only its runs whose compute fits a budget common to every method, beside the envelope over all its
configurations (:mod:`smf.report.matched_learning`).

A run's compute is CPU seconds (process time) of this machine: its training stage's (``timing.train_cpu_s``) plus, for
a sparse run, the retrofit and background stages it starts from (``timing.retrofit_cpu_s`` + ``background_cpu_s``),
counted whole for every sparse run of the seed, as if each had been the only one. The budget of a seed is the highest
compute among one method's runs on that seed (the suite's ``equal_compute``: full finetuning's costliest run). CPU
seconds, unlike the FLOPs estimate of :mod:`smf.suite.cost`, cover the retrofit (whose FLOPs are not recorded) and
what each method pays on this CPU; they move with the machine's load by some percent, so a run within a few percent
of the budget may fall on either side on another machine.
"""
from __future__ import annotations

from collections.abc import Callable


def run_compute(result: dict) -> float | None:
    """CPU seconds of ``result``'s training stage plus the shared retrofit and background it starts from (module
    docstring); None when the record lacks the training stage's."""
    timing = result.get("timing") or {}
    if timing.get("train_cpu_s") is None:
        return None
    return timing["train_cpu_s"] + timing.get("retrofit_cpu_s", 0.0) + timing.get("background_cpu_s", 0.0)


def seed_budgets(results: list[dict], key: Callable[[dict], tuple], budget_method: tuple) -> dict[int, float]:
    """Seed -> the highest :func:`run_compute` among the swept runs of ``budget_method`` (a ``key`` of a record) on
    that seed; a seed where one of its runs lacks the record is left out."""
    costs: dict[int, list] = {}
    for result in results:
        if result.get("lr") is not None and key(result) == budget_method:
            costs.setdefault(result["seed"], []).append(run_compute(result))
    return {seed: max(values) for seed, values in costs.items() if None not in values}


def _fits(result: dict, budgets: dict[int, float]) -> bool:
    """Whether ``result`` is a swept run whose :func:`run_compute` is at most its seed's budget."""
    compute = run_compute(result)
    return result.get("lr") is not None and result["seed"] in budgets and compute is not None \
        and compute <= budgets[result["seed"]]


def within_budget(results: list[dict], budgets: dict[int, float]) -> list[dict]:
    """The swept runs of ``results`` whose :func:`run_compute` is at most their seed's budget (seeds without one
    left out)."""
    return [result for result in results if _fits(result, budgets)]


def configurations_within(results: list[dict], budgets: dict[int, float], key: Callable[[dict], tuple]
                          ) -> dict[tuple, str]:
    """Method (``key`` of a record) -> "k of n": of its n swept runs (over seeds), the k within the budget."""
    counts: dict[tuple, list[int]] = {}
    for result in results:
        if result.get("lr") is not None:
            count = counts.setdefault(key(result), [0, 0])
            count[0] += _fits(result, budgets)
            count[1] += 1
    return {method: f"{within} of {total}" for method, (within, total) in counts.items()}
