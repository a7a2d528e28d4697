"""The tiny suite end to end (reduced: one seed, six conditions and one authors'-update run, one or two
epochs, few eval examples): results files, Table 1, the figure, the accounting, the status, the update
ablation; one retrofit shared by the two rules and by additive+S;
skipping finished runs; resuming a run killed mid-training or mid-evaluation; `smf eval` reproducing
the suite's numbers from each kind of artefact."""
import csv
import dataclasses
import json
import logging
import math
from pathlib import Path

import pytest
import yaml

from smf import cli
from smf.suite import runner as runner_module
from smf.suite.config import load_suite_config
from smf.suite.fingerprints import merged_plan
from smf.suite.plan import Run, SuiteLayout, plan_runs
from smf.suite.runner import SuiteRunner, run_suite
from smf.suite.report import write_suite_report
from smf.tiny import tiny_model
from smf.train import loop
from smf.train.config import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
CONDITIONS = ["base", "additive-kl", "additive-tfidf", "additive+s-kl", "lora", "full"]


def _config_file(directory: Path, output_dir: Path, conditions, **eval_overrides) -> Path:
    raw = {
        "name": "tiny-test", "model": "tiny", "output_dir": str(output_dir), "seeds": [0],
        "conditions": conditions, "device": "cpu", "protocol": "authors",
        "authors_update": ["additive-kl"] if "additive-kl" in conditions else [],
        "data": {"oasst": str(FIXTURES / "oasst1_train.jsonl"), "medmcqa_train": str(FIXTURES / "medmcqa_train.jsonl"),
                 "medmcqa_validation": str(FIXTURES / "medmcqa_validation.jsonl"),
                 "wikitext": str(FIXTURES / "wikitext103_v1_test.jsonl"),
                 "triviaqa": str(FIXTURES / "triviaqa_validation.jsonl")},
        "train": {"preset": "tiny", "epochs": 1, "save_every": 1},
        "stages": {"lora": {"epochs": 2}},
        "eval": {"medmcqa_examples": 6, "triviaqa_examples": 4, "triviaqa_max_new_tokens": 6,
                 "wikitext_window": 256, "wikitext_stride": 128, **eval_overrides},
    }
    path = directory / "suite.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path



@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """The reduced suite run once through run_suite + write_suite_report: (config file, suite dir,
    output directories of every training stage in the order they ran)."""
    root = tmp_path_factory.mktemp("suite")
    path = _config_file(root, root / "suite", CONDITIONS)
    config = load_suite_config(str(path))
    trained = []

    def spy(function):
        def recorded(run_config):
            trained.append(Path(run_config.output_dir).relative_to(config.output_dir))
            return function(run_config)
        return recorded

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner_module, "train", spy(runner_module.train))
        patch.setattr(runner_module, "collect_background", spy(runner_module.collect_background))
        run_suite(config)
    write_suite_report(config.output_dir)
    return path, config.output_dir, trained


def _results(suite_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((suite_dir / "results").glob("*.json"))}


