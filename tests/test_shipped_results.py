"""The shipped results (docs/science/results/): every registered hypothesis of seeds 0-4, re-evaluated by the standard
rule from the per-seed differences the pages print, gives the verdict docs/science.md's table states (issue 58)."""
import json
import re
import statistics
from pathlib import Path

import pytest

from smf.report.hypotheses import verdict

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "science" / "results"
REGISTERED = json.loads((RESULTS / "registered_seeds0-4.json").read_text(encoding="utf-8"))
PAGE = (ROOT / "docs" / "science.md").read_text(encoding="utf-8")


def _section(first: str, after: str, page: str = PAGE) -> str:
    """The part of ``page`` (docs/science.md) from the text ``first`` to the text ``after``."""
    return page[page.index(first):page.index(after)]


@pytest.mark.parametrize("entry", REGISTERED["hypotheses"], ids=lambda e: f"{e['preset']}:{e['name']}")
def test_a_registered_hypothesis_gets_the_verdict_the_page_states(entry):
    evaluated = verdict(list(entry["per_seed"].values()), entry["threshold"], REGISTERED["seeds"])
    assert evaluated["verdict"] == entry["verdict"]
    (row,) = [line for line in PAGE.splitlines() if line.startswith(f"| {entry['preset']}: {entry['row']} |")]
    cells = [cell.strip(" *") for cell in row.split("|")[1:-1]]
    assert cells[-2:] == [entry["old_verdict"], entry["verdict"]]
    if evaluated["mean"] is not None and evaluated["pairs"] == REGISTERED["seeds"]:
        low, high = (float(v.replace("−", "-")) for v in re.findall(r"[−+]\d\.\d+", cells[2]))
        assert (low, high) == pytest.approx((evaluated["low"], evaluated["high"]), abs=6e-4)
        assert cells[3] == evaluated["from_zero"]



@pytest.fixture
def science_suite(tmp_path):
    """The confirmation preset's plan with synthetic results for every run (no training): within each method and
    schedule, learning rises and old facts fall with the rate, so each seed's envelope reaches 0.5 and 0.9."""
    import random

    from smf.files import write_json_atomic
    from smf.suite.config import load_suite_config
    from smf.suite.fingerprints import run_hash
    from smf.suite.plan import SuiteLayout, plan_runs

    config = load_suite_config("science_confirm", {"output_dir": str(tmp_path / "suite")})
    layout = SuiteLayout(config.output_dir)
    write_json_atomic(layout.config_file, config.to_dict())
    write_json_atomic(layout.hypotheses_file, {"hypotheses": config.to_dict()["hypotheses"], "runs_finished": 0,
                                               "runs_planned": 125, "registered_at": "2026-11-29T03:12:55+00:00"})
    rng = random.Random(58)
    curves: dict = {}  # (method, schedule, seed) -> its runs, rates rising
    for run in plan_runs(config):
        curves.setdefault((run.condition, run.variant, run.epochs, run.seed), []).append(run)
    for run in plan_runs(config):
        curve = curves[(run.condition, run.variant, run.epochs, run.seed)]
        step = curve.index(run) / max(len(curve) - 1, 1)
        learned = 0.1 if run.lr is None else 0.45 + 0.54 * step + rng.uniform(-0.02, 0.0)
        kept = 0.98 if run.lr is None else 0.95 - (0.5 if run.condition == "lora" else 0.35) * learned \
            + rng.uniform(-0.05, 0.05)
        write_json_atomic(layout.results_path(run), {
            "condition": run.condition, "seed": run.seed, **({} if run.lr is None else {"lr": run.lr}),
            **({"variant": run.variant} if run.variant else {}), **({"epochs": run.epochs} if run.epochs else {}),
            "metrics": {"learn_acc": learned, "heldout_ppl": rng.uniform(12, 19), "retain_acc": kept},
            "timing": {"eval_s": {"learn": 1.0, "heldout": 2.0, "retain": 3.0}, "cpu_s": rng.uniform(4, 40)},
            "sparse_steps": None, "cost": None, "config_hash": run_hash(config, run),
            "artefact": f"{config.output_dir}/train/{run.name}/final", "environment": {"python": "3.11"}})
    return config.output_dir


