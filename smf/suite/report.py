"""What a suite directory reports (``smf report``, and ``smf suite`` at its end): Table 1 and the Pareto figure
(:func:`smf.report.write_report`), the parameter accounting of the configured model, and the status of every
planned run. It reads the suite's config and plan, so it lives with the suite; :mod:`smf.report` holds the tables
and figures it draws, which know nothing of a suite.

Files written into the suite directory: ``table1.md``, ``table1.csv``, ``table1.tex``,
``pareto.png``, ``pareto.pdf``, ``accounting.md``, ``accounting.json``, ``suite_status.md``,
``suite_status.json``, and with ``authors_update`` runs ``ablation_update.md`` / ``.json`` (this
project's exact sparse update against the authors', see :func:`update_ablation`), and for a science suite with
``variants`` ``locality.md`` / ``.json`` (:mod:`smf.suite.locality_diagnostics`). The paper's
numbers stand beside ours only when the suite's model is the paper's (``Qwen/Qwen2.5-0.5B-Instruct``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from smf.errors import ConfigError
from smf.files import read_json_object
from smf.model.sizes import model_architecture
from smf.report import accounting_markdown, parameter_accounting, write_report
from smf.report.budget import cost_markdown, cost_rows, per_seed_markdown
from smf.report.equal_compute import configurations_within, seed_budgets, within_budget
from smf.report.hypotheses import evaluate_hypotheses, hypotheses_markdown, side_methods
from smf.report.matched_learning import format_cell, matched_learning
from smf.report.matched_plot import plot_matched
from smf.report.paper_results import HIGHER_IS_BETTER, display_name, metric_keys, metric_title
from smf.report.sweep_plot import plot_sweep
from smf.report.table import stat_text, summarize
from smf.suite.config import SuiteConfig, base_root, method_of, suite_config_from_dict
from smf.suite.finished import run_state
from smf.suite.locality_diagnostics import write_locality
from smf.suite.plan import SuiteLayout, plan_runs, stage_settings
from smf.suite.science import at_chosen_rates, learning_metric, sweep_rows
from smf.suite.science import variant as result_variant
from smf.suite.science_diagnostics import write_science_diagnostics
from smf.suite.status import cell, write_status
from smf.suite.stream_report import write_stream_report
from smf.vocabulary import DEFAULT_MODEL

logger = logging.getLogger(__name__)


def load_suite_dir(suite_dir: str | Path) -> SuiteConfig:
    """The config that last ran in ``suite_dir`` (its ``suite_config.json``)."""
    layout = SuiteLayout(Path(suite_dir))
    if not layout.config_file.is_file():
        raise ConfigError(f"--suite-dir {str(suite_dir)!r} is not a suite directory (no {layout.config_file.name}); "
                          "run `smf suite` first")
    return suite_config_from_dict(read_json_object(layout.config_file, "suite config record"))


def collect_results(layout: SuiteLayout, config: SuiteConfig) -> tuple[list[dict], dict[str, str], dict[str, str]]:
    """(results, refused, foreign): the results files of ``config``'s planned runs that were computed with
    ``config`` (same run hash), sorted by file name, each checked (:func:`smf.report.records.check_results_record`);
    the planned runs whose file the check refused, and those whose file another config wrote: run name -> why,
    in one line. Files of runs the config does not plan are skipped with a warning."""
    planned = {run.name: run for run in plan_runs(config)}
    results, refused, foreign = [], {}, {}
    for path in sorted(layout.results_dir.glob("*.json")):
        run = planned.get(path.stem)
        if run is None:
            logger.warning("skipping %s: not a run of this suite config", path)
            continue
        state = run_state(layout, config, run)  # the rule the runner follows too
        if state.state == "foreign":
            logger.warning("skipping %s: not a run of this suite config", path)
            foreign[run.name] = f"{state.why}; skipped"
        elif state.state == "damaged":
            refused[run.name] = state.why
        else:
            results.append(state.record)
    return results, refused, foreign


def table_records(results: list[dict], update: str = "exact") -> list[dict]:
    """Results files of runs with sparse ``update`` ("exact": Table 1; "authors": the ablation runs) ->
    the records of :mod:`smf.report.table`."""
    return [{"condition": r["condition"], "seed": r["seed"], **({"variant": r["variant"]} if r.get("variant") else {}),
             **r["metrics"]} for r in results if r.get("update", "exact") == update and not r.get("reads")]


def _cells(row: dict, metrics) -> list[str]:
    """The ``mean ± spread`` cells of a row's ``metrics`` (— where it was never measured)."""
    return ["—" if row["metrics"][m] is None else stat_text(row["metrics"][m]) for m in metrics]


