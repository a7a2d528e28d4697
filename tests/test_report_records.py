"""`smf report` on a suite directory with a hand-edited or damaged results file (issue 34 item 7): one line naming
the file and the field, exit 2, no traceback; Table 1 still holds every other run, and the status shows the
refused run as failed. Named damages and hypothesis (arbitrary JSON values anywhere in a record) through the
report's reading and checking (collect_results) and its tables without the figure; three cases end to end
through the CLI (each draws the Pareto figure and the accounting: seconds)."""
from __future__ import annotations

import csv
import json
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smf.suite.report import collect_results, load_suite_dir, table_records, update_ablation
from smf.report.table import summarize, to_markdown
from smf.suite.plan import SuiteLayout
from smf.suite.status import write_status
from smf.vocabulary import CONDITIONS
from test_cli_reliability import one_line_error
from test_cli_smf import run_main
from test_suite_report import paper_suite  # noqa: F401  (fixture)

DAMAGED = "additive-kl-seed1"  # the run whose file each case edits; 25 other runs stay good


def _edit(suite_dir, edit) -> str:
    """Apply ``edit`` to the damaged run's record (a dict, changed in place, or a function returning the file's
    new text); returns the file's path."""
    path = SuiteLayout(suite_dir).results_dir / f"{DAMAGED}.json"
    record = json.loads(path.read_text())
    text = edit(record)
    if isinstance(text, _PutInstead):
        os.remove(path)
        text.make(path)
    else:
        path.write_text(text if isinstance(text, str) else json.dumps(record))
    return str(path)


def _seeds(suite_dir) -> dict[str, str]:
    with open(suite_dir / "table1.csv") as handle:
        return {row["condition"]: row["seeds"] for row in csv.DictReader(handle)}


def _set(keys, value):
    def edit(record):
        target = record
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(record):
        target = record
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return edit


CASES = {  # name: (edit, the field the one line must name)
    "metric missing": (_drop("metrics", "triviaqa_acc"), "metrics.triviaqa_acc"),
    "metric as a string": (_set(("metrics", "medmcqa_acc"), "0.35"), "metrics.medmcqa_acc"),
    "metric as a list": (_set(("metrics", "wikitext_ppl"), [14.2]), "metrics.wikitext_ppl"),
    "metric as a bool": (_set(("metrics", "medmcqa_acc"), True), "metrics.medmcqa_acc"),
    "metric NaN": (_set(("metrics", "wikitext_ppl"), math.nan), "metrics.wikitext_ppl"),
    "metric infinite": (_set(("metrics", "wikitext_ppl"), math.inf), "metrics.wikitext_ppl"),
    "accuracy above 1": (_set(("metrics", "triviaqa_acc"), 21.5), "metrics.triviaqa_acc"),
    "perplexity below 1": (_set(("metrics", "wikitext_ppl"), 0.5), "metrics.wikitext_ppl"),
    "unknown metric key": (_set(("metrics", "medmcqa_accuracy"), 0.3), "metrics.medmcqa_accuracy"),
    "metrics a list": (_set(("metrics",), [0.3, 14.0, 0.2]), "metrics"),
    "metrics missing": (_drop("metrics"), "metrics"),
    "seed a string": (_set(("seed",), "1"), "seed"),
    "seed a bool": (_set(("seed",), True), "seed"),
    "seed another run's": (_set(("seed",), 2), "seed"),
    "condition another run's": (_set(("condition",), "lora"), "condition"),
    "condition missing": (_drop("condition"), "condition"),
    "update unknown": (_set(("update",), "fast"), "update"),
    "timing missing": (_drop("timing"), "timing"),
    "eval seconds a list": (_set(("timing", "eval_s"), [1.0, 2.0]), "timing.eval_s"),
    "eval seconds negative": (_set(("timing", "eval_s", "wikitext"), -2.0), "timing.eval_s.wikitext"),
    "train seconds a string": (_set(("timing", "train_s"), "9s"), "timing.train_s"),
    "sparse steps a string": (_set(("sparse_steps",), "many"), "sparse_steps"),
    "sparse steps lacking a field": (_set(("sparse_steps",), {"steps": 3, "selected_rows": 10.0}),
                                     "sparse_steps.rows_moved_outside"),
    "config hash missing": (_drop("config_hash"), "config_hash"),
    "config hash a number": (_set(("config_hash",), 12345), "config_hash"),
    "artefact a number": (_set(("artefact",), 7), "artefact"),
    "a metric key with a newline": (_set(("metrics", "bad\nkey"), 0.1), "'bad\\nkey'"),
    "not JSON": (lambda record: '{"condition": "additive-kl", "seed": 1,', "is not a readable suite results file"),
    "a JSON array": (lambda record: "[1, 2, 3]", "expected a JSON object"),
    "empty": (lambda record: "", "is not a readable suite results file"),
    "nested too deep": (lambda record: "[" * 100_000 + "]" * 100_000, "is not a readable suite results file"),
    "an int too large for a float": (lambda record: json.dumps(record).replace('"medmcqa_acc": ', '"medmcqa_acc": 1'
                                                                               + "0" * 400 + ', "x": '),
                                     "metrics.medmcqa_acc"),
    "an int of 5000 digits": (lambda record: json.dumps(record).replace('"medmcqa_acc": ', '"medmcqa_acc": 1'
                                                                        + "0" * 5000 + ', "x": '),
                              "is not a readable suite results file"),
    "a directory": (lambda record: _PutInstead(os.mkdir), "not a regular file"),
    "a named pipe": (lambda record: _PutInstead(os.mkfifo), "not a regular file"),  # reading it would block
}


