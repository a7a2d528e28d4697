"""The shipped results (docs/science/results/): every registered hypothesis of seeds 0-4, re-evaluated by the standard
rule from the per-seed differences the pages print, gives the verdict docs/science.md's table states (issue 58)."""
import json
import re
from pathlib import Path

import pytest

from smf.report.hypotheses import verdict

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "science" / "results"
REGISTERED = json.loads((RESULTS / "registered_seeds0-4.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("entry", REGISTERED["hypotheses"], ids=lambda e: f"{e['preset']}:{e['name']}")
def test_a_registered_hypothesis_gets_the_verdict_the_page_states(entry):
    evaluated = verdict(list(entry["per_seed"].values()), entry["threshold"], REGISTERED["seeds"])
    assert evaluated["verdict"] == entry["verdict"]
    page = (ROOT / "docs" / "science.md").read_text(encoding="utf-8")
    (row,) = [line for line in page.splitlines() if line.startswith(f"| {entry['preset']}: {entry['row']} |")]
    cells = [cell.strip(" *") for cell in row.split("|")[1:-1]]
    assert cells[-2:] == [entry["old_verdict"], entry["verdict"]]
    if evaluated["mean"] is not None and evaluated["pairs"] == REGISTERED["seeds"]:
        low, high = (float(v.replace("−", "-")) for v in re.findall(r"[−+]\d\.\d+", cells[2]))
        assert (low, high) == pytest.approx((evaluated["low"], evaluated["high"]), abs=6e-4)
        assert cells[3] == evaluated["from_zero"]

