"""The schedule in the equal budget (issue 48): ``schedule_sweep`` (recipe and variant) and variants' ``conditions``
checked at load (unequal configuration counts refused in one line), runs named and hashed so that a configuration at
the stage's configured epochs is the run it was before; the upper envelope over schedules at matched learning; the
pre-registered hypotheses checked at load and evaluated (confirmed / refuted / inconclusive) on synthetic per-seed
values; the cost-beside-kept and per-seed tables. No test says which method wins."""
import pytest

from smf.errors import ConfigError
from smf.report.budget import cost_markdown, cost_rows, per_seed_markdown
from smf.report.hypotheses import CONFIRMED, INCONCLUSIVE, REFUTED, evaluate_hypotheses, verdict
from smf.report.intervals import t_quantile
from smf.report.matched_learning import BELOW_SWEEP, NOT_REACHED, envelope, matched_learning
from smf.suite.config import load_suite_config
from smf.suite.fingerprints import run_hash
from smf.suite.plan import Run, plan_runs
from smf.suite.science import chosen_settings, sweep_rows

PAPER = {"authors_update": [], "conditions": ["base", "additive-kl", "lora", "full"]}
HYPOTHESIS = {"a": "additive-kl", "b": "full", "level": 0.9, "threshold": 0.1, "statement": "sparse keeps more"}


def _config(tmp_path, **overrides):
    return load_suite_config("paper", {"output_dir": str(tmp_path / "suite"), **PAPER, **overrides})


def test_unequal_configuration_counts_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"same number of learning rates x epochs .*'full': 4") as err:
        _config(tmp_path, lr_sweep={"sparse": [1e-3, 1e-2, 1e-1], "lora": [1e-4, 1e-3, 1e-2]},
                schedule_sweep={"full": {3: [1e-5, 3e-5], 6: [1e-5, 3e-5]}})
    assert "\n" not in str(err.value)
    config = _config(tmp_path, lr_sweep={"sparse": [1e-3, 1e-2, 1e-1, 1.0], "lora": [1e-4, 1e-3, 1e-2, 1e-1]},
                     schedule_sweep={"full": {3: [1e-5, 3e-5], 6: [1e-5, 3e-5]}})
    assert config.configurations("full") == [(3, 1e-5), (3, 3e-5), (6, 1e-5), (6, 3e-5)]
    with pytest.raises(ConfigError, match="cannot both be given"):
        _config(tmp_path, lr_sweep={"sparse": [1e-3], "lora": [1e-4], "full": [1e-5]},
                schedule_sweep={"full": {3: [1e-5]}})
    with pytest.raises(ConfigError, match="schedule_sweep.full: give epochs -> distinct"):
        _config(tmp_path, lr_sweep={"sparse": [1e-3, 1e-2], "lora": [1e-4, 1e-3]},
                schedule_sweep={"full": {3: [1e-5, 1e-5]}})
    with pytest.raises(ConfigError, match="schedule_sweep.full"):
        _config(tmp_path, lr_sweep={"sparse": [1e-3], "lora": [1e-4]}, schedule_sweep={"full": {0: [1e-5]}})


