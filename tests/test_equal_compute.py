"""The equal-compute envelope (issue 58 item 3): a run's compute (training CPU seconds plus the shared retrofit and
background of a sparse run), the per-seed budget (the ``equal_compute`` method's costliest run), the runs within it,
the report's section and the hypotheses read on it, and ``equal_compute`` / a hypothesis's ``envelope`` checked at
load. Synthetic records; no test says which method wins."""
import pytest

from smf.errors import ConfigError
from smf.report.equal_compute import configurations_within, run_compute, seed_budgets, within_budget
from smf.report.matched_learning import matched_learning
from smf.suite.config import load_suite_config
from smf.suite.report import write_matched_learning

PAPER = {"authors_update": [], "conditions": ["base", "additive-kl", "lora", "full"]}
SWEEP = {"schedule_sweep": {"sparse": {10: [1e-2, 1e-1]}, "lora": {10: [1e-4, 1e-3]}, "full": {10: [1e-5, 1e-4]}},
         "matched_learning": [0.9]}
HYPOTHESIS = {"a": "additive-kl", "b": "full", "level": 0.9, "threshold": 0.1, "statement": "sparse keeps more"}


def _config(tmp_path, **overrides):
    return load_suite_config("paper", {"output_dir": str(tmp_path / "suite"), **PAPER, **SWEEP, **overrides})


def _run(condition, seed, epochs, lr, learned, kept, train_cpu, shared=None):
    timing = {"train_cpu_s": train_cpu, **({"retrofit_cpu_s": shared[0], "background_cpu_s": shared[1]}
                                           if shared else {})}
    return {"condition": condition, "seed": seed, "epochs": epochs, "lr": lr, "update": "exact",
            "metrics": {"learn_acc": learned, "retain_acc": kept}, "timing": timing}


def _key(result):
    return (result["condition"],)


def _results(seeds=(0, 1, 2)):
    """Per seed: full finetuning at 10 and 40 epochs (the costliest 40 CPU-s), sparse at 10 epochs (cheap with its
    retrofit) and at 80 (over the budget once its retrofit counts), each schedule two rates bracketing 0.9."""
    results = []
    for seed in seeds:
        shift = 0.01 * seed
        results += [_run("full", seed, 10, 1e-4, 0.8, 0.7, 10.0), _run("full", seed, 10, 3e-4, 1.0, 0.5, 10.5),
                    _run("full", seed, 40, 2e-5, 0.8, 0.8, 39.0), _run("full", seed, 40, 6e-5, 1.0, 0.6 + shift, 40.0)]
        results += [_run("additive-kl", seed, 10, 1e-1, 0.8, 0.75, 5.0, (12.0, 1.0)),
                    _run("additive-kl", seed, 10, 3e-1, 1.0, 0.55 + 2 * shift, 5.5, (12.0, 1.0)),
                    _run("additive-kl", seed, 80, 3e-3, 0.8, 0.95, 30.0, (12.0, 1.0)),
                    _run("additive-kl", seed, 80, 1e-2, 1.0, 0.85, 31.0, (12.0, 1.0))]
    return results


def test_a_runs_compute_counts_the_shared_stages_it_starts_from():
    assert run_compute(_run("full", 0, 10, 1e-4, 0.5, 0.5, 10.0)) == pytest.approx(10.0)
    assert run_compute(_run("additive-kl", 0, 80, 1e-3, 0.5, 0.5, 30.0, (12.0, 1.5))) == pytest.approx(43.5)
    assert run_compute({"timing": {"retrofit_cpu_s": 3.0}}) is None  # no training stage recorded
    assert run_compute({"lr": 1e-3}) is None