UPDATE_NAMES = {"exact": "exact (this project)", "authors": "authors'"}


def update_ablation(results: list[dict], conditions) -> list[dict]:
    """One row per (condition, variant, update) of the ablation: mean ± std of the three metrics over seeds, and
    the mean per optimizer step of value rows selected and of rows moved outside the selection."""
    rows = []
    variants = list(dict.fromkeys(r.get("variant") for r in results))
    for condition, variant in [(condition, variant) for condition in conditions for variant in variants]:
        for update in ("exact", "authors"):
            runs = [r for r in results if r["condition"] == condition and r.get("update", "exact") == update
                    and not r.get("reads") and r.get("variant") == variant]
            if not runs:
                continue
            (summary,) = summarize(table_records(runs, update))
            steps = [r["sparse_steps"] for r in runs if r.get("sparse_steps")]
            rows.append({"condition": condition, "variant": variant, "update": update, "seeds": len(runs),
                         "metrics": summary.stats,
                         "selected_rows": sum(s["selected_rows"] for s in steps) / len(steps) if steps else None,
                         "rows_moved_outside": sum(s["rows_moved_outside"] for s in steps) / len(steps)
                         if steps else None})
    return rows


def write_update_ablation(config: SuiteConfig, results: list[dict], out_dir: Path) -> list[Path]:
    """``ablation_update.md`` / ``.json``: :func:`update_ablation` of the suite's ``authors_update`` conditions."""
    rows = update_ablation(at_chosen_rates(results) if config.swept else results, config.authors_update)
    metrics = metric_keys(r["metrics"] for r in results)
    arrows = {metric: "↑" if HIGHER_IS_BETTER[metric] else "↓" for metric in metrics}
    lines = ["# Sparse update ablation: this project's exact update vs the authors'\n",
             "Exact: rows chosen once per optimizer step from all its micro-batches (padding not counted), "
             "only they move (row-sparse AdamW). Authors': rows chosen per micro-batch (padding counted), each "
             "backward masked, dense AdamW, whose momentum keeps moving earlier rows. Rows are summed over the "
             "memory layers and averaged over steps and seeds.\n",
             "| Method | Update | Seeds | " + " | ".join(f"{metric_title(m, config.labels)} {arrows[m]}"
                                                          for m in metrics)
             + " | Rows selected / step | Rows moved outside the selection / step |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in metrics) + " | ---: | ---: |"]
    for row in rows:
        cells = _cells(row, metrics)
        lines.append(f"| {display_name(row['condition'], config.model, row['variant'])} | "
                     f"{UPDATE_NAMES[row['update']]} | "
                     f"{row['seeds']} | " + " | ".join(cells) + f" | {cell(row['selected_rows'], 1)} | "
                     f"{cell(row['rows_moved_outside'], 1)} |")
    md_path, json_path = out_dir / "ablation_update.md", out_dir / "ablation_update.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return [md_path, json_path]


def write_sweep_table(config: SuiteConfig, results: list[dict], out_dir: Path) -> list[Path]:
    """``lr_sweep.md`` / ``.json``: every (condition, rate) of the sweep, mean ± 95% interval over seeds, the rate
    Table 1 reports marked (:func:`smf.suite.science.chosen_rates`)."""
    rows = [row for row in sweep_rows(results) if row["lr"] is not None]
    metrics = metric_keys(r["metrics"] for r in results)
    arrows = {metric: "↑" if HIGHER_IS_BETTER[metric] else "↓" for metric in metrics}
    budget = ", ".join([f"{recipe} {list(rates)}" for recipe, rates in config.lr_sweep.items()]
                       + [f"{recipe} (epochs: rates) {dict(schedule)}" for recipe, schedule in
                          config.schedule_sweep.items()]
                       + [f"{name} {list(options['lr_sweep'])}" if "lr_sweep" in options else
                          f"{name} (epochs: rates) {dict(options['schedule_sweep'])}"
                          for name, options in config.variants.items()])
    lines = ["# Learning-rate sweep\n",
             f"Every method gets the same number of learning rates ({budget}), each run for every seed; Table 1 "
             f"reports each method at the rate with the highest mean {metric_title(learning_metric(results), config.labels)} "
             "(marked ✓; ties: the lower rate). ± is the 95% Student-t interval of the mean over seeds.\n",
             "| Method | LR | Chosen | Seeds | " + " | ".join(f"{metric_title(m, config.labels)} {arrows[m]}"
                                                      for m in metrics) + " |",
             "| --- | ---: | :---: | ---: | " + " | ".join("---:" for _ in metrics) + " |"]
    order = {condition: index for index, condition in enumerate(config.conditions)}
    variants = {name: index for index, name in enumerate(config.variants)}
    for row in sorted(rows, key=lambda r: (order.get(r["condition"], 99), variants.get(r["variant"], -1), r["update"],
                                           r["reads"], r.get("epochs") or 0, r["lr"])):
        cells = _cells(row, metrics)
        method = variant_label((row["condition"], row["update"], row["reads"], row["variant"]), config.model)
        method += f", {row['epochs']} epochs" if row.get("epochs") else ""
        lines.append(f"| {method} | {row['lr']:g} | {'✓' if row['chosen'] else ''} | {row['seeds']} | "
                     + " | ".join(cells) + " |")
    learning = learning_metric(results)
    base = next((row["metrics"] for row in sweep_rows(results) if row["condition"] == "base"), None)
    figure = plot_sweep([row for row in rows if row["update"] == "exact"], base, out_dir / "pareto_sweep.png",
                        learning=learning, forgetting=[m for m in metrics if m != learning], model=config.model,
                        labels=config.labels)
    lines.append("\n![Every rate of every method](pareto_sweep.png)\n")
    md_path, json_path = out_dir / "lr_sweep.md", out_dir / "lr_sweep.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return [md_path, json_path, figure]


def _variant_sizes(config: SuiteConfig) -> str:
    """What the accounting's header adds for a suite with ``variants``: each variant's options (its runs differ from
    the counts below by them)."""
    if not config.variants:
        return ""
    options = ["{}: {}".format(name, ", ".join(f"{key}={value}" for key, value in config.variant_options(name).items())
                               or "as configured") for name in config.variants]
    return f"; the variants set ({'; '.join(options)})"


def write_accounting(config: SuiteConfig, out_dir: Path) -> list[Path]:
    """Parameter accounting of the configured model and memory sizes (modules on the meta device)."""
    retrofit = stage_settings(config, "retrofit")
    rows_per_step = stage_settings(config, "sparse").rows_per_step
    lora_rank = stage_settings(config, "lora").lora_r
    try:
        architecture = model_architecture(config.model)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model {config.model!r}: cannot read its config for the parameter accounting "
                          f"({err})") from err
    rows = parameter_accounting(architecture, layers=tuple(retrofit.layers),
                                rows_per_step=rows_per_step, lora_rank=lora_rank, n_keys=retrofit.n_keys,
                                heads=retrofit.heads, topk=retrofit.topk, key_dim=retrofit.key_dim)
    base_parameters = rows[0].updated_per_step  # full finetuning updates every base parameter
    header = (f"Parameter accounting for `{config.model}` ({base_parameters:,} parameters): memories at layers "
              f"{list(retrofit.layers)}, n_keys={retrofit.n_keys}, heads={retrofit.heads}, topk={retrofit.topk}, "
              f"key_dim={retrofit.key_dim}; T={rows_per_step or '3.1% of the slots, at most 512'} rows per layer per step; "
              f"LoRA r={lora_rank}{_variant_sizes(config)}.\n\n")
    md_path, json_path = out_dir / "accounting.md", out_dir / "accounting.json"
    md_path.write_text(header + accounting_markdown(rows, base_parameters), encoding="utf-8")
    json_path.write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=2) + "\n", encoding="utf-8")
    return [md_path, json_path]