def test_variants_give_a_schedule_and_their_conditions(tmp_path):
    variants = {"small": {"rows_per_step": 64, "conditions": ["additive-kl"], "schedule_sweep": {3: [1e-3], 9: [3e-4]}},
                "big": {"rows_per_step": 1024, "conditions": "additive-tfidf", "lr_sweep": [1e-3, 1e-2]}}
    conditions = ["base", "additive-kl", "additive-tfidf", "full"]
    config = _config(tmp_path, conditions=conditions, variants=variants, schedule_sweep={"full": {3: [1e-5, 3e-5]}})
    names = [run.name for run in plan_runs(config) if run.seed == 0]
    assert names == ["base-seed0", "additive-kl-small-lr0.001-seed0", "additive-kl-small-ep9-lr0.0003-seed0",
                     "additive-tfidf-big-lr0.001-seed0", "additive-tfidf-big-lr0.01-seed0",
                     "full-lr1e-05-seed0", "full-lr3e-05-seed0"]  # the paper's 3 epochs: no -ep
    with pytest.raises(ConfigError, match=r"same number .*'variant small': 3"):
        _config(tmp_path, conditions=conditions, schedule_sweep={"full": {3: [1e-5, 3e-5]}},
                variants={**variants, "small": {**variants["small"], "schedule_sweep": {3: [1e-3, 3e-3], 9: [3e-4]}}})
    with pytest.raises(ConfigError, match="variants.small.lr_sweep is required"):
        _config(tmp_path, conditions=conditions, variants={"small": {"rows_per_step": 64}})
    with pytest.raises(ConfigError, match="give lr_sweep or schedule_sweep, not both"):
        _config(tmp_path, conditions=conditions, variants={"small": {**variants["small"], "lr_sweep": [1e-3]}})
    with pytest.raises(ConfigError, match="additive-tfidf run in no variant"):
        _config(tmp_path, conditions=conditions, schedule_sweep={"full": {3: [1e-5]}},
                variants={"small": {**variants["small"], "schedule_sweep": {3: [1e-3]}}})
    with pytest.raises(ConfigError, match="variants.big.conditions: give distinct sparse conditions"):
        _config(tmp_path, conditions=conditions, schedule_sweep={"full": {3: [1e-5, 3e-5]}},
                variants={**variants, "big": {**variants["big"], "conditions": ["additive-tfidf", "lora"]}})
    narrowed = _config(tmp_path, conditions=["base", "additive-kl", "full"], schedule_sweep={"full": {3: [1e-5, 3e-5]}},
                       variants={**variants, "big": {**variants["big"], "lr_sweep": [1e-3, 1e-2]}})
    assert {run.variant for run in plan_runs(narrowed)} == {None, "small"}  # --conditions: "big" has no runs


def test_a_configuration_at_the_configured_epochs_is_the_run_it_was(tmp_path):
    swept = _config(tmp_path, lr_sweep={"sparse": [1e-3, 1e-2], "lora": [1e-4, 1e-3]},
                    schedule_sweep={"full": {3: [1e-5], 6: [1e-5]}})
    plain = _config(tmp_path, lr_sweep={"sparse": [1e-3, 1e-2], "lora": [1e-4, 1e-3], "full": [1e-5, 2e-5]})
    assert run_hash(swept, Run("full", 0, lr=1e-5)) == run_hash(plain, Run("full", 0, lr=1e-5))
    longer = Run("full", 0, lr=1e-5, epochs=6)
    assert longer.name == "full-ep6-lr1e-05-seed0" and longer in plan_runs(swept)
    assert run_hash(swept, longer) != run_hash(swept, Run("full", 0, lr=1e-5))
    record = {"condition": "full", "seed": 0, "lr": 1e-5, "epochs": 6}
    assert Run.of_results(record) == longer


def _results(method, seed, curves, epochs_key=True):
    """Records of ``method`` and ``seed``: curves = {epochs: [(rate, learned, kept), ...]}."""
    return [{"condition": method, "seed": seed, "lr": rate, **({"epochs": epochs} if epochs_key and epochs else {}),
             "metrics": {"learn_acc": learned, "retain_acc": kept}}
            for epochs, points in curves.items() for rate, learned, kept in points]