def test_suite_writes_results_table_figure_accounting_status(suite):
    _, suite_dir, trained = suite
    # One retrofit (and one background collection) serves both selection rules, additive+S and the ablation.
    assert [str(p) for p in trained] == ["retrofit/additive-seed0", "background/additive-seed0",
                                         "train/additive-kl-seed0", "train/additive-tfidf-seed0",
                                         "train/additive+s-kl-seed0", "train/lora-seed0", "train/full-seed0",
                                         "train/additive-kl-authors-update-seed0"]
    results = _results(suite_dir)
    assert set(results) == {f"{c}-seed0" for c in CONDITIONS} | {"additive-kl-authors-update-seed0"}
    for name, record in results.items():
        assert {"condition", "seed", "metrics", "timing", "config_hash", "artefact"} <= set(record)
        assert set(record["metrics"]) == {"medmcqa_acc", "wikitext_ppl", "triviaqa_acc"}
        assert all(math.isfinite(v) for v in record["metrics"].values())
        assert 0 <= record["metrics"]["medmcqa_acc"] <= 1 and record["metrics"]["wikitext_ppl"] > 1
        assert (suite_dir / "eval" / name / "medmcqa.jsonl").read_text().count("\n") == 6
    assert results["base-seed0"]["artefact"] == "tiny"
    assert Path(results["lora-seed0"]["artefact"], "adapter_config.json").is_file()
    assert Path(results["additive-kl-seed0"]["artefact"], "memory_adapter.json").is_file()
    assert {"retrofit_s", "background_s", "train_s", "eval_s"} <= set(results["additive-kl-seed0"]["timing"])
    assert (suite_dir / "retrofit" / "additive-seed0" / "final" / "memory_adapter.json").is_file()
    assert (suite_dir / "background" / "additive-seed0" / "background.safetensors").is_file()
    # Training moved the model: the trained conditions differ from base on WikiText.
    base_ppl = results["base-seed0"]["metrics"]["wikitext_ppl"]
    assert results["lora-seed0"]["metrics"]["wikitext_ppl"] != base_ppl
    assert results["additive-kl-seed0"]["metrics"]["wikitext_ppl"] != base_ppl

    # Table 1: one row per condition, our numbers (one seed: mean = the run's number), no paper columns.
    with open(suite_dir / "table1.csv") as handle:
        rows = {row["condition"]: row for row in csv.DictReader(handle)}
    assert list(rows) == CONDITIONS and "paper_medmcqa_acc_mean" not in rows["base"]  # no ablation row
    for condition in CONDITIONS:
        for metric, value in results[f"{condition}-seed0"]["metrics"].items():
            assert float(rows[condition][f"{metric}_mean"]) == pytest.approx(value, rel=1e-12)
    markdown = (suite_dir / "table1.md").read_text()
    assert "| Base (tiny) |" in markdown and "| Additive sparse (KL) |" in markdown and "(paper)" not in markdown
    assert "Base Qwen" not in markdown
    assert "\\begin{tabular}" in (suite_dir / "table1.tex").read_text()
    assert (suite_dir / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (suite_dir / "pareto.pdf").read_bytes()[:5] == b"%PDF-"

    # Accounting from the configured (tiny) model: full finetuning counts every parameter of it.
    accounting = {row["method"]: row for row in json.loads((suite_dir / "accounting.json").read_text())}
    assert accounting["Full finetune"]["updated_per_step"] == sum(p.numel() for p in tiny_model().parameters())
    assert accounting["Additive memory"]["values"] == 3 * 16 ** 2 * 64  # 3 layers x 256 slots x d_model
    assert accounting["Additive memory"]["updated_per_step"] == 3 * 32 * 64  # T = 32 rows per layer
    status = (suite_dir / "suite_status.md").read_text()
    assert "7 of 7 runs done" in status and status.count("| done |") == 7 and "protocol `authors`" in status

    # The update ablation: exact vs authors' update of additive-kl, with rows moved outside the selection.
    ablation = {row["update"]: row for row in json.loads((suite_dir / "ablation_update.json").read_text())}
    assert set(ablation) == {"exact", "authors"} and all(row["condition"] == "additive-kl" for row in ablation.values())
    assert ablation["exact"]["rows_moved_outside"] == 0 and ablation["authors"]["rows_moved_outside"] > 0
    authors_run = results["additive-kl-authors-update-seed0"]
    assert ablation["authors"]["metrics"]["wikitext_ppl"][0] == pytest.approx(authors_run["metrics"]["wikitext_ppl"])
    assert "| Additive sparse (KL) | authors' | 1 |" in (suite_dir / "ablation_update.md").read_text()


def test_second_run_trains_and_evaluates_nothing(suite, monkeypatch):
    path, suite_dir, _ = suite
    before = _results(suite_dir)

    def forbidden(*args, **kwargs):
        raise AssertionError("a finished run was trained or evaluated again")

    monkeypatch.setattr(runner_module, "train", forbidden)
    monkeypatch.setattr(runner_module, "collect_background", forbidden)
    monkeypatch.setattr(SuiteRunner, "evaluate", forbidden)
    assert cli.main(["suite", "--config", str(path), "--no-report"]) == 0
    assert _results(suite_dir) == before


def test_results_of_another_configuration_are_refused(suite, tmp_path):
    _, suite_dir, _ = suite
    other = load_suite_config(str(_config_file(tmp_path, suite_dir, ["base"], medmcqa_examples=5)))
    with pytest.raises(ConfigError, match="written by a suite with other settings"):
        SuiteRunner(other).run_one(Run("base", 0))


def test_killed_run_resumes_from_its_checkpoint_then_its_evaluation(suite, tmp_path, monkeypatch):
    _, reference_dir, _ = suite
    config = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", ["lora"])))
    layout, run = SuiteLayout(config.output_dir), Run("lora", 0)
    real_run_step, steps = loop.run_step, []

    def dies_at_third_step(*args, **kwargs):
        if len(steps) == 2:
            raise KeyboardInterrupt("killed")
        steps.append(1)
        return real_run_step(*args, **kwargs)

    monkeypatch.setattr(loop, "run_step", dies_at_third_step)
    with pytest.raises(KeyboardInterrupt):
        run_suite(config)
    train_dir = layout.train_dir(run)
    assert (train_dir / "checkpoint.pt").is_file() and not (train_dir / "final").exists()
    assert not layout.results_path(run).exists()
    monkeypatch.setattr(loop, "run_step", real_run_step)

    # Second attempt: training resumes from step 2 and finishes; the evaluation is killed.
    resumed = []

    def spy_train(run_config):
        resumed.append(run_config.resume)
        return loop.train(run_config)

    def killed_evaluation(self, run):
        raise RuntimeError("killed")

    monkeypatch.setattr(runner_module, "train", spy_train)
    monkeypatch.setattr(SuiteRunner, "evaluate", killed_evaluation)
    with pytest.raises(RuntimeError, match="killed"):
        run_suite(config)
    assert resumed == [True]
    assert "failed: RuntimeError: killed" in (config.output_dir / "suite_status.md").read_text()
    logged = [json.loads(line)["step"] for line in (train_dir / "train_log.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4]  # 20 examples / batch 8 = 2 steps per epoch, 2 epochs, each step once

    # Third attempt: nothing left to train; the evaluation runs and the results match an unbroken run.
    monkeypatch.undo()
    monkeypatch.setattr(runner_module, "train", lambda c: pytest.fail("training ran again"))
    run_suite(config)
    ours = json.loads(layout.results_path(run).read_text())["metrics"]
    reference = _results(reference_dir)["lora-seed0"]["metrics"]
    for metric, value in reference.items():
        assert ours[metric] == pytest.approx(value, rel=1e-5), metric


def test_eval_command_reproduces_the_suite_numbers(suite, tmp_path, monkeypatch, capsys):
    path, suite_dir, _ = suite
    results = _results(suite_dir)
    train = suite_dir / "train"
    cases = [("base-seed0", []),  # the base model
             ("lora-seed0", ["--adapter", str(train / "lora-seed0")]),  # a training run directory
             ("lora-seed0", ["--adapter", str(train / "lora-seed0" / "final")]),  # a peft adapter
             ("additive-kl-seed0", ["--adapter", str(train / "additive-kl-seed0" / "final")]),  # memories
             ("full-seed0", ["--adapter", str(train / "full-seed0" / "final")])]  # a finetuned model
    for name, adapter_args in cases:
        out = tmp_path / "_".join([name, *adapter_args]).replace("/", "_")
        argv = ["eval", "--config", str(path), "--model", "tiny", *adapter_args, "--tasks", "medmcqa,wikitext",
                "--output-dir", str(out)]
        assert cli.main(argv) == 0
        printed = json.loads(capsys.readouterr().out)
        saved = json.loads((out / "metrics.json").read_text())["metrics"]
        assert printed == saved and set(saved) == {"medmcqa_acc", "wikitext_ppl"}
        for metric, value in saved.items():
            assert value == pytest.approx(results[name]["metrics"][metric], rel=1e-5), (name, metric)


def test_a_subset_call_keeps_the_fuller_report(suite, tmp_path, caplog):
    """Issue 35: `smf suite --seeds 0 --conditions base` after the full suite ran into the same directory kept
    only the subset in suite_config.json, table1 and suite_status; now the directory's plan is joined."""
    _, suite_dir, _ = suite
    before = json.loads((suite_dir / "suite_config.json").read_text())
    subset = load_suite_config(str(_config_file(tmp_path, suite_dir, ["base"])))
    with caplog.at_level(logging.INFO, logger="smf.suite.runner"):
        run_suite(subset)
    assert "keeps the whole plan" in caplog.text
    recorded = json.loads((suite_dir / "suite_config.json").read_text())
    assert recorded["conditions"] == before["conditions"] and recorded["authors_update"] == ["additive-kl"]
    write_suite_report(suite_dir)
    table = (suite_dir / "table1.md").read_text()
    assert "LoRA" in table and (suite_dir / "ablation_update.md").is_file()
    status = json.loads((suite_dir / "suite_status.json").read_text())
    assert len(status) == len(CONDITIONS) + 1 and all(row["status"] == "done" for row in status)
    base = json.loads((suite_dir / "results" / "base-seed0.json").read_text())
    assert base["eval_rows"]["medmcqa"]["scored"] == 6  # rows scored and skipped recorded with the results


def test_a_call_with_other_settings_replaces_the_plan_and_its_report_files(tmp_path, caplog):
    first = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", ["base", "additive-kl"])))
    SuiteRunner(first).record_plan()
    for name in runner_module.REPORT_FILES:
        (tmp_path / "suite" / name).write_text("an older report")
    narrowed = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", ["base"])))
    assert set(plan_runs(SuiteRunner(narrowed).record_plan())) == set(plan_runs(first))  # joined: nothing removed
    assert all((tmp_path / "suite" / name).is_file() for name in runner_module.REPORT_FILES)
    other = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", ["base"], medmcqa_examples=5)))
    with caplog.at_level(logging.WARNING, logger="smf.suite.runner"):
        assert SuiteRunner(other).record_plan() == other
    assert "other settings" in caplog.text
    assert not any((tmp_path / "suite" / name).exists() for name in runner_module.REPORT_FILES)


def test_merged_plan_joins_seeds_conditions_and_ablation(tmp_path):
    full = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", CONDITIONS)))
    part = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", ["base", "lora"])))
    part = dataclasses.replace(part, seeds=(3,))
    merged = merged_plan(full.to_dict(), part)
    assert merged.seeds == (0, 3) and set(merged.conditions) == set(CONDITIONS)
    assert merged.authors_update == ("additive-kl",)
    assert merged_plan(None, part) == part
    other = load_suite_config(str(_config_file(tmp_path, tmp_path / "suite", ["base"], triviaqa_examples=2)))
    assert merged_plan(full.to_dict(), other) is None


def test_merged_plan_of_a_world_suite_called_on_later_seeds(tmp_path):
    """A world suite recorded for seed 0 and called on seeds 2 and 3: the data files and model follow the merged
    plan's first seed (the call's own are its seed 2's, which used to be refused as "world and data")."""
    first = load_suite_config("science", {"output_dir": str(tmp_path / "suite"), "seeds": [0]})
    later = load_suite_config("science", {"output_dir": str(tmp_path / "suite"), "seeds": [2, 3]})
    assert later.data != first.data
    merged = merged_plan(first.to_dict(), later)
    assert merged.seeds == (0, 2, 3) and merged.data == first.data and merged.model == first.model


def test_each_data_warning_is_logged_once_per_suite(caplog):
    from smf.data.sources import subset

    once = runner_module._OncePerSuite()
    sources = logging.getLogger("smf.data.sources")
    sources.addFilter(once)
    try:
        with caplog.at_level(logging.WARNING, logger="smf.data.sources"):
            for _ in range(3):
                subset(list(range(30)), 1000)
            subset(list(range(20)), 1000)
    finally:
        sources.removeFilter(once)
    assert caplog.text.count("but only 30 exist") == 1 and caplog.text.count("but only 20 exist") == 1
