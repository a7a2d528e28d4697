"""Pre-registered hypotheses at matched learning (docs/science.md): each is a contrast written in the suite config
before its runs, "method a minus method b keeps at least ``threshold`` more (negative: less) old knowledge at learned
level L", evaluated on the per-seed kept values of :func:`smf.report.matched_learning.matched_learning` (paired by
seed: a seed is a world and a base).

Verdicts, from the paired differences' mean and 95% Student-t interval (t with pairs - 1 degrees of freedom), by the
standard rule for a hypothesis "at least ``threshold``" (issue 58; until then *confirmed* asked only that the mean reach
the threshold and the interval exclude zero):

- *confirmed*: the interval lies beyond the threshold (its low end above a positive threshold, its high end below a
  negative one);
- *refuted*: the interval lies beyond the threshold the other way (an effect as large as the one claimed is ruled out);
- *inconclusive*: neither (the interval holds the threshold, or touches it), or fewer than every seed measured the
  level for both methods (a level some seeds do not reach selects the seeds that do), or fewer than two pairs.

Apart from the verdict, ``from_zero`` says whether the interval excludes zero ("above 0", "below 0") or not
("includes 0"): a difference can be clear of zero and still not confirm the size claimed.

A side may be a factor's level in a factorial design (a list of methods, the cells at that level): its value per seed
is the mean of its cells', over the seeds every one of them measured, so the difference is the factor's main effect
(:func:`side_per_seed`); :func:`hypotheses_markdown` lists these in a table of factor effects, with their aliases.

Every other contrast in a report is exploratory (no correction for multiplicity).
"""
from __future__ import annotations

from smf.report.matched_learning import mean_interval

CONFIRMED, REFUTED, INCONCLUSIVE = "confirmed", "refuted", "inconclusive"


def side_methods(side: str | list[str]) -> list[str]:
    """The methods of a hypothesis's side (:class:`smf.suite.config.Hypothesis`): the one method, or the cells of a
    factor's level."""
    return [side] if isinstance(side, str) else list(side)


def from_zero(low: float, high: float) -> str:
    """Where the interval [``low``, ``high``] lies against zero: "above 0", "below 0" or "includes 0" (an end at 0
    includes it)."""
    return "above 0" if low > 0 else "below 0" if high < 0 else "includes 0"


def verdict(differences: list[float], threshold: float, seeds: int) -> dict:
    """{"verdict", "why", "mean", "half_width", "low", "high", "from_zero", "pairs"} of paired ``differences``
    (a - b, one per seed that measured the level for both) against ``threshold`` (nonzero), out of ``seeds`` seeds."""
    if not threshold:
        raise ValueError("threshold must be nonzero: the smallest difference that matters")
    result = {"pairs": len(differences), "mean": None, "half_width": None, "low": None, "high": None,
              "from_zero": None}
    if len(differences) < 2:
        return {**result, "verdict": INCONCLUSIVE,
                "why": f"{len(differences)} of {seeds} seeds measured the level for both methods: no interval"}
    mean, half = mean_interval(differences)
    low, high = mean - half, mean + half
    result.update(mean=mean, half_width=half, low=low, high=high, from_zero=from_zero(low, high))
    if len(differences) < seeds:
        return {**result, "verdict": INCONCLUSIVE,
                "why": f"only {len(differences)} of {seeds} seeds measured the level for both methods"}
    span = f"the interval [{low:+.3f}, {high:+.3f}]"
    if (low > threshold) if threshold > 0 else (high < threshold):
        return {**result, "verdict": CONFIRMED, "why": f"{span} lies beyond {threshold:+g}"}
    if (high < threshold) if threshold > 0 else (low > threshold):
        return {**result, "verdict": REFUTED, "why": f"{span} lies short of {threshold:+g}"}
    return {**result, "verdict": INCONCLUSIVE, "why": f"{span} holds {threshold:+g}"}


def side_per_seed(cells: list[dict[str, float | str]]) -> dict[str, float]:
    """Seed -> the mean of ``cells``' values (each: seed -> kept value, or a string for a level not measured) over
    the seeds every cell measured, in the first cell's order; one cell: its measured values, unchanged."""
    measured = [{seed: value for seed, value in cell.items() if not isinstance(value, str)} for cell in cells]
    return {seed: sum(cell[seed] for cell in measured) / len(measured) for seed in measured[0]
            if all(seed in cell for cell in measured)}