def test_matched_learning_reads_the_upper_envelope_over_schedules_per_seed():
    short = [(1e-2, 0.4, 0.9), (3e-2, 0.8, 0.5), (1e-1, 0.95, 0.2)]
    long = [(1e-3, 0.6, 0.95), (3e-3, 0.9, 0.7)]  # reaches 0.9 keeping more; below 0.6 not measured
    results = _results("sparse", 0, {None: short, 40: long}) + _results("sparse", 1, {None: short, 40: long[:1]})
    (row,) = matched_learning(results, (0.5, 0.7, 0.9, 0.95), lambda r: (r["condition"],), "learn_acc",
                              "retain_acc")
    cells = row["levels"]
    assert cells["0.5"]["per_seed"]["0"] == pytest.approx(0.8) and cells["0.5"]["envelope_of"]["0"] is None
    assert cells["0.7"]["per_seed"]["0"] == pytest.approx(0.95 - 0.25 / 3) and cells["0.7"]["envelope_of"]["0"] == 40
    assert cells["0.9"]["per_seed"]["0"] == pytest.approx(0.7) and cells["0.9"]["envelope_of"]["0"] == 40
    assert cells["0.9"]["per_seed"]["1"] == pytest.approx(0.5 - 0.3 * 0.1 / 0.15)  # seed 1's long curve: one point
    assert cells["0.95"]["per_seed"]["0"] == pytest.approx(0.2)
    assert envelope({None: NOT_REACHED, 40: BELOW_SWEEP}) == (BELOW_SWEEP, None)
    assert envelope({None: NOT_REACHED, 40: NOT_REACHED}) == (NOT_REACHED, None)
    assert envelope({None: 0.3, 40: 0.3}) == (0.3, None)  # ties: the first schedule
    (single,) = matched_learning(_results("full", 0, {None: short}), (0.5,), lambda r: (r["condition"],),
                                 "learn_acc", "retain_acc")
    assert "envelope_of" not in single["levels"]["0.5"]  # one schedule: the sweep as before


def test_the_chosen_configuration_and_sweep_rows_keep_schedules_apart():
    results = _results("full", 0, {None: [(1e-3, 0.5, 0.5)], 40: [(1e-3, 0.7, 0.4)]})
    assert chosen_settings(results) == {("full", "exact", "all", None): (40, 1e-3)}
    rows = sweep_rows(results)
    assert {row.get("epochs"): row["chosen"] for row in rows} == {40: True, None: False}


def test_hypothesis_verdicts_on_synthetic_paired_differences():
    half = t_quantile(5) * 0.05 / 5 ** 0.5  # 0.062
    spread = [0.15 - 0.05 * 2 ** 0.5, 0.15, 0.15, 0.15, 0.15 + 0.05 * 2 ** 0.5]  # mean 0.15, sd 0.05
    clear = verdict([v + 0.1 for v in spread], 0.1, 5)  # [0.188, 0.312] lies beyond 0.1
    assert clear["verdict"] == CONFIRMED and clear["half_width"] == pytest.approx(half)
    assert clear["from_zero"] == "above 0" and "lies beyond +0.1" in clear["why"]
    straddles = verdict(spread, 0.1, 5)  # [0.088, 0.212]: the mean reaches 0.1 and 0 is excluded, 0.1 is not
    assert straddles["verdict"] == INCONCLUSIVE and straddles["from_zero"] == "above 0"
    assert verdict([v - 0.15 for v in spread], 0.1, 5)["verdict"] == REFUTED       # [-0.06, 0.06] short of 0.1
    assert verdict([v - 0.15 for v in spread], 0.1, 5)["from_zero"] == "includes 0"
    assert verdict([v - 0.08 for v in spread], 0.1, 5)["verdict"] == INCONCLUSIVE  # [0.008, 0.132] holds 0.1
    assert verdict([-v - 0.1 for v in spread], -0.1, 5)["verdict"] == CONFIRMED    # a keeps at least 0.1 less
    negative = verdict([-v for v in spread], -0.1, 5)
    assert negative["verdict"] == INCONCLUSIVE and negative["from_zero"] == "below 0"
    assert verdict([-v + 0.15 for v in spread], -0.1, 5)["verdict"] == REFUTED
    fewer = verdict(spread[:4], 0.1, 5)
    assert fewer["verdict"] == INCONCLUSIVE and "4 of 5" in fewer["why"]
    assert verdict(spread[:1], 0.1, 5)["mean"] is None and verdict(spread[:1], 0.1, 5)["from_zero"] is None
    with pytest.raises(ValueError, match="nonzero"):
        verdict(spread, 0.0, 5)


