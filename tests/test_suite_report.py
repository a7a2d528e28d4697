"""`smf report` on a suite directory of the paper's configuration (results written here, no training):
paper columns beside ours, mean ± sample std per condition, accounting of Qwen-2.5-0.5B built on
the meta device (docs/method.md#the-memory-layer, #public-datasets-and-the-fixtures numbers), status of finished
and pending runs."""
import csv
import json
import random
import statistics

import pytest

from smf import cli
from smf.report import CONDITIONS, PAPER_TABLE1
from smf.suite.config import load_suite_config
from smf.suite.fingerprints import run_hash
from smf.suite.plan import SuiteLayout, plan_runs
from smf.files import write_json_atomic

METRICS = ("medmcqa_acc", "wikitext_ppl", "triviaqa_acc")


@pytest.fixture
def paper_suite(tmp_path):
    """A paper-config suite directory with random results for every run but lora-seed2."""
    config = load_suite_config("paper", {"output_dir": str(tmp_path / "suite")})
    layout = SuiteLayout(config.output_dir)
    write_json_atomic(layout.config_file, config.to_dict())
    rng = random.Random(0)
    written = {}
    for run in plan_runs(config):
        if run.name == "lora-seed2":
            continue
        metrics = {"medmcqa_acc": rng.uniform(0.3, 0.4), "wikitext_ppl": rng.uniform(12, 19),
                   "triviaqa_acc": rng.uniform(0.15, 0.26)}
        written[run.name] = metrics
        write_json_atomic(layout.results_path(run), {
            "condition": run.condition, "seed": run.seed, "metrics": metrics,
            "timing": {"train_s": rng.uniform(1, 9), "eval_s": {"medmcqa": 1.0, "wikitext": 2.0, "triviaqa": 3.0}},
            "config_hash": run_hash(config, run), "artefact": f"train/{run.name}/final"})
    return config.output_dir, written


def _report(suite_dir) -> int:
    return cli.main(["report", "--suite-dir", str(suite_dir)])


def test_report_of_paper_suite(paper_suite, capsys):
    suite_dir, written = paper_suite
    assert _report(suite_dir) == 0
    printed = capsys.readouterr().out.split()
    expected = ["table1.md", "table1.csv", "table1.tex", "pareto.png", "pareto.pdf", "environment.md",
                "environment.json", "accounting.md",
                "accounting.json", "suite_status.md", "suite_status.json", "report.md"]
    assert [p.rsplit("/", 1)[-1] for p in printed] == expected
    assert all((suite_dir / name).stat().st_size > 0 for name in expected)

    with open(suite_dir / "table1.csv") as handle:
        rows = {row["condition"]: row for row in csv.DictReader(handle)}
    assert list(rows) == list(CONDITIONS)
    for condition in CONDITIONS:
        for metric in METRICS:
            ours = [m[metric] for name, m in written.items() if name.rsplit("-seed", 1)[0] == condition]
            assert float(rows[condition][f"{metric}_mean"]) == pytest.approx(statistics.fmean(ours), rel=1e-12)
            assert float(rows[condition][f"{metric}_std"]) == pytest.approx(statistics.stdev(ours), rel=1e-12)
            assert float(rows[condition][f"paper_{metric}_mean"]) == PAPER_TABLE1[condition][metric][0]
    assert rows["lora"]["seeds"] == "2" and rows["full"]["seeds"] == "3"
    assert "MedMCQA acc ↑ (paper)" in (suite_dir / "table1.md").read_text()

    # docs/method.md#the-memory-layer, #public-datasets-and-the-fixtures: three memories of 17,337,088 (values
    # 14,680,064 each), LoRA 366,592 per layer x 24, 3 x 512 x 896 value parameters per stage-2 step.
    accounting = {row["method"]: row for row in json.loads((suite_dir / "accounting.json").read_text())}
    assert accounting["LoRA"]["stored"] == 366_592 * 24
    assert accounting["Additive memory"]["values"] == 3 * 14_680_064
    assert accounting["Additive memory"]["stored"] == 3 * 17_337_088 + 3
    assert accounting["Replacement memory"]["updated_per_step"] == 3 * 512 * 896
    assert accounting["Full finetune"]["updated_per_step"] == pytest.approx(494e6, rel=0.01)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in (suite_dir / "accounting.md").read_text()

    status = (suite_dir / "suite_status.md").read_text()
    assert "26 of 27 runs done" in status
    assert "| LoRA | 2 | pending |" in status
    rows = json.loads((suite_dir / "suite_status.json").read_text())
    assert [row["status"] for row in rows].count("done") == 26
    assert next(r for r in rows if r["condition"] == "full" and r["seed"] == 0)["eval_s"] == 6.0


def test_report_without_results_is_an_error(tmp_path, capsys):
    config = load_suite_config("paper", {"output_dir": str(tmp_path)})
    write_json_atomic(SuiteLayout(tmp_path).config_file, config.to_dict())
    assert _report(tmp_path) == 2
    assert "holds no finished run" in capsys.readouterr().err


def test_report_skips_results_left_by_another_config(paper_suite):
    suite_dir, written = paper_suite
    layout = SuiteLayout(suite_dir)
    leftover = json.loads(layout.results_dir.joinpath("lora-seed0.json").read_text())
    # a run this config does not plan, and a planned run computed with other settings
    write_json_atomic(layout.results_dir / "lora-seed7.json", {**leftover, "seed": 7, "config_hash": "other"})
    write_json_atomic(layout.results_dir / "lora-seed2.json", {**leftover, "seed": 2, "config_hash": "other"})
    assert _report(suite_dir) == 0
    with open(suite_dir / "table1.csv") as f:
        lora = next(row for row in csv.DictReader(f) if row["condition"] == "lora")
    assert lora["seeds"] == "2", lora  # seeds 0 and 1; the two leftovers are skipped
    expected = statistics.mean(written[f"lora-seed{seed}"]["medmcqa_acc"] for seed in (0, 1))
    assert float(lora["medmcqa_acc_mean"]) == pytest.approx(expected)
