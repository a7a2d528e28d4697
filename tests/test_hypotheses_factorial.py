"""Hypotheses on a factor's levels (issue 58 item 4, smf/configs/suite_factorial.yaml): a side that lists cells is
their mean per seed, so a - b is the factor's main effect; checked at load, and listed in a table of factor effects."""
import pytest

from smf.report.hypotheses import CONFIRMED, INCONCLUSIVE, evaluate_hypotheses, hypotheses_markdown, side_per_seed
from smf.report.intervals import t_quantile
from smf.report.matched_learning import NOT_REACHED
from test_hostile_round5 import HYPOTHESIS, parse, refused

PLUS = ["additive+s-tfidf/f5", "additive+s-tfidf/f6", "additive+s-tfidf/f7", "additive+s-tfidf/f8"]
MINUS = ["additive-tfidf/f1", "additive-tfidf/f2", "additive-tfidf/f3", "additive-tfidf/f4"]
# Kept at 0.9 learned, per seed (0, 1, 2), each cell's; no cell holds its side's mean, so dropping any cell moves it.
PLUS_KEPT = [(0.1, 0.3, 0.0), (0.2, 0.3, 0.3), (0.5, 0.6, 0.5), (0.8, 0.6, 0.6)]  # means 0.40, 0.45, 0.35
MINUS_KEPT = [(0.1, 0.0, 0.1), (0.1, 0.1, 0.2), (0.3, 0.1, 0.4), (0.3, 0.6, 0.5)]  # means 0.20, 0.20, 0.30
EFFECTS = {"0": 0.20, "1": 0.25, "2": 0.05}
FACTOR = {"a": PLUS, "b": MINUS, "level": 0.9, "threshold": 0.1, "statement": "C (+S) keeps more",
          "aliases": "AE (slots x schedule), ABD"}


def _rows(cells: dict[str, tuple]) -> list[dict]:
    """matched_learning rows of ``cells`` (method -> kept value per seed, a string for a level not reached)."""
    return [{"method": (method,), "levels": {"0.9": {"per_seed": dict(zip(map(str, range(len(kept))), kept))}}}
            for method, kept in cells.items()]


def _evaluate(plus=PLUS_KEPT, minus=MINUS_KEPT, hypothesis=FACTOR):
    rows = _rows({**dict(zip(PLUS, plus)), **dict(zip(MINUS, minus))})
    (entry,) = evaluate_hypotheses({"factorial-plus-s": hypothesis}, rows, {m: (m,) for m in PLUS + MINUS}, 3)
    return entry


def test_a_factors_effect_is_the_mean_of_its_cells_at_one_level_minus_the_other():
    entry = _evaluate()
    assert entry["per_seed"] == pytest.approx(EFFECTS)
    assert entry["mean"] == pytest.approx(0.5 / 3)
    deviations = [0.2 - 0.5 / 3, 0.25 - 0.5 / 3, 0.05 - 0.5 / 3]
    sd = (sum(d * d for d in deviations) / 2) ** 0.5
    assert entry["half_width"] == pytest.approx(t_quantile(3) * sd / 3 ** 0.5)
    assert entry["verdict"] == INCONCLUSIVE and entry["from_zero"] == "includes 0"  # [-0.092, +0.425] holds 0.1
    swapped = _evaluate(hypothesis={**FACTOR, "a": MINUS, "b": PLUS})
    assert swapped["per_seed"] == pytest.approx({seed: -effect for seed, effect in EFFECTS.items()})
    for dropped in range(4):  # a cell left out of either side changes every seed's effect
        for side in ("a", "b"):
            cells = [cell for index, cell in enumerate(FACTOR[side]) if index != dropped]
            partial = _evaluate(hypothesis={**FACTOR, side: cells})["per_seed"]
            assert all(partial[seed] != pytest.approx(effect) for seed, effect in EFFECTS.items()), (side, dropped)
    clear = _evaluate(plus=[tuple(v + 0.3 for v in kept) for kept in PLUS_KEPT])  # effects 0.50, 0.55, 0.35
    assert clear["per_seed"] == pytest.approx({"0": 0.5, "1": 0.55, "2": 0.35}) and clear["verdict"] == CONFIRMED


def test_a_seed_where_one_cell_did_not_reach_the_level_leaves_the_pairs():
    assert side_per_seed([{"0": 0.2, "1": 0.4}, {"0": 0.4, "1": NOT_REACHED}]) == pytest.approx({"0": 0.3})
    assert side_per_seed([{"0": 0.25, "1": NOT_REACHED}]) == {"0": 0.25}  # one cell: its values unchanged
    entry = _evaluate(plus=[PLUS_KEPT[0][:2] + (NOT_REACHED,), *PLUS_KEPT[1:]])
    assert entry["per_seed"] == pytest.approx({"0": 0.2, "1": 0.25})
    assert entry["verdict"] == INCONCLUSIVE and "only 2 of 3 seeds" in entry["why"]


def test_the_factor_effects_table_names_the_levels_cells_and_aliases():
    entry = _evaluate()
    labels = {method: method.rsplit("/", 1)[1] for method in PLUS + MINUS}
    lines = hypotheses_markdown([entry], labels, None)
    assert "| Hypothesis | Contrast |" not in "\n".join(lines)  # no plain contrast: no empty table
    (row,) = [line for line in lines if line.startswith("| factorial-plus-s")]
    assert row.startswith("| factorial-plus-s: C (+S) keeps more | f5, f6, f7, f8 | f1, f2, f3, f4 | 0.9 | +0.1 | "
                          "+0.200 / +0.250 / +0.050 | +0.167 ± ")
    assert row.endswith("| includes 0 | **inconclusive** (the interval [-0.092, +0.425] holds +0.1) | "
                        "AE (slots x schedule), ABD |")


def test_a_factor_level_is_checked_at_load(tmp_path):
    config = parse(tmp_path, matched_learning=[0.5],
                   hypotheses={"h": {**HYPOTHESIS, "a": ["additive-tfidf", "additive-kl"], "b": ["lora", "full"],
                                     "aliases": "AB"}})
    hypothesis = config.hypotheses["h"]
    assert hypothesis["a"] == ["additive-tfidf", "additive-kl"] and hypothesis["aliases"] == "AB"


@pytest.mark.parametrize("change, message", [
    ({"a": []}, "hypotheses.h.a: give a method, or a non-empty list of distinct methods"),
    ({"a": ["lora", "lora"]}, "hypotheses.h.a: give a method, or a non-empty list of distinct methods"),
    ({"a": ["additive-tfidf", 3]}, "hypotheses.h.a: give a method, or a non-empty list"),
    ({"a": ["additive-tfidf", "magic"]}, "hypotheses.h.a: 'magic' is not a trained method of this suite"),
    ({"a": ["additive-tfidf", "full"], "b": ["lora", "full"]}, "hypotheses.h: a and b both hold full"),
    ({"aliases": " "}, "hypotheses.h.aliases: give a non-empty string"),
])
def test_a_bad_factor_level_is_refused_by_name(tmp_path, change, message):
    refused(tmp_path, message, matched_learning=[0.5], hypotheses={"h": {**HYPOTHESIS, **change}})