@pytest.mark.parametrize("threshold", [0.1, -0.1])
def test_a_verdict_at_the_boundary_needs_the_whole_interval_beyond_the_threshold(threshold):
    side = 1 if threshold > 0 else -1
    spread = [-0.05 * 2 ** 0.5, 0.0, 0.0, 0.0, 0.05 * 2 ** 0.5]  # mean 0, sd 0.05
    half = t_quantile(5) * 0.05 / 5 ** 0.5
    for past, expected in ((1e-6, CONFIRMED), (-1e-6, INCONCLUSIVE)):  # the near end just past / just short
        result = verdict([v + threshold + side * (half + past) for v in spread], threshold, 5)
        assert result["verdict"] == expected, (threshold, past)
    for past, expected in ((1e-6, REFUTED), (-1e-6, INCONCLUSIVE)):  # the far end just short of it / just past
        assert verdict([v + threshold - side * (half + past) for v in spread], threshold, 5)["verdict"] == expected
    touching = [v + side * half for v in spread]  # an end at 0 includes it
    assert verdict([v - side * 1e-6 for v in touching], threshold, 5)["from_zero"] == "includes 0"
    assert verdict([v + side * 1e-6 for v in touching], threshold, 5)["from_zero"] == ("above 0" if side > 0
                                                                                       else "below 0")


def test_hypotheses_are_evaluated_on_the_matched_learning_rows():
    curve = [(1e-3, 0.5, 0.9), (1e-2, 1.0, 0.3)]
    results = []
    for seed, shift in enumerate((0.2, 0.25, 0.3)):
        results += _results("full", seed, {None: curve})
        results += _results("additive-kl", seed, {None: [(r, l, k + shift) for r, l, k in curve]})
    rows = matched_learning(results, (0.9,), lambda r: (r["condition"],), "learn_acc", "retain_acc")
    (entry,) = evaluate_hypotheses({"h": HYPOTHESIS}, rows, {"additive-kl": ("additive-kl",), "full": ("full",)}, 3)
    assert entry["per_seed"] == pytest.approx({"0": 0.2, "1": 0.25, "2": 0.3})
    assert entry["verdict"] == CONFIRMED and entry["mean"] == pytest.approx(0.25)


def test_hypotheses_are_checked_at_load(tmp_path):
    sweep = {"lr_sweep": {"sparse": [1e-3, 1e-2], "lora": [1e-4, 1e-3], "full": [1e-5, 1e-4]},
             "matched_learning": [0.5, 0.9]}
    config = _config(tmp_path, **sweep, hypotheses={"sparse-vs-full": HYPOTHESIS})
    assert config.hypotheses["sparse-vs-full"]["threshold"] == 0.1
    cases = {"same method": ({"b": "additive-kl"}, "the same method"),
             "unknown method": ({"b": "additive-kl/big"}, "not a trained method of this suite; choose from "
                                                            "replacement-kl, "),
             "base": ({"b": "base"}, "not a trained method"),
             "level": ({"level": 0.7}, "0.7 is not a matched_learning level"),
             "threshold": ({"threshold": 0}, "nonzero"),
             "statement": ({"statement": " "}, "statement: give a non-empty string")}
    for name, (change, message) in cases.items():
        with pytest.raises(ConfigError, match=message):
            _config(tmp_path, **sweep, hypotheses={"h": {**HYPOTHESIS, **change}})
    with pytest.raises(ConfigError, match="threshold required"):
        _config(tmp_path, **sweep, hypotheses={"h": {k: v for k, v in HYPOTHESIS.items() if k != "threshold"}})
    with pytest.raises(ConfigError, match="give matched_learning"):
        _config(tmp_path, **{**sweep, "matched_learning": []}, hypotheses={"h": HYPOTHESIS})