def test_the_packed_results_give_the_suite_directorys_tables(science_suite, tmp_path, capsys):
    from smf import cli
    from smf.suite.report import collect_results, load_suite_dir, write_result_tables
    from smf.suite.plan import SuiteLayout

    packed = tmp_path / "results.json"
    config = load_suite_dir(science_suite)
    results, _, _ = collect_results(SuiteLayout(science_suite), config)
    write_result_tables(config, results, science_suite)
    from smf.suite.shipped import write_packed

    write_packed(science_suite, packed)
    text = packed.read_text(encoding="utf-8")
    assert str(science_suite / "train") not in text and len(text) < 125 * 700  # no local paths; compact
    assert cli.main(["report", "--results", str(packed), "--out", str(tmp_path / "shipped")]) == 0
    assert "matched_learning.md" in capsys.readouterr().out
    for name in ("matched_learning.json", "lr_sweep.json", "table1.md", "table1.csv", "environment.json"):
        assert (tmp_path / "shipped" / name).read_text() == (science_suite / name).read_text(), name
    matched = json.loads((tmp_path / "shipped" / "matched_learning.json").read_text())
    assert sorted(h["name"] for h in matched["hypotheses"]) == sorted(config.hypotheses)
    assert all(h["pairs"] == 5 for h in matched["hypotheses"])
    assert "Registered 2026-11-29T03:12:55+00:00, when 0 of 125 runs had finished (before any run)." in \
        (tmp_path / "shipped" / "matched_learning.md").read_text()


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.update(format="other/9"), "field format must be 'smf-suite-results/1'"),
    (lambda p: p["runs"][3].update(environment=7), r"runs\[3\]\): field environment must be an index"),
    (lambda p: p["runs"][3].update(seed=11), r"runs\[3\]\): run .*-seed11 is not a run of the packed suite"),
    (lambda p: p["runs"][3]["metrics"].update(retain_acc=1.5), r"runs\[3\]\): field metrics.retain_acc"),
    (lambda p: p["runs"][3].pop("condition"), r"runs\[3\]\): field condition must be present"),
])
def test_a_damaged_packed_file_is_named_in_one_line(science_suite, tmp_path, capsys, edit, message):
    from smf import cli
    from smf.suite.shipped import pack_suite

    packed = pack_suite(science_suite)
    edit(packed)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(packed))
    assert cli.main(["report", "--results", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err


def test_a_packed_run_names_its_base_relative_to_the_suite_folder(science_suite, tmp_path):
    """A run's ``model`` (its seed's pretrained base, inside the folder) is packed as ``<suite>/...``, also where the
    record was written in the folder before it moved, or in another folder and copied in: no local path is packed."""
    from smf.suite.config import seed_config
    from smf.suite.plan import SuiteLayout
    from smf.suite.report import load_suite_dir
    from smf.suite.shipped import pack_suite

    config = load_suite_dir(science_suite)
    for index, path in enumerate(sorted(SuiteLayout(science_suite).results_dir.glob("*.json"))):
        record = json.loads(path.read_text())
        model = Path(seed_config(config, record["seed"]).model)
        where = (model, tmp_path / "before-it-moved" / model.relative_to(science_suite))[index % 2]
        path.write_text(json.dumps({**record, "model": str(where)}))
    packed = pack_suite(science_suite)
    assert {run["model"] for run in packed["runs"]} == {f"<suite>/bases/seed{seed}/pretrain/final"
                                                        for seed in config.seeds}
    assert str(tmp_path) not in json.dumps(packed)


def test_the_shipped_results_hold_no_local_path():
    for path in sorted(RESULTS.glob("*/results.json")):
        assert '"/' not in path.read_text(encoding="utf-8"), path


def test_report_results_needs_out_and_out_needs_results(tmp_path, capsys):
    from smf import cli

    assert cli.main(["report"]) == 2
    assert "give --suite-dir DIR (a suite directory) or --results FILE" in capsys.readouterr().err

    assert cli.main(["report", "--results", str(tmp_path / "r.json")]) == 2
    assert "--results needs --out DIR" in capsys.readouterr().err
    assert cli.main(["report", "--suite-dir", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "--out goes with --results" in capsys.readouterr().err


PAGE_TABLES = {  # shipped results -> (the page's section: first heading, the next heading; hypothesis -> row label)
    "science": (("### Five seeds, the schedule in the budget", "## Results: memories pretrained"), {
        "paper-like-vs-full": "paper-like SMF − full finetuning ≥ +0.10",
        "paper-like-vs-lora": "paper-like SMF − LoRA ≥ +0.10",
        "paper-like-vs-large-step": "paper-like SMF − large-step SMF ≥ +0.10",
        "large-step-vs-full": "large-step SMF − full finetuning ≤ −0.10"}),
    "science-confirm": (("### Confirmation seeds 5-9", "### Equal budget: the same schedules"), {
        "paper-like-vs-full": "paper-like SMF − full finetuning", "paper-like-vs-lora": "paper-like SMF − LoRA",
        "paper-like-vs-large-step": "paper-like SMF − large-step SMF",
        "large-step-vs-full": "large-step SMF − full finetuning"}),
    "science-budget": (("### Equal budget: the same schedules", "## Commands"), {
        "same-schedules-vs-full": "same schedules: paper-like SMF − full finetuning",
        "same-schedules-vs-lora": "same schedules: paper-like SMF − LoRA",
        "equal-compute-vs-full": "equal compute: paper-like SMF − full finetuning",
        "equal-compute-vs-lora": "equal compute: paper-like SMF − LoRA"}),
    "science-pretrained": (("### The schedule in the budget on pretrained memories",
                            "## Results: the locality suite"), {
        "small-step-vs-full": "small-step SMF − full finetuning ≥ +0.10 at 0.9",
        "small-step-vs-lora": "small-step SMF − LoRA ≥ +0.10 at 0.9",
        "large-step-vs-full-at-0.5": "large-step SMF − full finetuning ≥ +0.10 at 0.5"}),
    "factorial2": (("### The second fraction, registered after the first", "### Confirmation seeds 5-9"), {
        "factorial2-slots": "A slots: 16,384 − 1,024", "factorial2-share": "B T's share: 3.1% − 12.5%",
        "factorial2-plus-s": "C mode: +S − plain additive", "factorial2-alpha": "D alpha's rate: its own − the rows'",
        "factorial2-steps": "E per-touch step: small − large"}),
    "factorial": (("### What does the work: a registered fractional factorial",
                   "### The second fraction, registered"), {
        "factorial-slots": "A slots: 16,384 − 1,024", "factorial-share": "B T's share: 3.1% − 12.5%",
        "factorial-plus-s": "C mode: +S − plain additive", "factorial-alpha": "D alpha's rate: its own − the rows'",
        "factorial-steps": "E per-touch step: small − large"}),
}


@pytest.mark.parametrize("name", sorted(PAGE_TABLES))
def test_a_table_on_the_page_is_the_shipped_results(name, shipped_report):
    """A table of docs/science.md (per seed, mean ± 95%, against 0, verdict of every registered hypothesis),
    recomputed from the shipped per-run results alone."""
    (first, after), labels = PAGE_TABLES[name]
    out = shipped_report(name)
    evaluated = json.loads((out / "matched_learning.json").read_text())["hypotheses"]
    section = _section(first, after)
    assert sorted(entry["name"] for entry in evaluated) == sorted(labels)
    for entry in evaluated:
        (row,) = [line for line in section.splitlines() if line.startswith(f"| {labels[entry['name']]} ")]
        cells = [cell.strip(" *") for cell in row.split("|")[1:-1]]
        per_seed_at = next(i for i, cell in enumerate(cells) if cell.count(" / ") == 4 or cell == "—")  # layouts differ
        mean_cell, against_zero = cells[per_seed_at + 1:per_seed_at + 3]
        assert cells[-1].startswith(entry["verdict"]) or cells[-2].startswith(entry["verdict"])
        if entry["mean"] is None:  # no seed measured both sides (the factorial: a cell that never reaches the level)
            assert not entry["per_seed"] and cells[per_seed_at:per_seed_at + 3] == ["—", "—", "—"]
        else:
            per_seed = [float(v.replace("−", "-")) for v in cells[per_seed_at].split(" / ")]
            assert per_seed == pytest.approx(
                [entry["per_seed"][seed] for seed in sorted(entry["per_seed"], key=int)], abs=5e-4)
            assert _mean_and_half(mean_cell) == pytest.approx((entry["mean"], entry["half_width"]), abs=5e-4)
            if against_zero in ("above 0", "below 0", "includes 0"):
                assert against_zero == entry["from_zero"]
        if entry.get("aliases"):  # a factor's effect: the interactions it is confounded with, as registered
            assert cells[-1].replace("−", "-") == entry["aliases"]


def test_pretrained_vs_retrofitted_at_16384_slots_on_the_page_is_the_shipped_results(shipped_report, tmp_path):
    """The 16,384-slot pretrained preset's registered hypotheses (paper-like SMF − full finetuning, and across presets
    the paper-like SMF on pretrained − on retrofitted memories, same seeds: first on the science grid, then, registered
    anew, on the grid placed for the pretrained memories), by the standard rule from the two suites' shipped per-run
    results alone: the page's per-seed values ("—" where a seed measured no value), mean ± 95%, against 0 and verdict;
    and the page's "every configuration learned all or nearly all new facts" on the science grid."""
    from smf.suite.shipped import read_packed

    levels = {}
    for name in ("science-pretrained16k", "science-retrofit16k"):
        out = shipped_report(name)
        rows = json.loads((out / "matched_learning.json").read_text())["rows"]
        levels.update({(name, row["method"][0], row["method"][3] if len(row["method"]) > 3 else None):
                       row["levels"]["0.9"]["per_seed"] for row in rows})
    _, results, _ = read_packed(RESULTS / "science-pretrained16k" / "results.json", tmp_path / "again")
    learned = [r["metrics"]["learn_acc"] for r in results if r.get("variant") == "paper-like"]
    assert len(learned) == 30 and min(learned) >= 0.99  # the page: 0.994-1.000 in all 30 runs
    section = _section("### Pretrained vs retrofitted at 16,384 slots", "### The schedule in the budget on")
    retrofitted = levels[("science-retrofit16k", "additive+s-tfidf", "paper-like")]
    (second,) = json.loads((RESULTS / "science-pretrained16k" / "hypotheses_registered_second.json").read_text(
        encoding="utf-8"))["hypotheses"].values()
    assert (second["level"], second["threshold"]) == (0.9, -0.10)
    for label, pretrained, other, threshold in (
            ("pretrained 16,384 slots: paper-like SMF − full finetuning ≥ +0.10 at 0.9",
             levels[("science-pretrained16k", "additive+s-tfidf", "paper-like")],
             levels.get(("science-pretrained16k", "full", None), {}), 0.10),
            ("pretrained − retrofitted paper-like SMF ≤ −0.10 at 0.9",
             levels[("science-pretrained16k", "additive+s-tfidf", "paper-like")], retrofitted, -0.10),
            ("second registration, placed grid: pretrained − retrofitted paper-like SMF ≤ −0.10 at 0.9",
             levels[("science-pretrained16k", "additive+s-tfidf", "placed")], retrofitted, second["threshold"])):
        per_seed = {seed: value - other[seed] for seed, value in pretrained.items()
                    if not isinstance(value, str) and not isinstance(other.get(seed, ""), str)}
        evaluated = verdict(list(per_seed.values()), threshold, 5)
        (line,) = [line for line in section.splitlines() if line.startswith(f"| {label} |")]
        cells = [cell.strip(" *") for cell in line.split("|")[1:-1]]
        assert cells[2].split(" / ") == [f"{per_seed[str(seed)]:+.3f}".replace("-", "−") if str(seed) in per_seed
                                         else "—" for seed in range(5)]
        if evaluated["mean"] is None:
            assert cells[3:5] == ["—", "—"]
        else:
            assert _mean_and_half(cells[3]) == pytest.approx((evaluated["mean"], evaluated["half_width"]), abs=5e-4)
            assert cells[4] == evaluated["from_zero"]
        assert cells[5].startswith(evaluated["verdict"])


STREAM10_METHODS = {"additive+s-tfidf": "paper-like SMF", "lora": "LoRA", "full": "full finetuning"}


@pytest.fixture(scope="module")
def shipped_report(tmp_path_factory):
    """name -> the folder of the report drawn from the shipped results ``docs/science/results/{name}/`` alone (each
    drawn once per module: the tests read the same reports)."""
    from smf.suite.shipped import write_packed_report

    drawn: dict[str, Path] = {}

    def report(name: str) -> Path:
        if name not in drawn:
            drawn[name] = tmp_path_factory.mktemp(name)
            write_packed_report(RESULTS / name / "results.json", drawn[name])
        return drawn[name]

    return report


@pytest.fixture(scope="module")
def stream10_report(shipped_report):
    """(stream.json, matched_learning.json, the results records, the page's ten-task section) of the shipped
    ten-task stream results, the report redrawn from them alone."""
    from smf.suite.shipped import read_packed

    out = shipped_report("stream10")
    _, results, _ = read_packed(RESULTS / "stream10" / "results.json", out)
    section = _section("### A stream of ten tasks", "## Time")
    return (json.loads((out / "stream.json").read_text()), json.loads((out / "matched_learning.json").read_text()),
            results, section)


def _mean_and_half(cell: str) -> tuple[float, float]:
    mean, half = (float(v.replace("−", "-")) for v in cell.split(" ± "))
    return mean, half


def test_the_ten_task_streams_table_on_the_page_is_the_shipped_results(stream10_report):
    """docs/science.md's ten-task stream table (each method at its chosen configuration: mean ± 95% over the seeds
    after tasks A, C, E, G, J), recomputed from the shipped per-run results alone."""
    from smf.report.matched_learning import mean_interval
    from smf.suite.science import at_chosen_rates

    stream, _, results, section = stream10_report
    rows = {row["method"][0]: row for row in stream["stages"]}
    assert all(row["seeds"] == [0, 1, 2, 3, 4] for row in rows.values())
    chosen = [r for r in at_chosen_rates(results) if r.get("stream") and r["condition"] in STREAM10_METHODS]
    columns = {"A": 1, "C": 3, "E": 5, "G": 7, "J": 10}
    for series, key in (("old facts", "retain_acc"), ("task A", "A"), ("earlier tasks' mean", None)):
        for method, name in STREAM10_METHODS.items():
            (row,) = [line for line in section.splitlines() if line.startswith(f"| {series}: {name} |")]
            cells = [cell.strip() for cell in row.split("|")[2:-1]]
            assert len(cells) == len(columns)
            for cell, stage in zip(cells, columns.values()):
                if key:
                    summary = rows[method]["stages"][str(stage)][key]
                    expected = (summary["mean"], summary["half_width"])
                elif stage == 1:  # no earlier task
                    assert cell == "—"
                    continue
                else:  # each seed's mean over the tasks before this stage, then mean ± 95% over the seeds
                    expected = mean_interval([statistics.fmean(
                        stage_record["tasks"][task] for task in stream["tasks"][:stage - 1])
                        for run in chosen if run["condition"] == method
                        for stage_record in run["stream"]["stages"] if stage_record["stage"] == stage])
                # two decimals on the page
                assert _mean_and_half(cell) == pytest.approx(expected, abs=5.1e-3), (series, name, stage)


STREAM10_HYPOTHESES = {  # the page's row label -> (where it is evaluated: the registered name, or stream.md's axis)
    "old facts: paper-like SMF − full finetuning ≥ +0.10 at 0.9": "stream10-paper-like-vs-full",
    "old facts: paper-like SMF − LoRA ≥ +0.10 at 0.9": "stream10-paper-like-vs-lora",
    "task A: paper-like SMF − full finetuning ≥ +0.10 at 0.9": "task A",
    "earlier tasks' mean: paper-like SMF − full finetuning ≥ +0.10 at 0.9": "earlier tasks (mean)",
}


def test_the_ten_task_streams_hypotheses_on_the_page_are_the_shipped_results(stream10_report):
    """The four hypotheses the ten-task preset registered (two evaluated in matched_learning.md, two from
    stream.md's paired differences to full finetuning), by the standard rule from the shipped results alone: the
    page's per-seed values, mean ± 95%, against 0 and verdict."""
    stream, matched, _, section = stream10_report
    registered = {entry["name"]: entry for entry in matched["hypotheses"]}
    for label, source in STREAM10_HYPOTHESES.items():
        if source in registered:
            evaluated = registered[source]
        else:
            (row,) = [row for row in stream["matched_learning"][source] if row["method"][0] == "additive+s-tfidf"]
            per_seed = (row["levels"]["0.9"]["vs_reference"] or {}).get("per_seed", {})
            evaluated = {"per_seed": per_seed, **verdict(list(per_seed.values()), 0.10, 5)}
        (line,) = [line for line in section.splitlines() if line.startswith(f"| {label} |")]
        cells = [cell.strip(" *") for cell in line.split("|")[1:-1]]
        shown = cells[1].split(" / ")
        assert len(shown) == 5
        for seed, value in enumerate(shown):
            if str(seed) in evaluated["per_seed"]:
                assert float(value.replace("−", "-")) == pytest.approx(evaluated["per_seed"][str(seed)], abs=5e-4)
            else:
                assert value == "—", (label, seed)
        if evaluated["mean"] is None:
            assert cells[2:5] == ["—", "—", "—"]
        else:
            assert _mean_and_half(cells[2]) == pytest.approx((evaluated["mean"], evaluated["half_width"]), abs=5e-4)
            low, high = (float(v.replace("−", "-")) for v in re.findall(r"[−+]\d\.\d+", cells[3]))
            assert (low, high) == pytest.approx((evaluated["low"], evaluated["high"]), abs=6e-4)
            assert cells[4] == evaluated["from_zero"]
        assert cells[5].startswith(evaluated["verdict"]), label


FACTORIAL_CELLS = {"f1": "----+", "f2": "+--+-", "f3": "-+-++", "f4": "++---", "f5": "--++-", "f6": "+-+-+",
                   "f7": "-++--", "f8": "+++++"}  # A B C D E of each cell (smf/configs/suite_factorial.yaml)


def _fitted_effects(cells: dict[str, dict[str, float]], levels: dict[str, str]):
    """Per seed (rows, seeds 0-4) the five main effects A-E (columns) fitted by least squares to ``cells`` (cell ->
    seed -> kept at 0.9) with the levels ``levels`` gives them (cell -> "+-+-+"), interactions assumed zero: twice
    each coefficient."""
    import numpy as np

    design = np.array([[1.0] + [1.0 if level == "+" else -1.0 for level in levels[cell]] for cell in cells])
    return np.array([2 * np.linalg.lstsq(design, [cells[cell][str(seed)] for cell in cells], rcond=None)[0][1:]
                     for seed in range(5)])


def _assert_fit_table(lines: list[str], label: str, effects) -> None:
    """The rows ``| {label} {factor}...`` of the page's fit table show each factor's per-seed effects and their mean ±
    95% (``effects``: :func:`_fitted_effects`)."""
    from smf.report.matched_learning import mean_interval

    for index, factor in enumerate("ABCDE"):
        (line,) = [line for line in lines if line.startswith(f"| {label} {factor} ")]
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        shown = [float(v.replace("−", "-")) for v in cells[1].split(" / ")]
        assert shown == pytest.approx(list(effects[:, index]), abs=5e-4), factor
        assert _mean_and_half(cells[2]) == pytest.approx(mean_interval(list(effects[:, index])), abs=5e-4), factor


def test_the_factorials_exploratory_fit_on_the_page_is_the_shipped_results(shipped_report):
    """docs/science.md's exploratory reading of the factorial: each cell's kept value at 0.9 learned (mean ± 95%),
    and per seed the five main effects fitted by least squares to the cells that measured 0.9 on every seed (twice
    each coefficient), mean ± 95% over the seeds, recomputed from the shipped per-run results alone."""
    from smf.report.matched_learning import mean_interval

    out = shipped_report("factorial")
    rows = {row["method"][3]: row["levels"]["0.9"]["per_seed"]
            for row in json.loads((out / "matched_learning.json").read_text())["rows"]
            if row["method"][3] in FACTORIAL_CELLS}
    section = _section("### What does the work: a registered fractional factorial",
                       "### The second fraction, registered after the first")
    lines = section.splitlines()
    for cell, per_seed in rows.items():
        (line,) = [line for line in lines if line.startswith(f"| cell {cell} ")]
        shown = line.split("|")[2].strip()
        values = [value for value in per_seed.values() if not isinstance(value, str)]
        if len(values) < 2:
            assert shown.startswith("—"), cell
        else:
            assert _mean_and_half(shown.split(" (")[0]) == pytest.approx(mean_interval(values), abs=5e-4), cell
    fitted = {cell: per_seed for cell, per_seed in rows.items()
              if all(not isinstance(v, str) for v in per_seed.values())}
    assert "f7" not in fitted  # it never reaches 0.9 (the registered effects have no value)
    _assert_fit_table(lines, "fit", _fitted_effects(fitted, FACTORIAL_CELLS))


NUMBER = re.compile(r"([−+]?\d+\.\d+)(?: ± (\d+\.\d+))?(?: \((\d)/(\d)\))?")


def _shown(cell: str) -> list[tuple[float, float | None, int | None]]:
    """The values a table cell of the page shows, in order: (value, its ± half width or None, k of "(k/n)" or None);
    "—" shows none."""
    return [(float(value.replace("−", "-")), float(half) if half else None, int(k) if k else None)
            for value, half, k, _ in NUMBER.findall(cell)]


def _summary(level: dict, seeds: int, paired: bool) -> list[tuple[float, float | None, int | None]]:
    """What the page shows for one level of a matched-learning row (``paired``: its difference to the reference):
    mean ± 95% when every seed measured it, "(k/n)" beside when only k did, nothing when none did."""
    summary = level.get("vs_reference") if paired else level
    measured = (summary or {}).get("pairs" if paired else "measured", 0)
    if not measured:
        return []
    half = summary["half_width"] if measured > 1 else None
    return [(summary["mean"], half, None if measured == seeds else measured)]


def _by_method(rows: list[dict]) -> dict[tuple[str, str | None], dict]:
    """Matched-learning rows keyed by (condition, variant or None)."""
    return {(row["method"][0], row["method"][3] if len(row["method"]) > 3 else None): row for row in rows}


def _assert_kept_table(section: str, rows: dict, columns: list[tuple[str, bool]], seeds: int) -> None:
    """Every row of the page's table in ``section`` whose label ``rows`` maps to a matched-learning row shows, cell by
    cell (``columns``: (level, paired with the reference)), the values the shipped results give."""
    for label, row in rows.items():
        (line,) = [line for line in section.splitlines() if line.startswith(f"| {label} |")]
        shown = [value for cell in line.split("|")[2:-1] for value in _shown(cell)]
        expected = [value for level, paired in columns for value in _summary(row["levels"][level], seeds, paired)]
        assert len(shown) == len(expected), label
        for (value, half, k), (e_value, e_half, e_k) in zip(shown, expected):
            assert (value, k) == (pytest.approx(e_value, abs=5.1e-4), e_k), label
            assert (half is None) == (e_half is None) and (half is None or half == pytest.approx(e_half, abs=5.1e-4))


SCIENCE_METHODS = {"Additive sparse (TF-IDF), large-step": ("additive-tfidf", "large-step"),
                   "Additive sparse +S (TF-IDF), paper-like": ("additive+s-tfidf", "paper-like"),
                   "LoRA r16": ("lora", None), "Full finetune": ("full", None)}


def test_the_science_presets_tables_on_the_page_are_the_shipped_results(shipped_report):
    """docs/science.md's five-seed science tables (each method's old facts kept at 0.5 / 0.9 / 0.97 learned, and its
    difference to full finetuning), recomputed from the shipped per-run results alone."""
    out = shipped_report("science")
    rows = _by_method(json.loads((out / "matched_learning.json").read_text())["rows"])
    section = _section("### Five seeds, the schedule in the budget", "**Pre-registered hypotheses** (in")
    kept, paired = section.split("| Method − full finetuning (paired by seed) |")
    by_label = {label: rows[method] for label, method in SCIENCE_METHODS.items()}
    _assert_kept_table(kept, by_label, [("0.5", False), ("0.9", False), ("0.97", False)], 5)
    _assert_kept_table(paired, {k: v for k, v in by_label.items() if k != "Full finetune"},
                       [("0.5", True), ("0.9", True), ("0.97", True)], 5)
    report = (out / "matched_learning.md").read_text(encoding="utf-8")
    cost = _section("**Cost beside kept**", "![Forgetting at matched learning, five seeds")
    for label, (condition, variant) in SCIENCE_METHODS.items():  # steps, train CPU-s and TFLOPs, row change
        (line,) = [line for line in cost.splitlines() if line.startswith(f"| {label} |")]
        shown = [cell.strip() for cell in line.split("|")[2:-1]]
        name = label.split(",")[0].replace(" r16", "") + (f" [{variant}]" if variant else "")
        (drawn,) = [row for row in report.splitlines() if row.startswith(f"| {name} | 6 |")]
        cells = [cell.strip() for cell in drawn.split("|")[3:-1]]
        row_change = "—" if cells[4] == "—" else f"{cells[4].split(' (')[0]}; {cells[5].split(' (')[0]}"
        assert shown == [cells[0], cells[1], cells[2], row_change], label


def test_the_three_task_streams_tables_on_the_page_are_the_shipped_results(shipped_report):
    """docs/science.md's three-task stream: old facts and tasks A and B kept at matched task-C learning (each cell
    kept, and in brackets its difference to full finetuning), and the four registered hypotheses (three evaluated in
    matched_learning.md, the header's task-A one from stream.md's paired differences), by the standard rule from the
    shipped per-run results alone."""
    out = shipped_report("stream")
    axes = json.loads((out / "stream.json").read_text())["matched_learning"]
    rows = {axis: _by_method(axis_rows) for axis, axis_rows in axes.items()}
    section = _section("**Results: five seeds, the schedule in the budget** (`smf suite --config stream`",
                       "### A stream of ten tasks")
    columns = [("retain_acc", "0.5"), ("retain_acc", "0.9"), ("task A", "0.9"), ("task B", "0.9")]
    for label, method in SCIENCE_METHODS.items():
        (line,) = [line for line in section.splitlines() if line.startswith(f"| {label} |")]
        shown = [value for cell in line.split("|")[2:-1] for value in _shown(cell)]
        expected = [value for axis, level in columns for paired in (False, True)
                    for value in _summary(rows[axis][method]["levels"][level], 5, paired)]
        assert shown == [(pytest.approx(v, abs=5.1e-4), None if h is None else pytest.approx(h, abs=5.1e-4), k)
                         for v, h, k in expected], label
    registered = {entry["name"]: entry for entry in json.loads(
        (out / "matched_learning.json").read_text())["hypotheses"]}
    task_a = rows["task A"][("additive+s-tfidf", "paper-like")]["levels"]["0.9"]["vs_reference"]["per_seed"]
    hypotheses = {"paper-like SMF − full finetuning ≥ +0.10 old facts": registered["stream-paper-like-vs-full"],
                  "paper-like SMF − LoRA ≥ +0.10 old facts": registered["stream-paper-like-vs-lora"],
                  "large-step SMF − full finetuning ≤ −0.10 old facts": registered["stream-large-step-vs-full"],
                  "paper-like SMF − full finetuning ≥ +0.10 of task A": {
                      "per_seed": task_a, **verdict(list(task_a.values()), 0.10, 5)}}
    for label, evaluated in hypotheses.items():
        (line,) = [line for line in section.splitlines() if line.startswith(f"| {label}")]
        cells = [cell.strip(" *") for cell in line.split("|")[1:-1]]
        shown = [float(v.replace("−", "-")) for v in cells[1].split(" / ")]
        digits = 2 if label.endswith("task A") else 3  # the header's hypothesis was evaluated by hand, two decimals
        assert shown == pytest.approx([evaluated["per_seed"][str(seed)] for seed in range(5)], abs=0.51 * 10 ** -digits)
        assert _mean_and_half(cells[2]) == pytest.approx((evaluated["mean"], evaluated["half_width"]), abs=5e-4)
        assert cells[3].startswith(evaluated["verdict"]), label


FACTORIAL2_CELLS = {"g1": "-----", "g2": "+--++", "f3": "-+-++", "f4": "++---", "f5": "--++-", "f6": "+-+-+",
                    "g7": "-++-+", "g8": "++++-"}  # A B C D E of each cell (smf/configs/suite_factorial2.yaml)


def test_the_factorials_second_fraction_and_both_fractions_fit_on_the_page_are_the_shipped_results(shipped_report):
    """docs/science.md's second fraction: each cell's kept value at 0.9 learned (mean ± 95%, per seed), and the
    exploratory fit of the five main effects to both fractions' cells that reach 0.9 on every seed (the shared cells
    once: per seed, mean ± 95%), recomputed from the two fractions' shipped per-run results alone."""
    from smf.report.matched_learning import mean_interval

    cells = {}
    for name in ("factorial", "factorial2"):
        out = shipped_report(name)
        cells[name] = {row["method"][3]: row["levels"]["0.9"]["per_seed"]
                       for row in json.loads((out / "matched_learning.json").read_text())["rows"]
                       if row["method"][3]}
    assert all(cells["factorial"][cell] == cells["factorial2"][cell] for cell in ("f3", "f4", "f5", "f6"))
    section = _section("### The second fraction, registered after the first", "### Confirmation seeds 5-9")
    for cell, per_seed in cells["factorial2"].items():
        (line,) = [line for line in section.splitlines() if line.startswith(f"| cell {cell} ")]
        shown = [part.strip() for part in line.split("|")[2:-1]]
        assert _mean_and_half(shown[0]) == pytest.approx(mean_interval(list(per_seed.values())), abs=5e-4), cell
        assert [float(v) for v in shown[1].split(" / ")] == pytest.approx(
            [per_seed[str(seed)] for seed in range(5)], abs=5e-4), cell
    both = {cell: per_seed for name in ("factorial", "factorial2") for cell, per_seed in cells[name].items()
            if all(not isinstance(value, str) for value in per_seed.values())}
    assert sorted(both) == ["f1", "f2", "f3", "f4", "f5", "f6", "f8", "g1", "g2", "g7", "g8"]
    _assert_fit_table(section.splitlines(), "both", _fitted_effects(both, {**FACTORIAL_CELLS, **FACTORIAL2_CELLS}))


PACKS = {"science": "science", "pretrained": "science-pretrained", "stream": "stream", "new kind": "newkind",
         "factorial": "factorial", "factorial, second fraction": "factorial2"}  # the table's preset -> its results


@pytest.fixture(scope="module")
def evaluated_packs(shipped_report):
    """preset -> {hypothesis name: its evaluation} drawn from each preset's shipped per-run results alone (the
    stream's task-A hypothesis, registered in its header, from stream.md's paired differences)."""
    evaluated = {}
    for preset, pack in PACKS.items():
        out = shipped_report(pack)
        evaluated[preset] = {entry["name"]: entry
                             for entry in json.loads((out / "matched_learning.json").read_text())["hypotheses"]}
        if (out / "stream.json").is_file():
            (row,) = [row for row in json.loads((out / "stream.json").read_text())["matched_learning"]["task A"]
                      if row["method"][0] == "additive+s-tfidf" and row["method"][3] == "paper-like"]
            evaluated[preset]["task A (the preset's header)"] = {
                "per_seed": row["levels"]["0.9"]["vs_reference"]["per_seed"]}
    return evaluated


@pytest.mark.parametrize("entry", REGISTERED["hypotheses"], ids=lambda e: f"{e['preset']}:{e['name']}")
def test_the_verdicts_tables_per_seed_values_are_the_shipped_results(entry, evaluated_packs):
    """Every per-seed difference behind the verdicts table (registered_seeds0-4.json) is its preset's shipped
    results' (as the page prints them: three decimals, a few two)."""
    shipped = evaluated_packs[entry["preset"]][entry["name"]]["per_seed"]
    assert sorted(entry["per_seed"]) == sorted(shipped)
    for seed, value in entry["per_seed"].items():
        assert value == pytest.approx(shipped[seed], abs=0.0051 if round(value, 2) == value else 0.00051), seed


def test_the_pretrained_presets_table_on_the_page_is_the_shipped_results(shipped_report):
    """docs/science.md's table of the 1,024-slot pretrained preset (each method's old facts kept at 0.5 / 0.9 / 0.97
    learned beside its difference to full finetuning), recomputed from the shipped per-run results alone."""
    out = shipped_report("science-pretrained")
    rows = _by_method(json.loads((out / "matched_learning.json").read_text())["rows"])
    section = _section("### The schedule in the budget on pretrained memories",
                       "**Pre-registered hypotheses** (paired by seed, 95% t-interval")
    labels = {"Additive sparse (TF-IDF), large-step": ("additive-tfidf", "large-step"),
              "Additive sparse +S (TF-IDF), small-step": ("additive+s-tfidf", "small-step"),
              "LoRA r16": ("lora", None), "Full finetune": ("full", None)}
    _assert_kept_table(section, {label: rows[method] for label, method in labels.items()},
                       [(level, paired) for level in ("0.5", "0.9", "0.97") for paired in (False, True)], 5)


def test_the_locality_suites_table_on_the_page_is_the_shipped_results(shipped_report):
    """docs/science.md's locality table (each variant's old facts kept at 0.5 / 0.9 learned and its difference to full
    finetuning, three seeds), recomputed from the shipped per-run results alone."""
    out = shipped_report("locality")
    rows = {row["method"][3] or row["method"][0]: row
            for row in json.loads((out / "matched_learning.json").read_text())["rows"]}
    section = _section("## Results: the locality suite", "![Locality variants at matched learning]")
    labels = {f"{slots:,} slots, {rows_label}, {optimizer}": rows[f"s{slots}-{t}-{optimizer.lower()}"]
              for slots in (1024, 16384) for t, rows_label in (("t16", "T 16"), ("t128", "T 128"),
                                                                 ("tall", "every read row"))
              for optimizer in ("AdamW", "SGD")}
    _assert_kept_table(section, labels, [("0.5", False), ("0.9", False), ("0.5", True), ("0.9", True)], 3)
    _assert_kept_table(section, {"Full finetune (5 rates)": rows["full"]}, [("0.5", False), ("0.9", False)], 3)


def test_the_new_kind_presets_hypotheses_in_the_locality_page_are_the_shipped_results(shipped_report):
    """docs/locality.md's two registered hypotheses of the new-kind preset (paper-like SMF − full finetuning at 0.9
    and at 0.5 learned), by the standard rule from the shipped per-run results alone: per seed ("—" where a seed
    measured no value), mean and verdict."""
    out = shipped_report("newkind")
    evaluated = {entry["name"]: entry
                 for entry in json.loads((out / "matched_learning.json").read_text())["hypotheses"]}
    section = _section("## A world where locality can be tested", "## Time",
                       (ROOT / "docs" / "locality.md").read_text(encoding="utf-8"))
    for label, name in (("paper-like SMF − full finetuning ≥ +0.10 at 0.9 learned", "newkind-paper-like-vs-full"),
                        ("paper-like SMF − full finetuning ≥ +0.10 at 0.5 learned",
                         "newkind-paper-like-vs-full-at-0.5")):
        entry = evaluated[name]
        (line,) = [line for line in section.splitlines() if line.startswith(f"| {label} |")]
        cells = [cell.strip(" *") for cell in line.split("|")[1:-1]]
        for seed, shown in enumerate(cells[1].split(" / ")):
            if str(seed) in entry["per_seed"]:
                value = float(shown.replace("−", "-"))
                assert value == pytest.approx(entry["per_seed"][str(seed)], abs=0.0051 if len(shown) < 6 else 0.00051)
            else:
                assert shown == "—", (label, seed)
        assert float(cells[2].split(" ")[0].replace("−", "-")) == pytest.approx(entry["mean"], abs=5e-4)
        assert cells[3].startswith(entry["verdict"]), label