def write_reads_ablation(config: SuiteConfig, results: list[dict], out_dir: Path) -> list[Path]:
    """``ablation_reads.md`` / ``.json``: the ``count_reads_ablation`` conditions with the config's read counting
    and with ``count_reads: loss``, each at its own chosen rate (with a sweep), mean ± 95% interval over seeds."""
    chosen = at_chosen_rates(results) if config.swept else results
    rows = [row for row in sweep_rows([r for r in chosen if r.get("update", "exact") == "exact"])
            if row["condition"] in config.count_reads_ablation]
    metrics = metric_keys(r["metrics"] for r in results)
    arrows = {metric: "↑" if HIGHER_IS_BETTER[metric] else "↓" for metric in metrics}
    default = config.train.get("count_reads", "all")
    lines = ["# Read counting ablation: which reads choose the rows\n",
             f"`{default}` (the config's): every non-padding token's reads count towards the rows a step trains; "
             "`loss`: only the reads at positions whose next token the loss scores. Each at its own chosen learning "
             "rate; ± is the 95% interval over seeds.\n",
             "| Method | Reads counted | LR | Seeds | " + " | ".join(f"{metric_title(m, config.labels)} {arrows[m]}"
                                                              for m in metrics) + " |",
             "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in metrics) + " |"]
    variants = {name: index for index, name in enumerate(config.variants)}
    for row in sorted(rows, key=lambda r: (config.conditions.index(r["condition"]), variants.get(r["variant"], -1),
                                           r["reads"] != "all")):
        cells = _cells(row, metrics)
        reads = default if row["reads"] == "all" else row["reads"]
        rate = "—" if row["lr"] is None else f"{row['lr']:g}"
        lines.append(f"| {display_name(row['condition'], config.model, row['variant'])} | {reads} | {rate} | "
                     f"{row['seeds']} | "
                     + " | ".join(cells) + " |")
    md_path, json_path = out_dir / "ablation_reads.md", out_dir / "ablation_reads.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return [md_path, json_path]


def write_matched_learning(config: SuiteConfig, results: list[dict], out_dir: Path) -> list[Path]:
    """``matched_learning.md`` / ``.json``: old knowledge kept at each ``matched_learning`` level of new-task learning,
    per method, read off each seed's sweep (:mod:`smf.report.matched_learning`), and the paired difference to full
    finetuning."""
    learn = learning_metric(results)
    kept = "retain_acc"
    if not any(kept in r["metrics"] for r in results):
        return []
    reference = result_variant({"condition": "full"})
    rows = _sorted(config, matched_learning(results, config.matched_learning, result_variant, learn, kept, reference))
    levels = [str(level) for level in config.matched_learning]
    title = metric_title(kept, config.labels)
    lines = ["# Forgetting at matched learning\n",
             f"{title} kept when each method has learned a given {metric_title(learn, config.labels)}, interpolated "
             "between the two learning rates of each seed's sweep that bracket the level; mean ± 95% Student-t "
             "interval over the seeds that reached it (k/n: only k of n seeds' sweeps measured the level; — : none "
             "did, the level lies above every rate's learning or below the lowest rate's). Second table: the "
             "difference to full finetuning, paired by seed.\n"]
    lines += _matched_tables(config, rows, levels, reference)
    labels = {tuple(row["method"]): variant_label(row["method"], config.model) for row in rows}
    compute_rows = equal_compute_section(config, results, learn, kept, reference, lines)
    evaluated = hypotheses_section(config, {"configurations": rows, "compute": compute_rows}, lines)
    lines += [""] + per_seed_markdown(rows, levels, labels, tuple(reference) if tuple(reference) in labels else None)
    lines += cost_markdown(cost_rows(results, result_variant), rows, levels, labels)
    lines.append("\n![Forgetting at matched learning](matched_learning.png)\n")
    png_path = plot_matched(rows, levels, {tuple(row["method"]): variant_label(row["method"], config.model)
                                           for row in rows}, out_dir / "matched_learning.png",
                            learn_title=metric_title(learn, config.labels), kept_title=title)
    md_path, json_path = out_dir / "matched_learning.md", out_dir / "matched_learning.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps({"learn_metric": learn, "kept_metric": kept, "levels": config.matched_learning,
                                     "rows": rows, **({"equal_compute_rows": compute_rows} if compute_rows else {}),
                                     **({"hypotheses": evaluated} if evaluated else {})}, indent=1)
                         + "\n", encoding="utf-8")
    return [md_path, json_path, png_path]