def evaluate_hypotheses(hypotheses: dict[str, dict], rows: list[dict], methods: dict[str, tuple],
                        seeds: int) -> list[dict]:
    """One entry per hypothesis (name -> {a, b, level, threshold, statement}): its paired per-seed differences and
    :func:`verdict`. ``rows``: :func:`~smf.report.matched_learning.matched_learning` rows; ``methods``: each
    hypothesis's method string -> the row's method key; ``seeds``: the suite's number of seeds. A side that lists
    methods (a factor's level) is the mean of its cells per seed (:func:`side_per_seed`)."""
    by_method = {tuple(row["method"]): row for row in rows}
    evaluated = []
    for name, hypothesis in hypotheses.items():
        level = str(hypothesis["level"])
        a, b = (side_per_seed([by_method.get(tuple(methods[method]), {}).get("levels", {}).get(level, {})
                               .get("per_seed", {}) for method in side_methods(hypothesis[side])])
                for side in ("a", "b"))
        differences = {seed: value - b[seed] for seed, value in a.items() if seed in b}
        evaluated.append({"name": name, **hypothesis, "per_seed": differences,
                          **verdict(list(differences.values()), hypothesis["threshold"], seeds)})
    return evaluated


def _per_seed_text(entry: dict) -> str:
    return " / ".join(f"{value:+.3f}" for _, value in sorted(entry["per_seed"].items(), key=lambda i: int(i[0])))


def _interval_text(entry: dict) -> str:
    return "—" if entry["mean"] is None else f"{entry['mean']:+.3f} ± {entry['half_width']:.3f}"


def hypotheses_markdown(evaluated: list[dict], labels: dict[str, str], registered: dict | None) -> list[str]:
    """The report's section on the hypotheses (:func:`evaluate_hypotheses`); ``labels``: method string -> its table
    label; ``registered``: the registration record (when, and how many runs had finished then), or None. Hypotheses
    on factors' levels (sides that list cells) get a table of factor effects of their own."""
    lines = ["## Pre-registered hypotheses\n"]
    if registered:
        when = (f"Registered {registered['registered_at']}, when {registered['runs_finished']} of "
                f"{registered['runs_planned']} runs had finished")
        lines.append(when + (" (before any run)." if not registered["runs_finished"] else
                             ": **registered after runs had finished**, so not pre-registered for those.") + "\n")
    lines += ["Paired by seed, 95% Student-t interval; confirmed: the interval lies beyond the threshold; refuted: "
              "it lies beyond the threshold the other way; otherwise, or when not every seed measured the level, "
              "inconclusive. Whether the interval excludes 0 is said apart (a difference can be clear of 0 and "
              "still not reach the size claimed). **Every other contrast in this report is exploratory** (not "
              "corrected for multiplicity).\n"]
    contrasts = [entry for entry in evaluated if isinstance(entry["a"], str) and isinstance(entry["b"], str)]
    factors = [entry for entry in evaluated if entry not in contrasts]
    if contrasts:
        lines += ["| Hypothesis | Contrast | Level | Threshold | Per seed | Mean ± 95% | Against 0 | Verdict |",
                  "| --- | --- | ---: | ---: | --- | ---: | --- | --- |"]
    for entry in contrasts:
        lines.append(f"| {entry['name']}: {entry['statement']} | {labels[entry['a']]} − {labels[entry['b']]} | "
                     f"{entry['level']:g} | {entry['threshold']:+g} | {_per_seed_text(entry) or '—'} | "
                     f"{_interval_text(entry)} | {entry['from_zero'] or '—'} | **{entry['verdict']}** "
                     f"({entry['why']}) |")
    if factors:
        lines += ["", "### Factor effects\n",
                  "Each factor's main effect: per seed, the mean kept value of the cells at its level a minus the mean "
                  "of the cells at its level b (each cell its envelope over its configurations); in a fractional "
                  "design each effect is confounded with the interactions named beside it (aliased: the design "
                  "cannot tell them apart).\n",
                  "| Factor | Level a (cells) | Level b (cells) | Learned | Threshold | Per seed | Mean ± 95% | "
                  "Against 0 | Verdict | Aliased with |",
                  "| --- | --- | --- | ---: | ---: | --- | ---: | --- | --- | --- |"]
    for entry in factors:
        cells = [", ".join(labels[method] for method in side_methods(entry[side])) for side in ("a", "b")]
        lines.append(f"| {entry['name']}: {entry['statement']} | {cells[0]} | {cells[1]} | {entry['level']:g} | "
                     f"{entry['threshold']:+g} | {_per_seed_text(entry) or '—'} | {_interval_text(entry)} | "
                     f"{entry['from_zero'] or '—'} | **{entry['verdict']}** ({entry['why']}) | "
                     f"{entry.get('aliases') or '—'} |")
    return lines + [""]
