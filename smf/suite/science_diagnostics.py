"""``science_diagnostics.md`` / ``.json``: whether the memories take part in the model's predictions (issue 32, trap 1)
and what carries the +S runs' forgetting (docs/science.md).

- For every retrofit (mode, seed) and every sparse run at its chosen rate: :func:`smf.model.memory_diagnostics` on QA
  texts of the world (the first :data:`PROBE_ROWS` old facts of ``eval_retain`` and new facts of ``eval_learn``): per
  layer alpha, the memory branch's share of the block output, KL(on || off) and top-1 agreement with every branch
  switched off, read entropy as a fraction of log(slots), slots read.
- For every +S run at its chosen rate: the same model with each layer's alpha put back to its retrofit value (the
  rows keep what they learned), evaluated like the runs; the gap to the run's own numbers is what the grown alpha
  carries.
- For every retrofit: its read overlap (issue 48; :func:`smf.suite.locality_diagnostics.read_overlap`): the share of
  the old questions' (``eval_retain``) read weight on slots the new questions (``eval_learn``) also read, over all
  tokens and at the answer position. Near 1, no row is the new facts' alone.
- With a held-out old-fact probe (``eval_retain_heldout``: a world with ``retain_heldout``): old-fact accuracy asked
  as in training (``retain_acc``, the leaky probe) beside asked with a template no training text holds
  (``retain_heldout_acc``), per method at its chosen rate and at matched learning.

The measurements are cached in the JSON by run name and results hash, so re-drawing a report recomputes nothing.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from smf.data.eval_sets import triviaqa_prompt
from smf.data.own_data import load_own
from smf.data.sources import load_split
from smf.data.world import qa_text
from smf.eval.tasks import evaluate_model, load_eval_sets
from smf.model.attach import memory_blocks
from smf.model.diagnostics import memory_diagnostics
from smf.model.loading import load_model
from smf.report.matched_learning import format_cell, matched_learning
from smf.report.paper_results import display_name, metric_keys, metric_title
from smf.suite.config import seed_config
from smf.suite.locality_diagnostics import OVERLAPS, new_question_prompts, question_reads, retrofit_read_overlap
from smf.suite.plan import Run, SuiteLayout, sparse_stage_dirs, start_name
from smf.suite.science import at_chosen_rates, learning_metric, variant
from smf.train.distributed import pick_device

PROBE_ROWS = 64  # QA texts of each kind (old, new) the diagnostics are measured on
DIAGNOSTICS_JSON, DIAGNOSTICS_MD = "science_diagnostics.json", "science_diagnostics.md"


def _probe_batches(config, tokenizer, device) -> list[dict]:
    """Batches of 32 right-padded QA texts: old facts (eval_retain), then new facts (eval_learn)."""
    texts = []
    for path in (config.data.eval_retain, config.data.eval_learn):
        rows = load_split("own", None, "train", path)
        texts += [qa_text(row["question"], row["answers"][0]) for row in rows.select(range(min(PROBE_ROWS,
                                                                                              len(rows))))]
    batches = []
    for start in range(0, len(texts), 32):
        encoded = tokenizer(texts[start:start + 32], padding=True, return_tensors="pt")
        batches.append({"input_ids": encoded["input_ids"].to(device),
                        "attention_mask": encoded["attention_mask"].to(device)})
    return batches


def _measure(config, run_dir: Path, device) -> dict:
    model, tokenizer = load_model(config.model, run_dir, device)
    diagnostics = memory_diagnostics(model, _probe_batches(config, tokenizer, device), warn=False).to_dict()
    del model
    return diagnostics


def _alpha_reset_metrics(config, run_dir: Path, retrofit_dir: Path, eval_sets, out_dir: Path, device) -> dict:
    """Metrics of the +S model in ``run_dir`` with every alpha set back to the retrofit's in ``retrofit_dir``."""
    retrofit, _ = load_model(config.model, retrofit_dir, device)
    alphas = {block.layer_index: float(block.alpha) for block in memory_blocks(retrofit)}
    del retrofit
    model, tokenizer = load_model(config.model, run_dir, device)
    with torch.no_grad():
        for block in memory_blocks(model):
            block.alpha.fill_(alphas[block.layer_index])
    metrics, _ = evaluate_model(model, tokenizer, eval_sets, config.eval, out_dir, config.protocol)
    return {"alpha_retrofit": alphas, "metrics": metrics}