def test_the_budget_is_the_reference_methods_costliest_run_of_each_seed():
    results = _results()
    assert seed_budgets(results, _key, ("full",)) == {0: 40.0, 1: 40.0, 2: 40.0}
    del results[0]["timing"]["train_cpu_s"]  # a run of seed 0 without its record: seed 0 has no budget
    assert seed_budgets(results, _key, ("full",)) == {1: 40.0, 2: 40.0}
    budgets = {0: 40.0, 1: 40.0, 2: 40.0}
    inside = within_budget(_results(), budgets)
    assert {(r["condition"], r["epochs"]) for r in inside} == {("full", 10), ("full", 40), ("additive-kl", 10)}
    assert configurations_within(_results(), budgets, _key) == {("full",): "12 of 12", ("additive-kl",): "6 of 12"}
    assert within_budget(_results(), {0: 40.0}) == [r for r in inside if r["seed"] == 0]  # seeds without one: out


def test_the_equal_compute_envelope_drops_the_configurations_over_the_budget():
    results = _results()
    (every,) = [row for row in matched_learning(results, (0.9,), _key, "learn_acc", "retain_acc")
                if row["method"] == ["additive-kl"]]
    inside = within_budget(results, seed_budgets(results, _key, ("full",)))
    (equal,) = [row for row in matched_learning(inside, (0.9,), _key, "learn_acc", "retain_acc")
                if row["method"] == ["additive-kl"]]
    assert every["levels"]["0.9"]["per_seed"]["0"] == pytest.approx(0.9)  # the 80-epoch schedule's
    assert equal["levels"]["0.9"]["per_seed"]["0"] == pytest.approx(0.65)  # the 10-epoch one's only


def test_the_report_section_and_hypotheses_read_on_the_compute_envelope(tmp_path):
    hypotheses = {"every": HYPOTHESIS, "equal": {**HYPOTHESIS, "envelope": "compute"}}
    config = _config(tmp_path, equal_compute="full", hypotheses=hypotheses)
    out = tmp_path / "report"
    out.mkdir()
    write_matched_learning(config, _results(), out)
    text = (out / "matched_learning.md").read_text()
    assert "## Equal compute" in text and "seed 0: 40.0, seed 1: 40.0, seed 2: 40.0" in text
    assert "Additive sparse (KL) 6 of 12" in text
    import json
    evaluated = {entry["name"]: entry for entry in json.loads((out / "matched_learning.json").read_text())
                 ["hypotheses"]}
    # per seed: full keeps 0.7 + shift / 2 (its 40-epoch schedule); sparse 0.9 over every configuration (80 epochs),
    # 0.65 + shift within the budget (10 epochs)
    assert evaluated["every"]["per_seed"] == pytest.approx({"0": 0.2, "1": 0.195, "2": 0.19})
    assert evaluated["equal"]["per_seed"] == pytest.approx({"0": -0.05, "1": -0.045, "2": -0.04})
    assert evaluated["every"]["verdict"] == "confirmed" and evaluated["equal"]["verdict"] == "refuted"
    plain = _config(tmp_path / "plain", hypotheses={"every": HYPOTHESIS})  # no equal_compute: no section
    write_matched_learning(plain, _results(), out)
    assert "## Equal compute" not in (out / "matched_learning.md").read_text()


def test_equal_compute_and_the_envelope_are_checked_at_load(tmp_path):
    config = _config(tmp_path, equal_compute="full", hypotheses={"h": {**HYPOTHESIS, "envelope": "compute"}})
    assert config.equal_compute == "full" and config.to_dict()["equal_compute"] == "full"
    assert "equal_compute" not in _config(tmp_path).to_dict()  # records of suites without it stay as they were
    assert list(_config(tmp_path, hypotheses={"h": HYPOTHESIS}).hypotheses["h"]) == list(HYPOTHESIS)
    cases = [({"equal_compute": "additive-kl/big"}, "equal_compute: 'additive-kl/big' is not a trained method"),
             ({"equal_compute": "base"}, "equal_compute: 'base' is not a trained method"),
             ({"hypotheses": {"h": {**HYPOTHESIS, "envelope": "compute"}}}, r"h.envelope: compute needs equal_compute"),
             ({"hypotheses": {"h": {**HYPOTHESIS, "envelope": "flops"}}}, r"hypotheses.h.envelope"),
             ({"equal_compute": "full", "matched_learning": []}, "give matched_learning")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            _config(tmp_path, **overrides)
        assert "\n" not in str(err.value)