class _PutInstead:
    """An edit's answer meaning: put something else than a file at the path (``make(path)``, e.g. os.mkfifo)."""

    def __init__(self, make) -> None:
        self.make = make




def _collect(suite_dir):
    """What the report reads from ``suite_dir``: (results, refused, foreign) of smf.suite.report.collect_results,
    after checking that the accepted results render (Table 1, the ablation and the status) without plotting."""
    config = load_suite_dir(suite_dir)
    layout = SuiteLayout(suite_dir)
    results, refused, foreign = collect_results(layout, config)
    to_markdown(summarize(table_records(results)))
    update_ablation(results, CONDITIONS)
    write_status(config, layout.root, failed={**foreign, **refused})
    return results, refused, foreign


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_damaged_results_file_is_refused_naming_file_and_field(paper_suite, name):  # noqa: F811
    suite_dir, _ = paper_suite
    edit, field = CASES[name]
    path = _edit(suite_dir, edit)
    results, refused, foreign = _collect(suite_dir)
    assert list(refused) == [DAMAGED] and not foreign and len(results) == 25
    message = refused[DAMAGED]
    assert path in message and field in message and "\n" not in message, message


def test_the_report_of_a_damaged_file_is_one_line_and_the_others_render(paper_suite, capsys):  # noqa: F811
    suite_dir, _ = paper_suite
    path = _edit(suite_dir, _set(("metrics", "medmcqa_acc"), "0.35"))
    code, err = run_main(["report", "--suite-dir", str(suite_dir)], capsys)
    one_line_error(code, err, f"{path}: field metrics.medmcqa_acc must be a finite number or null, got '0.35'")
    seeds = _seeds(suite_dir)
    assert seeds["additive-kl"] == "2" and seeds["full"] == "3" and seeds["lora"] == "2", seeds  # the others render
    assert (suite_dir / "pareto.png").stat().st_size > 0
    status = {(row["condition"], row["seed"]): row["status"]
              for row in json.loads((suite_dir / "suite_status.json").read_text())}
    assert status[("additive-kl", 1)].startswith("failed: ") and path in status[("additive-kl", 1)]
    assert status[("additive-kl", 0)] == "done"


