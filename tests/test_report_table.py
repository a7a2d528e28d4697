"""Table 1: mean ± sample std over seeds, bold best per column, paper numbers, three formats."""
import csv
import io
import random
import statistics

import pytest

from smf.report.paper_results import DISPLAY_NAMES, PAPER_TABLE1
from smf.vocabulary import CONDITIONS
from smf.report.table import paper_summaries, summarize, to_csv, to_latex, to_markdown
from smf.report.write import write_report


def random_records(seed=0, seeds=(0, 1, 2)):
    rng = random.Random(seed)
    return [{"condition": condition, "seed": s, "medmcqa_acc": rng.uniform(0.3, 0.4),
             "wikitext_ppl": rng.uniform(12, 19), "triviaqa_acc": rng.uniform(0.15, 0.26)}
            for condition in CONDITIONS for s in seeds]


def test_mean_and_sample_std_per_condition():
    records = random_records()
    random.Random(1).shuffle(records)
    summaries = summarize(records)
    assert [s.condition for s in summaries] == list(CONDITIONS)  # paper order, whatever the input order
    for summary in summaries:
        for metric, (mean, std) in summary.stats.items():
            values = [r[metric] for r in records if r["condition"] == summary.condition]
            assert mean == pytest.approx(statistics.fmean(values))
            assert std == pytest.approx(statistics.stdev(values))  # n - 1 in the denominator
        assert summary.n_seeds == 3
    single = summarize([dict(records[0], seed=7)])
    assert single[0].stats["medmcqa_acc"] == (records[0]["medmcqa_acc"], None)  # one seed: no spread


def test_markdown_bolds_best_per_column_and_shows_mean_pm_std():
    records = [
        {"condition": "base", "seed": 0, "medmcqa_acc": 0.30, "wikitext_ppl": 13.0, "triviaqa_acc": 0.25},
        {"condition": "lora", "seed": 0, "medmcqa_acc": 0.40, "wikitext_ppl": 15.0, "triviaqa_acc": 0.20},
        {"condition": "lora", "seed": 1, "medmcqa_acc": 0.38, "wikitext_ppl": 16.0, "triviaqa_acc": 0.22},
    ]
    lines = to_markdown(summarize(records)).splitlines()
    assert lines[0] == "| Method | MedMCQA acc ↑ | WikiText PPL ↓ | TriviaQA acc ↑ | Seeds |"
    assert lines[2] == "| Base Qwen | 0.300 | **13.000** | **0.250** | 1 |"  # one seed: no ± 0.000
    assert lines[3] == "| LoRA | **0.390** ± 0.014 | 15.500 ± 0.707 | 0.210 ± 0.014 | 2 |"
    latex = to_latex(summarize(records))
    assert "Base Qwen & 0.300 & \\textbf{13.000} & \\textbf{0.250} & 1 \\\\" in latex
    assert "LoRA & \\textbf{0.390} $\\pm$ 0.014 & 15.500 $\\pm$ 0.707 & 0.210 $\\pm$ 0.014 & 2 \\\\" in latex
    assert to_csv(summarize(records)).splitlines()[1] == "base,Base Qwen,1,0.3,,13.0,,0.25,"
    assert latex.startswith("\\begin{tabular}{lcccc}") and "\\toprule" in latex and "\\bottomrule" in latex


def test_paper_columns_reproduce_paper_bold_cells():
    text = to_markdown(summarize(random_records()), include_paper=True)
    header = text.splitlines()[0]
    assert "MedMCQA acc ↑ (paper)" in header and "WikiText PPL ↓ (paper)" in header
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()[2:]}
    # Columns: method, ours, paper, ours, paper, ours, paper, seeds. The paper bolds exactly these.
    assert rows["Full finetune"][2] == "**0.398** ± 0.006"
    assert rows["Additive sparse (KL)"][4] == "**12.723** ± 0.039"
    assert rows["Base Qwen"][6] == "**0.256** ± 0.001"
    assert sum(cell.startswith("**") for row in rows.values() for cell in row[2::2][:3]) == 3


def test_csv_round_trips_numbers_and_leaves_missing_empty():
    records = random_records(seeds=(0, 1))
    records[0]["triviaqa_acc"] = None
    records[1]["triviaqa_acc"] = None  # base has no TriviaQA at all
    rows = list(csv.DictReader(io.StringIO(to_csv(summarize(records), include_paper=True))))
    assert [row["method"] for row in rows] == [DISPLAY_NAMES[c] for c in CONDITIONS]
    assert rows[0]["triviaqa_acc_mean"] == "" and rows[0]["paper_triviaqa_acc_mean"] == "0.256"
    lora = [r for r in records if r["condition"] == "lora"]
    assert float(rows[7]["wikitext_ppl_mean"]) == pytest.approx(statistics.fmean(r["wikitext_ppl"] for r in lora))
    assert float(rows[8]["paper_wikitext_ppl_std"]) == PAPER_TABLE1["full"]["wikitext_ppl"][1]


def test_bad_records_raise():
    good = random_records()[0]
    with pytest.raises(ValueError, match="condition must be one of"):
        summarize([dict(good, condition="sparse")])
    with pytest.raises(ValueError, match="seed"):
        summarize([good, dict(good)])
    with pytest.raises(ValueError, match="medmcqa_acc must be a finite number"):
        summarize([dict(good, medmcqa_acc=float("nan"))])


def test_paper_summaries_and_report_files(tmp_path):
    assert [s.stats for s in paper_summaries()] == [PAPER_TABLE1[c] for c in CONDITIONS]
    paths = write_report(random_records(), tmp_path, include_paper=True)
    assert sorted(p.name for p in paths) == ["pareto.pdf", "pareto.png", "table1.csv", "table1.md", "table1.tex"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_no_bold_when_every_value_of_a_column_ties_and_base_row_names_the_model():
    records = [{"condition": c, "seed": 0, "medmcqa_acc": 0.25, "wikitext_ppl": 13.0 + i, "triviaqa_acc": 0.0}
               for i, c in enumerate(["base", "lora", "full"])]
    lines = to_markdown(summarize(records), model="tiny").splitlines()
    assert lines[2] == "| Base (tiny) | 0.250 | **13.000** | 0.000 | 1 |"
    assert "**" not in lines[3] + lines[4]
    assert "Base (Qwen2.5-1.5B)" in to_csv(summarize(records), model="Qwen/Qwen2.5-1.5B")
    assert "Base Qwen" in to_latex(summarize(records), model="Qwen/Qwen2.5-0.5B-Instruct")