def _sorted(config: SuiteConfig, rows: list[dict]) -> list[dict]:
    """Matched-learning ``rows`` in the order of the config's conditions (then by method)."""
    return sorted(rows, key=lambda row: (config.conditions.index(row["method"][0]) if row["method"][0] in
                                         config.conditions else len(config.conditions), row["method"]))


def _matched_tables(config: SuiteConfig, rows: list[dict], levels: list[str], reference: tuple) -> list[str]:
    """The kept table of the matched-learning ``rows`` (one row per method) and, where any method has one, the
    table of paired differences to ``reference`` (full finetuning)."""
    lines = ["| Method | " + " | ".join(f"kept @ {level}" for level in levels) + " |",
             "| --- | " + " | ".join("---:" for _ in levels) + " |"]
    for row in rows:
        cells = [format_cell(c["mean"], c["half_width"], c["measured"], len(row["seeds"]))
                 for c in (row["levels"][level] for level in levels)]
        lines.append(f"| {variant_label(row['method'], config.model)} | " + " | ".join(cells) + " |")
    if any("vs_reference" in c for row in rows for c in row["levels"].values()):
        lines += ["", "| Method − full finetuning | " + " | ".join(f"@ {level}" for level in levels) + " |",
                  "| --- | " + " | ".join("---:" for _ in levels) + " |"]
        for row in rows:
            if tuple(row["method"]) == tuple(reference):
                continue
            cells = []
            for level in levels:
                diff = row["levels"][level].get("vs_reference")
                cells.append("—" if not diff else format_cell(diff["mean"], diff["half_width"], diff["pairs"],
                                                             len(row["seeds"]), signed=True))
            lines.append(f"| {variant_label(row['method'], config.model)} | " + " | ".join(cells) + " |")
    return lines


