"""Cost beside kept (docs/science.md): what each method spent on its sweep, per seed, next to what it kept at matched
learning, so that "equal budget" shows in compute and not only in the number of configurations; and the per-seed
values behind the matched-learning means.

Per method: its configurations (epochs x rates), the optimizer steps of one configuration (range), the training
stage's CPU seconds and estimated FLOPs summed over its configurations (mean over seeds), the CPU seconds of the
shared stages it starts from (retrofit and background, once per seed), and for sparse methods the per-touch row
change relative to the row's norm before the step and to its norm when training started (median over its
configurations of each run's median over steps; range). Runs written before these were recorded count as missing
("—").
"""
from __future__ import annotations

import statistics
from collections.abc import Callable


def _per_seed_sum(runs: list[dict], value: Callable[[dict], float | None]) -> float | None:
    """Mean over seeds of the sum over each seed's runs of ``value``; None when any run lacks it."""
    values = [value(run) for run in runs]
    if not runs or any(v is None for v in values):
        return None
    sums: dict[int, float] = {}
    for run, v in zip(runs, values):
        sums[run["seed"]] = sums.get(run["seed"], 0.0) + v
    return statistics.fmean(sums.values())


def _shared_cpu(runs: list[dict]) -> float | None:
    """Mean over seeds of the retrofit + background CPU seconds a seed's runs start from (counted once)."""
    seeds: dict[int, float] = {}
    for run in runs:
        timing = run.get("timing") or {}
        if "retrofit_cpu_s" in timing:
            seeds[run["seed"]] = timing["retrofit_cpu_s"] + timing.get("background_cpu_s", 0.0)
    return statistics.fmean(seeds.values()) if seeds else None


def cost_rows(results: list[dict], key: Callable[[dict], tuple]) -> dict[tuple, dict]:
    """Method key -> its cost (module docstring) over the swept runs of ``results`` (runs without ``lr`` left out)."""
    methods: dict[tuple, list[dict]] = {}
    for result in results:
        if result.get("lr") is not None:
            methods.setdefault(key(result), []).append(result)
    rows = {}
    for method, runs in methods.items():
        costs = [run.get("cost") for run in runs]
        steps = [cost["steps"] for cost in costs if cost]
        rows[method] = {
            "configurations": len({(run.get("epochs"), run["lr"]) for run in runs}),
            "steps": (min(steps), max(steps)) if steps else None,
            "train_cpu_s": _per_seed_sum(runs, lambda run: (run.get("timing") or {}).get("train_cpu_s")),
            "flops": _per_seed_sum(runs, lambda run: (run.get("cost") or {}).get("flops")),
            "shared_cpu_s": _shared_cpu(runs),
            **{field: _spread([(run.get("sparse_steps") or {}).get(field) for run in runs])
               for field in ("row_change", "row_change_vs_start")},
        }
    return rows


def _spread(values: list[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the values given (None: not recorded), or None when none is."""
    values = [value for value in values if value is not None]
    return (statistics.median(values), min(values), max(values)) if values else None


def _change(spread: tuple[float, float, float] | None) -> str:
    return "—" if spread is None else f"{spread[0]:.3g} ({spread[1]:.3g}–{spread[2]:.3g})"


def _number(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def cost_markdown(costs: dict[tuple, dict], matched: list[dict], levels: list[str],
                  labels: dict[tuple, str]) -> list[str]:
    """The cost-beside-kept table: one row per method of ``matched`` (matched-learning rows, whose mean kept values
    stand beside the cost)."""
    lines = ["## Cost beside kept\n",
             "Per method and seed, summed over its configurations (mean over seeds): the training stage's CPU "
             "seconds (process time) and estimated FLOPs (forward 2N + backward 2N + 2N_trained per training token; "
             "N: parameters a token multiplies through, memory tables counted as the rows read; docs/science.md); "
             "the shared retrofit and background stages' CPU seconds once per seed; steps of one configuration; "
             "for sparse methods the per-touch row change relative to the row's norm before the step, and to its "
             "norm when training started (median over configurations of each run's median over steps; range).\n",
             "| Method | Configs | Steps / config | Train CPU-s / seed | Train TFLOPs / seed | Shared stages CPU-s "
             "| Row change per touch | … to the start norm | " + " | ".join(f"kept @ {level}" for level in levels)
             + " |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in levels) + " |"]
    for row in matched:
        method = tuple(row["method"])
        cost = costs.get(method)
        if cost is None:
            continue
        steps = "—" if cost["steps"] is None else (f"{cost['steps'][0]:,}" if cost["steps"][0] == cost["steps"][1]
                                                     else f"{cost['steps'][0]:,}–{cost['steps'][1]:,}")
        kept = [_number(row["levels"][level]["mean"], 3) for level in levels]
        lines.append(f"| {labels[method]} | {cost['configurations']} | {steps} | {_number(cost['train_cpu_s'])} | "
                     f"{_number(None if cost['flops'] is None else cost['flops'] / 1e12, 2)} | "
                     f"{_number(cost['shared_cpu_s'])} | {_change(cost['row_change'])} | "
                     f"{_change(cost['row_change_vs_start'])} | " + " | ".join(kept) + " |")
    return lines + [""]


def per_seed_markdown(matched: list[dict], levels: list[str], labels: dict[tuple, str],
                      reference: tuple | None) -> list[str]:
    """Per-seed kept values (and, with a ``reference``, per-seed differences to it) behind the matched-learning
    means, with the schedule (epochs) that gave each envelope value where a method sweeps several."""
    seeds = sorted({int(seed) for row in matched for seed in row["seeds"]})
    header = " | ".join(f"seed {seed}" for seed in seeds)
    lines = ["## Per seed\n",
             "Each seed's kept value at each level (`not reached` / `below the sweep` where its sweep did not measure "
             "it); with several schedules, the epochs of the schedule on the envelope in brackets (`cfg`: the "
             "configured epochs).\n",
             f"| Method | Level | {header} |", "| --- | ---: | " + " | ".join("---:" for _ in seeds) + " |"]

    def shown(cell: dict, seed: str) -> str:
        value = cell["per_seed"].get(seed, "—")
        text = value if isinstance(value, str) else f"{value:.3f}"
        schedule = cell.get("envelope_of", {}).get(seed, "")
        return text + ("" if "envelope_of" not in cell or isinstance(value, str) else
                       f" ({'cfg' if schedule is None else schedule})")

    for row in matched:
        for level in levels:
            cell = row["levels"][level]
            lines.append(f"| {labels[tuple(row['method'])]} | {level} | "
                         + " | ".join(shown(cell, str(seed)) for seed in seeds) + " |")
    if reference is not None:
        lines += ["", f"| Method − {labels.get(reference, 'reference')} | Level | {header} |",
                  "| --- | ---: | " + " | ".join("---:" for _ in seeds) + " |"]
        for row in matched:
            if tuple(row["method"]) == tuple(reference):
                continue
            for level in levels:
                paired = (row["levels"][level].get("vs_reference") or {}).get("per_seed", {})
                lines.append(f"| {labels[tuple(row['method'])]} | {level} | "
                             + " | ".join("—" if str(seed) not in paired else f"{paired[str(seed)]:+.3f}"
                                          for seed in seeds) + " |")
    return lines + [""]