def test_cost_beside_kept_and_per_seed_tables():
    curve = [(1e-3, 0.5, 0.9), (1e-2, 1.0, 0.3)]
    results = []
    for seed in (0, 1):
        for record in _results("full", seed, {None: curve}):
            record.update(timing={"train_cpu_s": 10.0 + seed, "retrofit_cpu_s": 4.0, "background_cpu_s": 1.0},
                          cost={"steps": 20, "tokens": 100, "parameters": 7, "trained": 7, "flops": 4.2e12},
                          sparse_steps={"row_change": 0.02 * (1 + seed), "row_change_vs_start": 0.5})
            results.append(record)
    costs = cost_rows(results, lambda r: (r["condition"],))
    cost = costs[("full",)]
    assert cost["configurations"] == 2 and cost["steps"] == (20, 20)
    assert cost["train_cpu_s"] == pytest.approx(21.0) and cost["flops"] == pytest.approx(8.4e12)
    assert cost["shared_cpu_s"] == pytest.approx(5.0) and cost["row_change"] == pytest.approx((0.03, 0.02, 0.04))
    rows = matched_learning(results, (0.9,), lambda r: (r["condition"],), "learn_acc", "retain_acc")
    table = "\n".join(cost_markdown(costs, rows, ["0.9"], {("full",): "Full finetune"}))
    assert "| Full finetune | 2 | 20 | 21 | 8.40 | 5 | 0.03 (0.02–0.04) | 0.5 (0.5–0.5) | 0.420 |" in table
    del results[0]["cost"]  # a run written before costs were recorded: the sum is unknown
    assert cost_rows(results, lambda r: (r["condition"],))[("full",)]["flops"] is None
    per_seed = "\n".join(per_seed_markdown(rows, ["0.9"], {("full",): "Full finetune"}, None))
    assert "| Full finetune | 0.9 | 0.420 | 0.420 |" in per_seed


def test_hypotheses_are_registered_with_the_runs_finished_then(tmp_path, caplog):
    import json

    from smf.suite.plan import SuiteLayout
    from smf.suite.runner import SuiteRunner
    from smf.vocabulary import METRIC_OF_TASK

    sweep = {"lr_sweep": {"sparse": [1e-3, 1e-2], "lora": [1e-4, 1e-3], "full": [1e-5, 1e-4]},
             "matched_learning": [0.9]}
    config = _config(tmp_path, **sweep, hypotheses={"h": HYPOTHESIS})
    layout = SuiteLayout(config.output_dir)
    SuiteRunner(config).register_hypotheses(config)
    first = json.loads(layout.hypotheses_file.read_text())
    assert first["runs_finished"] == 0 and first["runs_planned"] == len(plan_runs(config))
    layout.results_dir.mkdir(parents=True)
    run = plan_runs(config)[0]  # finished: a whole record of this configuration (smf.suite.finished)
    layout.results_path(run).write_text(json.dumps({
        "condition": run.condition, "seed": run.seed, "config_hash": run_hash(config, run),
        **({} if run.lr is None else {"lr": run.lr}),
        "metrics": {METRIC_OF_TASK[task]: 1.0 for task in config.eval.tasks},
        "timing": {"eval_s": {task: 1.0 for task in config.eval.tasks}}}))
    SuiteRunner(config).register_hypotheses(config)
    assert json.loads(layout.hypotheses_file.read_text()) == first  # the same hypotheses: kept as registered
    changed = _config(tmp_path, **sweep, hypotheses={"h": {**HYPOTHESIS, "threshold": 0.2}})
    SuiteRunner(changed).register_hypotheses(changed)
    assert json.loads(layout.hypotheses_file.read_text())["runs_finished"] == 1
    assert "the hypotheses changed" in caplog.text