def _method_key(spec: str) -> tuple:
    """The report's method key (:func:`smf.suite.science.variant`) of a method ``condition[/variant]``."""
    condition, variant = method_of(spec)
    return condition, "exact", "all", variant


def equal_compute_section(config: SuiteConfig, results: list[dict], learn: str, kept: str, reference: tuple,
                          lines: list[str]) -> list[dict]:
    """With ``equal_compute`` in ``config``: the matched-learning rows of the equal-compute envelope
    (:mod:`smf.report.equal_compute`), its section appended to ``lines``; none without."""
    if not config.equal_compute:
        return []
    budgets = seed_budgets(results, result_variant, _method_key(config.equal_compute))
    inside = within_budget(results, budgets)
    rows = _sorted(config, matched_learning(inside, config.matched_learning, result_variant, learn, kept, reference))
    counts = configurations_within(results, budgets, result_variant)
    levels = [str(level) for level in config.matched_learning]
    budget_text = ", ".join(f"seed {seed}: {budget:.1f}" for seed, budget in sorted(budgets.items()))
    lines += ["", "## Equal compute\n",
              f"The same, each method reading only its runs whose compute (CPU seconds of training, plus for a sparse "
              f"run the whole retrofit and background it starts from) is at most that of "
              f"{variant_label(_method_key(config.equal_compute), config.model)}'s costliest run of the seed (the "
              f"budget, CPU-s: {budget_text or 'none recorded'}; smf/report/equal_compute.py). Runs within the "
              "budget, over all seeds: " + "; ".join(f"{variant_label(method, config.model)} {count}"
                                                    for method, count in counts.items()) + ".\n"]
    lines += _matched_tables(config, rows, levels, reference)
    return rows