def _retrofit_overlap(config, retrofit_dir: Path, device) -> dict | None:
    """The read overlap of the retrofit in ``retrofit_dir`` between the old and the new questions (None without a
    qa ``eval_retain`` and ``eval_learn``)."""
    if not (config.data.eval_retain and config.data.eval_learn):
        return None
    rows, schema = load_own(config.data.eval_retain, "data.eval_retain", ("qa", "mc"))
    if schema != "qa":
        return None
    model, tokenizer = load_model(config.model, retrofit_dir, device)
    old = question_reads(model, tokenizer, [triviaqa_prompt(row, config.protocol) for row in rows])
    overlap = retrofit_read_overlap(model, tokenizer, old, new_question_prompts(config))
    del model
    return overlap


def _retrofit_metrics(config, retrofit_dir: Path, eval_sets, out_dir: Path, device) -> dict:
    """The retrofit model's metrics (memories attached, nothing finetuned): the reference of the sparse runs'
    forgetting, as the base model is LoRA's and full finetuning's."""
    model, tokenizer = load_model(config.model, retrofit_dir, device)
    metrics, _ = evaluate_model(model, tokenizer, eval_sets, config.eval, out_dir, config.protocol)
    return metrics


def compute_diagnostics(config, results: list[dict], root: Path) -> dict:
    """The measurements of the module docstring for ``results`` (the suite's runs), reusing cached ones."""
    layout, device = SuiteLayout(root), pick_device(config.device)
    path = root / DIAGNOSTICS_JSON
    cache = json.loads(path.read_text()) if path.is_file() else {}
    measured: dict = {"retrofit": {}, "sparse": {}, "alpha_reset": {}}
    eval_sets: dict = {}  # per world (per seed with base_per_seed)
    sparse = [r for r in at_chosen_rates(results) if r.get("sparse_steps") is not None and not r.get("reads")
              and r.get("update", "exact") == "exact"]
    for result in sparse:
        run = Run.of_results(result)
        own = seed_config(config, run.seed)
        if own.data not in eval_sets:
            eval_sets[own.data] = load_eval_sets(own.data, own.eval, own.protocol)
        retrofit_dir = sparse_stage_dirs(layout, run, own)[0]
        key = start_name(run, own)
        if key not in measured["retrofit"]:
            entry = cache.get("retrofit", {}).get(key) or _measure(own, retrofit_dir, device)
            if "metrics" not in entry:
                entry["metrics"] = _retrofit_metrics(own, retrofit_dir, eval_sets[own.data],
                                                     root / "eval-retrofit" / key, device)
            if "read_overlap" not in entry:
                entry["read_overlap"] = _retrofit_overlap(own, retrofit_dir, device)
            measured["retrofit"][key] = entry
        cached = cache.get("sparse", {}).get(run.name)
        measured["sparse"][run.name] = cached if cached and cached.get("hash") == result["config_hash"] else {
            "hash": result["config_hash"], "condition": run.condition, "variant": run.variant, "seed": run.seed,
            **_measure(own, layout.train_dir(run), device)}
        if run.mode == "additive+s":
            cached = cache.get("alpha_reset", {}).get(run.name)
            if not (cached and cached.get("hash") == result["config_hash"]):
                cached = {"hash": result["config_hash"], "condition": run.condition, "variant": run.variant,
                          "seed": run.seed, "trained": result["metrics"],
                          **_alpha_reset_metrics(own, layout.train_dir(run), retrofit_dir,
                                                 eval_sets[own.data], root / "eval-alpha-reset" / run.name, device)}
            measured["alpha_reset"][run.name] = cached
    path.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
    return measured


def _mean(values) -> str:
    values = [v for v in values if v is not None]
    return "—" if not values else f"{statistics.fmean(values):.3g}"


def _diagnostic_cells(entries: list[dict]) -> list[str]:
    """Mean over seeds (and layers) of alpha, branch share, KL all off, top-1 agreement all off, read entropy
    fraction, slots read."""
    layers = [layer for entry in entries for layer in entry["layers"]]
    return [_mean(layer["alpha"] for layer in layers), _mean(layer["branch_share"] for layer in layers),
            _mean(entry["kl_all_off"] for entry in entries), _mean(entry["top1_agreement_all_off"] for entry in entries),
            _mean(layer["read_entropy_fraction"] for layer in layers), _mean(layer["slots_read"] for layer in layers)]


