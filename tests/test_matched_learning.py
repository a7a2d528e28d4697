"""Forgetting at matched learning (smf.report.matched_learning): interpolation inside each seed's sweep, levels the
sweep does not measure, intervals over seeds and the difference to a reference paired by seed."""
import pytest

from smf.report.matched_learning import BELOW_SWEEP, NOT_REACHED, format_cell, kept_at, matched_learning
from smf.report.intervals import t_quantile


def test_kept_is_interpolated_between_the_bracketing_rates():
    points = [(1e-3, 0.40, 0.90), (3e-3, 0.80, 0.70), (1e-2, 0.95, 0.30)]
    assert kept_at(points, 0.6) == pytest.approx(0.80)       # halfway from 0.40 to 0.80 learned
    assert kept_at(points, 0.9) == pytest.approx(0.70 - (0.10 / 0.15) * 0.40)
    assert kept_at(points, 0.80) == 0.70                      # a measured point is read as it is
    assert kept_at(points, 0.97) == NOT_REACHED
    assert kept_at(points, 0.2) == BELOW_SWEEP                # no line drawn from the base model


def test_unsorted_and_non_monotone_sweeps_use_the_first_crossing_by_rate():
    points = [(1e-2, 0.70, 0.20), (1e-3, 0.30, 0.90), (3e-3, 0.90, 0.50)]  # learning falls again at the top rate
    assert kept_at(points, 0.6) == pytest.approx(0.90 - 0.5 * 0.40)      # 1e-3 -> 3e-3, not 3e-3 -> 1e-2


def _results(method, kept_by_seed, learn=(0.4, 0.8, 0.99)):
    return [{"condition": method, "seed": seed, "lr": rate, "metrics": {"learn_acc": l, "retain_acc": k}}
            for seed, kept in kept_by_seed.items() for rate, l, k in zip((1e-3, 3e-3, 1e-2), learn, kept)]


def test_rows_give_intervals_over_seeds_and_paired_differences():
    results = (_results("full", {0: (0.9, 0.5, 0.2), 1: (0.8, 0.4, 0.1), 2: (0.7, 0.3, 0.0)})
               + _results("additive-tfidf", {0: (0.9, 0.7, 0.3), 1: (0.8, 0.6, 0.2), 2: (0.7, 0.5, 0.1)})
               + [{"condition": "base", "seed": 0, "metrics": {"learn_acc": 0.1, "retain_acc": 1.0}}])
    rows = matched_learning(results, (0.8, 0.95), lambda r: (r["condition"],), "learn_acc", "retain_acc",
                            reference=("full",))
    by_method = {tuple(row["method"]): row for row in rows}
    assert set(by_method) == {("full",), ("additive-tfidf",)}   # the base has no sweep
    full = by_method[("full",)]["levels"]["0.8"]
    assert full["mean"] == pytest.approx(0.4) and full["measured"] == 3
    assert full["half_width"] == pytest.approx(t_quantile(3) * 0.1 / 3 ** 0.5)
    diff = by_method[("additive-tfidf",)]["levels"]["0.8"]["vs_reference"]
    assert diff["mean"] == pytest.approx(0.2) and diff["half_width"] == pytest.approx(0.0, abs=1e-12)
    assert diff["pairs"] == 3


def test_seeds_that_do_not_reach_a_level_are_counted_not_averaged():
    results = (_results("lora", {0: (0.9, 0.5, 0.2)}) + _results("lora", {1: (0.8, 0.4, 0.1)}, learn=(0.4, 0.8, 0.9)))
    (row,) = matched_learning(results, (0.95,), lambda r: (r["condition"],), "learn_acc", "retain_acc")
    cell = row["levels"]["0.95"]
    assert cell["measured"] == 1 and cell["per_seed"]["1"] == NOT_REACHED and cell["half_width"] is None
    assert format_cell(cell["mean"], cell["half_width"], cell["measured"], 2) == f"{cell['mean']:.3f} (1/2)"
    assert format_cell(None, None, 0, 2) == "—"
    assert format_cell(0.1, 0.02, 3, 3, signed=True) == "+0.100 ± 0.020"