def hypotheses_section(config: SuiteConfig, rows: dict[str, list[dict]], lines: list[str]) -> list[dict]:
    """With ``hypotheses`` in ``config``: their evaluation (:mod:`smf.report.hypotheses`) on the matched-learning
    rows of their envelope (``rows``: envelope name -> rows; "configurations", and "compute" for the equal-compute
    envelope), its section appended to ``lines`` (the tables above are then labelled exploratory); returns the
    evaluated hypotheses in the config's order (none without)."""
    if not config.hypotheses:
        return []
    specs = {spec for hypothesis in config.hypotheses.values() for side in (hypothesis["a"], hypothesis["b"])
             for spec in side_methods(side)}
    methods = {spec: _method_key(spec) for spec in specs}
    evaluated = [evaluate_hypotheses({name: hypothesis}, rows[hypothesis.get("envelope", "configurations")], methods,
                                     len(config.seeds))[0] for name, hypothesis in config.hypotheses.items()]
    record = SuiteLayout(config.output_dir).hypotheses_file
    registered = read_json_object(record, "hypotheses record", ("registered_at", "runs_finished", "runs_planned")) \
        if record.is_file() else None
    lines += ["", "The tables above are **exploratory** except for the pre-registered contrasts below.", ""]
    lines += hypotheses_markdown(evaluated, {spec: variant_label(key, config.model) for spec, key in methods.items()},
                                 registered)
    return evaluated