def test_two_damaged_files_are_both_named_in_the_one_line(paper_suite, capsys):  # noqa: F811
    suite_dir, _ = paper_suite
    first = _edit(suite_dir, _set(("metrics", "medmcqa_acc"), "high"))
    layout = SuiteLayout(suite_dir)
    other = layout.results_dir / "full-seed0.json"
    other.write_text(json.dumps({**json.loads(other.read_text()), "seed": "0"}))
    code, err = run_main(["report", "--suite-dir", str(suite_dir)], capsys)
    one_line_error(code, err, first)
    assert "full-seed0" in err and "1 more refused" in err
    assert _seeds(suite_dir)["full"] == "2"


def test_every_results_file_damaged_still_writes_the_status_and_is_one_line(paper_suite, capsys):  # noqa: F811
    suite_dir, _ = paper_suite
    for path in SuiteLayout(suite_dir).results_dir.glob("*.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "metrics": None}))
    code, err = run_main(["report", "--suite-dir", str(suite_dir)], capsys)
    one_line_error(code, err, "field metrics must be")
    assert "the report of the other 0 runs" in err
    assert "0 of 27 runs done" in (suite_dir / "suite_status.md").read_text()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)
_PLACES = [("condition",), ("seed",), ("update",), ("metrics",), ("metrics", "medmcqa_acc"),
           ("metrics", "wikitext_ppl"), ("metrics", "triviaqa_acc"), ("metrics", "extra"), ("timing",),
           ("timing", "eval_s"), ("timing", "eval_s", "medmcqa"), ("timing", "train_s"), ("sparse_steps",),
           ("config_hash",), ("artefact",), ("model",), ("finished_at",), ("lr",), ("reads",)]


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(_PLACES), value=_JSON, delete=st.booleans())
def test_any_json_value_anywhere_in_a_record_is_taken_or_refused_naming_the_field(  # noqa: F811
        paper_suite, place, value, delete):
    """Either the record is still one the suite could have written and the report takes it (and renders it), or
    it is refused in one line naming the file and the place's top-level field; nothing else is raised."""
    suite_dir, _ = paper_suite
    path = SuiteLayout(suite_dir).results_dir / f"{DAMAGED}.json"
    good = path.read_text()
    try:
        record = json.loads(good)
        record.setdefault("sparse_steps", None)
        target = record
        for key in place[:-1]:
            target = target[key]
        if delete:
            target.pop(place[-1], None)
        else:
            target[place[-1]] = value
        path.write_text(json.dumps(record))
        results, refused, foreign = _collect(suite_dir)
        assert len(results) + len(refused) + len(foreign) == 26
        if foreign:  # another config's hash: skipped as a leftover, not refused
            assert place == ("config_hash",) and isinstance(value, str) and not delete
        if refused:
            message = refused[DAMAGED]
            assert str(path) in message and place[0] in message and "\n" not in message, message
    finally:
        path.write_text(good)


@pytest.fixture
def sweep_suite(tmp_path):
    """A paper-config suite with a two-rate lr_sweep (base, additive-kl, lora; three seeds), a results file for
    every run: base unswept, each other run at its rate."""
    import random

    from smf.files import write_json_atomic
    from smf.suite.config import load_suite_config
    from smf.suite.fingerprints import run_hash
    from smf.suite.plan import plan_runs

    config = load_suite_config("paper", {"output_dir": str(tmp_path / "suite"), "authors_update": [],
                                         "conditions": ["base", "additive-kl", "lora"],
                                         "lr_sweep": {"sparse": [1e-2, 1e-1], "lora": [1e-3, 1e-2]}})
    layout = SuiteLayout(config.output_dir)
    write_json_atomic(layout.config_file, config.to_dict())
    rng = random.Random(0)
    for run in plan_runs(config):
        write_json_atomic(layout.results_path(run), {
            "condition": run.condition, "seed": run.seed, **({} if run.lr is None else {"lr": run.lr}),
            "metrics": {"medmcqa_acc": rng.uniform(0.3, 0.4), "wikitext_ppl": rng.uniform(12, 19),
                        "triviaqa_acc": rng.uniform(0.15, 0.26)},
            "timing": {"eval_s": {"medmcqa": 1.0, "wikitext": 2.0, "triviaqa": 3.0}},
            "config_hash": run_hash(config, run)})
    return config.output_dir


