"""``suite_status.md`` / ``.json``: every planned run of a suite, done, failed or pending, with its metrics
and seconds; rewritten by the runner after every run (:mod:`smf.suite.runner`)."""
from __future__ import annotations

import json
from pathlib import Path

from smf.report.paper_results import METRICS, OWN_METRICS, display_name, metric_title
from smf.suite.config import SuiteConfig
from smf.suite.finished import run_state
from smf.suite.plan import SuiteLayout, plan_runs


def _status_rows(config: SuiteConfig, layout: SuiteLayout, failed: dict[str, str]) -> list[dict]:
    rows = []
    for run in plan_runs(config):
        path = layout.results_path(run)
        row = {"condition": run.condition, "variant": run.variant, "update": run.update, "seed": run.seed, "lr": run.lr,
               "epochs": run.epochs,
               "status": "pending",
               "metrics": {},
               "train_s": None,
               "eval_s": None, "results": None}
        if run.name in failed:  # before the file: the report names results files it refused here
            row["status"] = f"failed: {failed[run.name]}"
        elif (state := run_state(layout, config, run)).state != "done":
            row["status"] = {"to do": "pending", "foreign": "refused: written by a suite with other settings",
                             "damaged": "pending: its results file is damaged"}[state.state]
        else:
            results = state.record
            timing = results["timing"]
            stages = [v for k, v in timing.items() if k in ("retrofit_s", "background_s", "train_s")]
            row.update(status="done", metrics=results["metrics"], results=str(path.relative_to(layout.root)),
                       train_s=sum(stages) if stages else None, eval_s=sum(timing["eval_s"].values()))
        rows.append(row)
    return rows


def cell(value, digits: int = 3) -> str:
    """A table cell: ``value`` with ``digits`` decimals, or a dash for None."""
    return "—" if value is None else f"{value:.{digits}f}"


def write_status(config: SuiteConfig, root: Path, failed: dict[str, str] | None = None) -> list[Path]:
    """``suite_status.md`` / ``.json``: every planned run, done / failed / pending, with its metrics and
    seconds (training counts the shared retrofit and background stages in full for each run that uses them).
    ``root``: the suite directory; ``failed``: run name -> error of runs that raised."""
    layout = SuiteLayout(Path(root))
    rows = _status_rows(config, layout, failed or {})
    done = sum(row["status"] == "done" for row in rows)
    metrics = OWN_METRICS if config.data.own else METRICS
    lines = [f"# Suite `{config.name}`: {done} of {len(rows)} runs done\n",
             f"Model `{config.model}`, protocol `{config.protocol}`, seeds {list(config.seeds)}, directory "
             f"`{layout.root}`.\n",
             "| Method | Seed | Status | " + " | ".join(metric_title(m, config.labels) for m in metrics)
             + " | Train s | Eval s | Results |",
             "| --- | ---: | --- | " + " | ".join("---:" for _ in metrics) + " | ---: | ---: | --- |"]
    for row in rows:
        values = " | ".join(cell(row["metrics"].get(metric)) for metric in metrics)
        method = display_name(row["condition"], config.model, row["variant"]) + (
            " (authors' update)" if row["update"] == "authors" else "")
        schedule = "" if row["epochs"] is None else f", {row['epochs']} epochs"
        method += "" if row["lr"] is None else f" (lr {row['lr']:g}{schedule})"
        lines.append(f"| {method} | {row['seed']} | {row['status']} | {values} | "
                     f"{cell(row['train_s'], 1)} | {cell(row['eval_s'], 1)} | {row['results'] or '—'} |")
    md_path, json_path = layout.root / "suite_status.md", layout.root / "suite_status.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return [md_path, json_path]
