"""What a stream suite adds to its report (``stream.md`` / ``.json`` and ``stream_forgetting.png``;
docs/science.md#a-stream-of-tasks), from the ``stream`` records of its results files (:mod:`smf.suite.stream`):

- per method, at its chosen configuration (rate, and epochs with a schedule sweep: the highest mean accuracy on the
  last task, as Table 1), a table of the old-fact
  accuracy, the held-out perplexity and every task's accuracy after each stage, mean ± 95% interval over seeds, the
  base model's first;
- matched learning at the final stage: learning is the last task's accuracy, and each method's kept value is read off
  each seed's sweep (:mod:`smf.report.matched_learning`) on every kept axis: the old facts, each earlier task and
  (with two or more) the earlier tasks' mean, with the difference to full finetuning paired by seed;
- the forgetting curves of every method (:func:`smf.report.stream_plot.plot_forgetting`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from smf.report.matched_learning import format_cell, matched_learning, mean_interval
from smf.report.paper_results import metric_title
from smf.report.stream_plot import OLD_FACTS, plot_forgetting
from smf.suite.config import SuiteConfig
from smf.suite.science import at_chosen_rates, chosen_settings
from smf.suite.science import variant as result_variant

OLD_KEY, HELDOUT_KEY = "retain_acc", "heldout_ppl"
LEARNED = "learned"  # the matched-learning records' learning metric: the last task's accuracy
EARLIER_MEAN = "earlier tasks (mean)"  # the kept axis of the earlier tasks' mean accuracy after the stream


def _stage_values(runs: list[dict]) -> dict[int, dict[str, list[float]]]:
    """stage -> series (old-fact key, held-out key, task names) -> the runs' values (one per seed)."""
    values: dict[int, dict[str, list[float]]] = {}
    for run in runs:
        for stage in run["stream"]["stages"]:
            series = values.setdefault(stage["stage"], {})
            for key, value in [*stage["metrics"].items(), *stage["tasks"].items()]:
                if value is not None:
                    series.setdefault(key, []).append(value)
    return values


def _summaries(values: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, dict]]:
    return {stage: {key: dict(zip(("mean", "half_width"), mean_interval(v)), seeds=len(v))
                    for key, v in series.items()} for stage, series in values.items()}


def stage_rows(config: SuiteConfig, results: list[dict]) -> list[dict]:
    """Per method (at its chosen rate with a sweep), the per-stage summaries, stage 0 the base model's."""
    streamed = [r for r in (at_chosen_rates(results) if config.swept else results) if r.get("stream")]
    chosen = chosen_settings(results) if config.swept else {}
    base = _summaries(_stage_values([r for r in streamed if r["condition"] == "base"])).get(0, {})
    methods: dict[tuple, list[dict]] = {}
    for result in streamed:
        if result["condition"] != "base":
            methods.setdefault(result_variant(result), []).append(result)
    order = {condition: index for index, condition in enumerate(config.conditions)}
    rows = []
    for method, runs in sorted(methods.items(), key=lambda item: (order.get(item[0][0], 99), str(item[0]))):
        stages = {**({0: base} if base else {}), **_summaries(_stage_values(runs))}
        epochs, rate = chosen.get(method, (None, None))
        rows.append({"method": list(method), "lr": rate, **({"epochs": epochs} if epochs is not None else {}),
                     "seeds": sorted(r["seed"] for r in runs),
                     "stages": {str(stage): stages[stage] for stage in sorted(stages)}})
    return rows


def matched_records(results: list[dict], tasks: list[str]) -> list[dict]:
    """Each swept stream run as a matched-learning record: ``learned`` the last task's accuracy after the stream,
    the old facts, every earlier task's accuracy and, with more than one earlier task, their mean
    (:data:`EARLIER_MEAN`) as kept axes."""
    records = []
    for result in results:
        if result.get("lr") is None or not result.get("stream"):
            continue
        final = result["stream"]["stages"][-1]
        earlier = {f"task {task}": final["tasks"][task] for task in tasks[:-1]}
        if len(earlier) > 1:
            earlier[EARLIER_MEAN] = sum(earlier.values()) / len(earlier)
        records.append({**{k: result.get(k) for k in ("condition", "seed", "update", "reads", "variant", "lr",
                                                      "epochs")},
                        "metrics": {LEARNED: final["tasks"][tasks[-1]], OLD_KEY: final["metrics"].get(OLD_KEY),
                                    **earlier}})
    return records


def _cell(summary: dict | None, digits: int = 3) -> str:
    if not summary or summary.get("mean") is None:
        return "—"
    text = f"{summary['mean']:.{digits}f}"
    return text + ("" if summary.get("half_width") is None else f" ± {summary['half_width']:.{digits}f}")