SWEEP_CASES = {  # name: (run file, edit, the field the one line must name)
    "learning metric null": ("lora-lr0.001-seed1", _set(("metrics", "medmcqa_acc"), None), "metrics.medmcqa_acc"),
    "rate missing": ("lora-lr0.01-seed0", _drop("lr"), "field lr must be 0.01"),
    "rate another file's": ("additive-kl-lr0.1-seed2", _set(("lr",), 0.01), "field lr must be 0.1"),
    "rate a string": ("additive-kl-lr0.01-seed0", _set(("lr",), "0.01"), "field lr must be 0.01"),
    "rate null": ("additive-kl-lr0.01-seed0", _set(("lr",), None), "field lr must be 0.01"),
    "rate in an unswept run": ("base-seed0", _set(("lr",), 0.01), "field lr must be absent"),
    "reads of another run": ("lora-lr0.01-seed0", _set(("reads",), "loss"), "field reads must be null"),
}


@pytest.mark.parametrize("name", sorted(SWEEP_CASES))
def test_a_sweep_results_file_with_a_wrong_rate_or_no_learning_metric_is_refused(sweep_suite, name):
    """Before: a null learning metric crashed the sweep's mean, a file without its rate (or with another) was
    mixed into Table 1 as a second record of its condition."""
    run_name, edit, field = SWEEP_CASES[name]
    path = SuiteLayout(sweep_suite).results_dir / f"{run_name}.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    results, refused, foreign = collect_results(SuiteLayout(sweep_suite), load_suite_dir(sweep_suite))
    assert list(refused) == [run_name] and not foreign and len(results) == 14
    assert str(path) in refused[run_name] and field in refused[run_name] and "\n" not in refused[run_name]


def test_the_sweep_report_with_a_null_learning_metric_is_one_line_and_the_others_render(sweep_suite, capsys):
    path = SuiteLayout(sweep_suite).results_dir / "lora-lr0.001-seed1.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "metrics": {
        "medmcqa_acc": None, "wikitext_ppl": 14.0, "triviaqa_acc": 0.2}}))
    code, err = run_main(["report", "--suite-dir", str(sweep_suite)], capsys)
    one_line_error(code, err, f"{path}: field metrics.medmcqa_acc must be a finite number (the sweep chooses the "
                              "rate by it), got null")
    assert set(_seeds(sweep_suite)) == {"base", "additive-kl", "lora"}
    seeds = {(row["condition"], row["lr"]): row["seeds"]
             for row in json.loads((sweep_suite / "lr_sweep.json").read_text())}
    assert seeds == {("additive-kl", 0.01): 3, ("additive-kl", 0.1): 3, ("lora", 0.001): 2, ("lora", 0.01): 3}


def test_a_sweep_without_its_learning_metric_is_refused_by_the_config(tmp_path):
    """The report would have nothing to choose a rate by (before: a KeyError in the report)."""
    from smf.errors import ConfigError
    from smf.suite.config import load_suite_config

    with pytest.raises(ConfigError, match=r"lr_sweep: the sweep chooses each rate by the learning metric: eval.tasks "
                                          r"\['wikitext'\] must include learn \(own data\) or medmcqa"):
        load_suite_config("paper", {"output_dir": str(tmp_path), "conditions": ["base", "lora"], "authors_update": [],
                                    "lr_sweep": {"lora": [1e-3]}, "eval": {"tasks": ["wikitext"]}})