def write_science_diagnostics(config, results: list[dict], root: Path) -> list[Path]:
    """Compute (or reuse) the diagnostics and write ``science_diagnostics.md`` / ``.json`` into ``root``."""
    measured = compute_diagnostics(config, results, root)
    lines = ["# Do the memories matter? Retrofit and sparse-run diagnostics\n",
             f"Measured on {PROBE_ROWS} old-fact and {PROBE_ROWS} new-fact QA texts; means over seeds and memory layers. "
             "Branch share: RMS of the memory branch over RMS of the block output. KL / top-1: the next-token "
             "distribution with every memory branch switched off against on (KL in nats per token; top-1: share of "
             "tokens whose argmax stays). Read entropy: over the slots, as a fraction of log(slots). A branch with KL "
             "under 1e-3 is inert (smf.model.diagnostics).\n",
             "| Model | Seeds | alpha | Branch share | KL off | Top-1 kept | Read entropy | Slots read |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_mode: dict[str, list] = {}
    for key, entry in measured["retrofit"].items():
        by_mode.setdefault(key.rsplit("-seed", 1)[0], []).append(entry)
    for mode, entries in sorted(by_mode.items()):
        lines.append(f"| retrofit ({mode}) | {len(entries)} | " + " | ".join(_diagnostic_cells(entries)) + " |")
    by_condition: dict[tuple, list] = {}
    for entry in measured["sparse"].values():
        by_condition.setdefault((entry["condition"], entry.get("variant")), []).append(entry)
    for (condition, variant), entries in sorted(by_condition.items(),
                                                key=lambda item: config.conditions.index(item[0][0])):
        lines.append(f"| {display_name(condition, config.model, variant)}, trained | {len(entries)} | "
                     + " | ".join(_diagnostic_cells(entries)) + " |")
    retrofits = list(measured["retrofit"].values())
    if retrofits:
        metrics = metric_keys(entry["metrics"] for entry in retrofits)
        lines += ["\n## The retrofit alone\n",
                  "The retrofit models (memories attached and trained on old text, nothing finetuned) evaluated like "
                  "the runs: the starting point of the sparse runs, as the base model is LoRA's and full "
                  "finetuning's. Means over seeds.\n",
                  "| Retrofit | Seeds | " + " | ".join(metric_title(m, config.labels) for m in metrics) + " |",
                  "| --- | ---: | " + " | ".join("---:" for _ in metrics) + " |"]
        for mode, entries in sorted(by_mode.items()):
            lines.append(f"| {mode} | {len(entries)} | " + " | ".join(
                _mean(e["metrics"][m] for e in entries) for m in metrics) + " |")
    resets = list(measured["alpha_reset"].values())
    if resets:
        metrics = metric_keys(entry["trained"] for entry in resets)
        lines += ["\n## +S: the trained rows with alpha put back to the retrofit's\n",
                  "Each +S run at its chosen rate, evaluated as trained and with every layer's alpha reset to its "
                  "value after the retrofit (the rows keep what they learned). Means over seeds.\n",
                  "| Method | Seeds | alpha trained | alpha retrofit | " + " | ".join(
                      f"{metric_title(m, config.labels)} trained | reset" for m in metrics) + " |",
                  "| --- | ---: | ---: | ---: | " + " | ".join("---: | ---:" for _ in metrics) + " |"]
        by_reset: dict[tuple, list] = {}
        for entry in resets:
            by_reset.setdefault((entry["condition"], entry.get("variant")), []).append(entry)
        for (condition, variant), entries in by_reset.items():
            trained_alpha = [layer["alpha"] for name, entry in measured["sparse"].items() if
                             (entry["condition"], entry.get("variant")) == (condition, variant)
                             for layer in entry["layers"]]
            retrofit_alpha = [alpha for entry in entries for alpha in entry["alpha_retrofit"].values()]
            cells = [f"{_mean(e['trained'][m] for e in entries)} | {_mean(e['metrics'][m] for e in entries)}"
                     for m in metrics]
            lines.append(f"| {display_name(condition, config.model, variant)} | {len(entries)} | "
                         f"{_mean(trained_alpha)} | "
                         f"{_mean(retrofit_alpha)} | " + " | ".join(cells) + " |")
    lines += _overlap_lines(by_mode) + _heldout_probe_lines(config, results)
    md_path = root / DIAGNOSTICS_MD
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [md_path, root / DIAGNOSTICS_JSON]


def _overlap_lines(by_mode: dict[str, list[dict]]) -> list[str]:
    """The read overlap of the retrofits (per mode: mean over seeds, and each seed's), none when not measured."""
    rows = {mode: [e["read_overlap"]["overall"] for e in entries if e.get("read_overlap")]
            for mode, entries in sorted(by_mode.items())}
    if not any(rows.values()):
        return []
    lines = ["\n## Read overlap: do the new questions read rows of their own?\n",
             "Per retrofit, the share of the old-fact questions' read weight (every prompt token and head, both "
             "memory layers) that falls on slots the new-fact questions also read; answer: at each old question's last "
             "token, against the slots the new questions' last tokens read. Mean over the old questions, then over "
             "seeds (each seed's in brackets). Near 1, every row an old fact reads is one the new facts read too: "
             "row-disjoint locality cannot be tested on that world (smf/suite/locality_diagnostics.py).\n",
             "| Retrofit | Seeds | Read overlap | Answer read overlap |", "| --- | ---: | ---: | ---: |"]
    for mode, overlaps in rows.items():
        if overlaps:
            lines.append(f"| {mode} | {len(overlaps)} | " + " | ".join(
                f"{_mean(o[share] for o in overlaps)} ({', '.join(f'{o[share]:.3f}' for o in overlaps)})"
                for share in OVERLAPS) + " |")
    return lines


def _heldout_probe_lines(config, results: list[dict]) -> list[str]:
    """Old-fact accuracy asked as in training beside asked with the held-out template, per method: at its chosen
    rate and (with ``matched_learning``) at each learning level; none without ``retain_heldout_acc``."""
    if not any(r["metrics"].get("retain_heldout_acc") is not None for r in results):
        return []
    seen, heldout = (metric_title(m, config.labels) for m in ("retain_acc", "retain_heldout_acc"))
    lines = ["\n## Old facts asked as in training, and with a template no training text holds\n",
             f"{seen}: the old questions with the template pretraining (and, in a world with retrofit_qa, the retrofit "
             f"and background) used; {heldout}: the same facts asked with a held-out template (world option "
             "retain_heldout). The first probe leaks (its texts are training texts); the second does not. Per method "
             "at its chosen rate, mean over seeds:\n",
             f"| Method | Seeds | {seen} | {heldout} |", "| --- | ---: | ---: | ---: |"]
    chosen: dict[tuple, list[dict]] = {}
    for result in at_chosen_rates(results):
        chosen.setdefault(variant(result), []).append(result["metrics"])
    order = {condition: index for index, condition in enumerate(config.conditions)}
    for method, metrics in sorted(chosen.items(), key=lambda item: (order.get(item[0][0], len(order)), str(item[0]))):
        lines.append(f"| {display_name(method[0], config.model, method[3])} | {len(metrics)} | "
                     f"{_mean(m.get('retain_acc') for m in metrics)} | "
                     f"{_mean(m.get('retain_heldout_acc') for m in metrics)} |")
    if config.matched_learning:
        levels = [str(level) for level in config.matched_learning]
        learn = learning_metric(results)
        tables = {kept: {tuple(row["method"]): row for row in matched_learning(
            results, config.matched_learning, variant, learn, kept, variant({"condition": "full"}))}
            for kept in ("retain_acc", "retain_heldout_acc")}
        lines += [f"\nKept at matched learning ({metric_title(learn, config.labels)}; as matched_learning.md: mean ± "
                  "95% interval over the seeds, k/n where only k measured the level), the two probes side by side:\n",
                  "| Method | " + " | ".join(f"{probe} @ {level}" for level in levels
                                            for probe in (seen, heldout)) + " |",
                  "| --- | " + " | ".join("---:" for _ in range(2 * len(levels))) + " |"]
        for method, row in tables["retain_acc"].items():
            other = tables["retain_heldout_acc"].get(method)
            cells = [format_cell(r["levels"][level]["mean"], r["levels"][level]["half_width"],
                                 r["levels"][level]["measured"], len(r["seeds"])) if r else "—"
                     for level in levels for r in (row, other)]
            lines.append(f"| {display_name(method[0], config.model, method[3])} | " + " | ".join(cells) + " |")
    return lines