def write_stream_report(config: SuiteConfig, results: list[dict], out_dir: Path,
                        label: Callable[[tuple, str], str]) -> list[Path]:
    """``stream.md`` / ``.json`` and ``stream_forgetting.png`` (module docstring); ``label``: method key, model ->
    its name in tables (:func:`smf.suite.report.variant_label`). Nothing when no results file has a stream."""
    streamed = [r for r in results if r.get("stream")]
    if not streamed:
        return []
    tasks = streamed[0]["stream"]["tasks"]
    old_title = metric_title(OLD_KEY, config.labels)
    rows = stage_rows(config, results)
    lines = ["# A stream of tasks\n",
             f"The new people in {len(tasks)} tasks ({', '.join(tasks)}) trained one after another, each stage from "
             "the previous stage's result (sparse: the memories so far, the retrofit's background statistics; LoRA: "
             "the adapter merged, a fresh one trained; full: continued). Each method at its chosen rate (the highest "
             f"mean task-{tasks[-1]} accuracy after the stream); ± is the 95% Student-t interval over seeds. Later "
             "tasks' columns before they are trained show what the model guesses.\n"]
    for row in rows:
        rate = ("" if row.get("epochs") is None else f", {row['epochs']} epochs") + (
            "" if row["lr"] is None else f", lr {row['lr']:g}")
        seeds = f"{len(row['seeds'])} seed" + "s" * (len(row["seeds"]) > 1)
        lines += [f"### {label(tuple(row['method']), config.model)}{rate} ({seeds})\n",
                  f"| After | {old_title} | {metric_title(HELDOUT_KEY, config.labels)} | "
                  + " | ".join(f"task {task}" for task in tasks) + " |",
                  "| --- | ---: | ---: | " + " | ".join("---:" for _ in tasks) + " |"]
        for stage, summary in sorted(row["stages"].items(), key=lambda item: int(item[0])):
            after = "base model" if stage == "0" else f"task {tasks[int(stage) - 1]}"
            lines.append(f"| {after} | {_cell(summary.get(OLD_KEY))} | {_cell(summary.get(HELDOUT_KEY), 2)} | "
                         + " | ".join(_cell(summary.get(task)) for task in tasks) + " |")
        lines.append("")
    matched = {}
    if config.matched_learning:
        records = matched_records(results, tasks)
        reference = result_variant({"condition": "full"})
        levels = [str(level) for level in config.matched_learning]
        lines += ["### Matched learning after the stream\n",
                  f"Kept at a given task-{tasks[-1]} accuracy after the whole stream, read off each seed's sweep "
                  "(interpolated between the two rates that bracket the level; k/n: only k of n seeds reached it; "
                  "—: none did); in brackets the difference to full finetuning, paired by seed.\n"]
        earlier = [f"task {task}" for task in tasks[:-1]]
        for axis in (OLD_KEY, *earlier, *([EARLIER_MEAN] if len(earlier) > 1 else [])):
            axis_rows = matched_learning(records, config.matched_learning, result_variant, LEARNED, axis, reference)
            order = {condition: index for index, condition in enumerate(config.conditions)}
            axis_rows.sort(key=lambda r: (order.get(r["method"][0], 99), str(r["method"])))
            matched[axis] = axis_rows
            title = old_title if axis == OLD_KEY else f"{axis} acc"
            lines += [f"#### {title} kept\n", "| Method | " + " | ".join(f"@ {level}" for level in levels) + " |",
                      "| --- | " + " | ".join("---:" for _ in levels) + " |"]
            for row in axis_rows:
                cells = []
                for level in levels:
                    cell = row["levels"][level]
                    text = format_cell(cell["mean"], cell["half_width"], cell["measured"], len(row["seeds"]))
                    diff = cell.get("vs_reference")
                    if diff:
                        text += " (" + format_cell(diff["mean"], diff["half_width"], diff["pairs"],
                                                   len(row["seeds"]), signed=True) + ")"
                    cells.append(text)
                lines.append(f"| {label(tuple(row['method']), config.model)} | " + " | ".join(cells) + " |")
            lines.append("")
    panels = [{"label": label(tuple(row["method"]), config.model),
               "points": {int(stage): {(OLD_FACTS if key == OLD_KEY else key): (s["mean"], s["half_width"])
                                       for key, s in summary.items() if key == OLD_KEY or key in tasks}
                          for stage, summary in row["stages"].items()}} for row in rows]
    png_path = plot_forgetting(panels, tasks, out_dir / "stream_forgetting.png", old_title=old_title)
    lines.append("![Forgetting along the stream](stream_forgetting.png)\n")
    md_path, json_path = out_dir / "stream.md", out_dir / "stream.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps({"tasks": tasks, "stages": rows, "matched_learning": matched,
                                     "levels": list(config.matched_learning)}, indent=1) + "\n", encoding="utf-8")
    return [md_path, json_path, png_path]