def write_environment(config: SuiteConfig, results: list[dict], out_dir: Path) -> list[Path]:
    """``environment.md`` / ``.json``: what computed the results (each distinct environment recorded in a results
    file, with its number of runs) and, for a suite with a world, each base: its fingerprint, where it came from,
    its pretraining, and its own metrics (the base condition's run of that seed)."""
    environments: list[tuple[dict, int]] = []
    for result in results:
        env = result.get("environment") or {}
        for index, (known, count) in enumerate(environments):
            if known == env:
                environments[index] = (known, count + 1)
                break
        else:
            environments.append((env, 1))
    lines = ["# Environment\n"]
    if len(environments) > 1:
        lines.append(f"**The results come from {len(environments)} different environments** (runs of another "
                     "machine or version were mixed into this directory).\n")
    for env, count in environments:
        described = ", ".join(f"{k} {v}" for k, v in env.items() if v is not None) or "not recorded (older runs)"
        lines.append(f"- {count} run(s): {described}")
    bases = []
    if config.world and config.pretrain:
        for seed in (config.seeds if config.base_per_seed else (None,)):
            marker_path = base_root(config.output_dir, seed) / "pretrain" / "pretrain_stage.json"
            marker = json.loads(marker_path.read_text()) if marker_path.is_file() else {}
            own = [r for r in results if r["condition"] == "base" and (seed is None or r["seed"] == seed)]
            bases.append({"seed": seed, "fingerprint": marker.get("fingerprint"), "source": marker.get("source"),
                          "epochs_trained": marker.get("epochs_trained"),
                          "pretrain_old_qa_accuracy": marker.get("old_qa_accuracy"),
                          "metrics": own[0]["metrics"] if own else None})
        metrics = metric_keys(b["metrics"] for b in bases if b["metrics"])
        lines += ["", "| Base (world and pretraining seed) | fingerprint | source | epochs | "
                  + " | ".join(metric_title(m, config.labels) for m in metrics) + " |",
                  "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in metrics) + " |"]
        for base in bases:
            values = [("—" if not base["metrics"] or base["metrics"].get(m) is None else f"{base['metrics'][m]:.3f}")
                      for m in metrics]
            lines.append(f"| {'shared' if base['seed'] is None else base['seed']} | `{base['fingerprint']}` | "
                         f"{base['source']} | {base['epochs_trained']} | " + " | ".join(values) + " |")
    md_path, json_path = out_dir / "environment.md", out_dir / "environment.json"
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    json_path.write_text(json.dumps({"environments": [{"runs": c, **e} for e, c in environments], "bases": bases},
                                    indent=1) + "\n", encoding="utf-8")
    return [md_path, json_path]


def variant_label(method, model: str) -> str:
    """A method key of :func:`smf.suite.science.variant` as a table label."""
    condition, update, reads, variant = method
    return (display_name(condition, model, variant) + (" (authors' update)" if update == "authors" else "")
            + (f" ({reads} reads)" if reads != "all" else ""))


def write_report_page(config: SuiteConfig, out_dir: Path) -> Path:
    """``report.md``: the suite's ``notice`` (what its numbers mean), Table 1, the figure, and the other tables
    written beside them (the learning-rate sweep, the update ablation, the science diagnostics, the status)."""
    ci = config.swept
    spread = ("the 95% Student-t interval of the mean over seeds; each method at its chosen learning rate "
              "(lr_sweep.md)" if ci else "the sample standard deviation over seeds")
    lines = [f"# Suite `{config.name}`\n"]
    if config.notice:
        lines.append(f"> **{config.notice.strip()}**\n")
    lines.append(f"Model `{config.model}`, protocol `{config.protocol}`, seeds {list(config.seeds)}.\n")
    if (out_dir / "table1.md").is_file():
        lines += [f"## Table 1\n\n± is {spread}.\n", (out_dir / "table1.md").read_text(encoding="utf-8"),
                  "![Pareto figure](pareto.png)\n"]
    else:
        lines.append("## Table 1\n\nNo run has results yet (suite_status.md says which ran and which failed).\n")
    for name in ("stream.md",  # a stream suite's answer first
                 "matched_learning.md", "environment.md", "lr_sweep.md", "science_diagnostics.md", "locality.md",
                 "ablation_reads.md", "ablation_update.md", "accounting.md"):
        if (out_dir / name).is_file():
            text = (out_dir / name).read_text(encoding="utf-8")
            lines.append("#" + text if text.startswith("# ") else text)
    lines.append("Every run: suite_status.md.\n")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def write_result_tables(config: SuiteConfig, results: list[dict], out_dir: Path) -> list[Path]:
    """The tables the results records alone give (no stage or model files read): Table 1 and the Pareto figure, the
    sweep, matched learning with the hypotheses (their registration record read from ``config.output_dir``), the
    environment, the ablations the config has and a stream's report; returns the paths written into ``out_dir``."""
    include_paper = config.model == DEFAULT_MODEL and not config.data.own  # the paper's numbers: the paper's data
    sweep = config.swept  # Table 1 at each condition's chosen rate, 95% intervals (smf.suite.science)
    paths = write_report(table_records(at_chosen_rates(results) if sweep else results), out_dir,
                         include_paper=include_paper, model=config.model, labels=config.labels, intervals=sweep)
    if sweep:
        paths += write_sweep_table(config, results, out_dir)
    if config.matched_learning:
        paths += write_matched_learning(config, results, out_dir)
    paths += write_environment(config, results, out_dir)
    if config.authors_update:
        paths += write_update_ablation(config, results, out_dir)
    if config.count_reads_ablation:
        paths += write_reads_ablation(config, results, out_dir)
    if config.stream:  # tasks one after another: each stage's accuracies, forgetting curves (the records' stages)
        paths += write_stream_report(config, results, out_dir, variant_label)
    return paths


def write_suite_report(suite_dir: str | Path) -> list[Path]:
    """Table 1, the Pareto figure, the accounting and the status of the suite in ``suite_dir``; returns
    the paths written. A results file that fails its check (:mod:`smf.report.records`) is left out of the
    tables and shown as failed in the status, the others' report is written, and then a ConfigError names the
    file and field in one line."""
    config = load_suite_dir(suite_dir)
    layout = SuiteLayout(Path(suite_dir))
    results, refused, foreign = collect_results(layout, config)
    if not results and not refused:
        raise ConfigError(f"--suite-dir {str(suite_dir)!r} holds no finished run (results/*.json) to report")
    paths = []
    if results:
        paths += write_result_tables(config, results, layout.root)
        if config.world:  # the science preset: do the memories matter, and what carries the +S forgetting
            paths += write_science_diagnostics(config, results, layout.root)
        if config.world and config.variants:  # the locality experiment: which rows moved, which old facts went
            paths += write_locality(config, results, layout.root)
    paths += write_accounting(config, layout.root)
    paths += write_status(config, layout.root, failed={**foreign, **refused})
    paths.append(write_report_page(config, layout.root))
    logger.info("report of %d runs written to %s", len(results), layout.root)
    if refused:
        first, *others = refused.values()
        more = f" (and {len(others)} more refused: {', '.join(list(refused)[1:])})" if others else ""
        raise ConfigError(f"{first}{more}; the report of the other {len(results)} runs is in {layout.root}")
    return paths
