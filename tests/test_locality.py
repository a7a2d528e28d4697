"""The update-locality experiment's machinery (smf/configs/suite_locality.yaml, docs/science.md): suite ``variants``
(validation, run names, shared retrofits, hashes) and the locality diagnostics (smf/suite/locality_diagnostics.py),
on hand-made tensors and on a reduced world end to end. No test says which variant wins."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from smf.errors import ConfigError
from smf.suite.config import load_suite_config, parse_suite_config
from smf.suite.locality_diagnostics import (Reads, changed_rows, quartile_rows, read_overlap, row_growth, run_locality,
                                              weight_on)
from smf.suite.fingerprints import run_hash
from smf.suite.plan import SuiteLayout, plan_runs, sparse_stage_dirs
from test_science import SMALL_PRETRAIN, SMALL_WORLD

LOCALITY = Path(__file__).parents[1] / "smf" / "configs" / "suite_locality.yaml"


def _raw(tmp_path, **overrides) -> dict:
    raw = {"name": "v", "output_dir": str(tmp_path / "suite"), "seeds": [0], "device": "cpu",
           "conditions": ["base", "additive-tfidf", "lora"], "world": SMALL_WORLD, "pretrain": SMALL_PRETRAIN,
           "train": {"n_keys": 8, "rows_per_step": 4},
           "variants": {"a-t2": {"rows_per_step": 2, "lr_sweep": [1e-2, 1e-1]},
                        "b-k16": {"n_keys": 16, "lr_sweep": [1e-2, 1e-1]}},
           "lr_sweep": {"lora": [1e-3, 1e-2]}}
    return {**raw, **overrides}


def _parse(raw, tmp_path):
    return parse_suite_config(raw, tmp_path, check_paths=False)


def test_variants_plan_runs_names_shared_retrofits_and_hashes(tmp_path):
    config = _parse(_raw(tmp_path), tmp_path)
    names = [run.name for run in plan_runs(config)]
    assert names == ["base-seed0", "additive-tfidf-a-t2-lr0.01-seed0", "additive-tfidf-a-t2-lr0.1-seed0",
                     "additive-tfidf-b-k16-lr0.01-seed0", "additive-tfidf-b-k16-lr0.1-seed0", "lora-lr0.001-seed0",
                     "lora-lr0.01-seed0"]
    runs = {run.name: run for run in plan_runs(config)}
    layout = SuiteLayout(config.output_dir)
    dirs = {name: tuple(p.name for p in sparse_stage_dirs(layout, run, config)) for name, run in runs.items()
            if run.recipe == "sparse"}
    assert dirs["additive-tfidf-a-t2-lr0.01-seed0"] == ("additive-seed0", "additive-seed0")  # T is not the retrofit's
    assert dirs["additive-tfidf-b-k16-lr0.1-seed0"] == ("additive-nkeys16-seed0", "additive-nkeys16-seed0")
    hashes = {name: run_hash(config, run) for name, run in runs.items()}
    assert len(set(hashes.values())) == len(hashes)
    plain = _parse(_raw(tmp_path, variants={}, lr_sweep={"sparse": [1e-2, 1e-1], "lora": [1e-3, 1e-2]}), tmp_path)
    assert hashes["base-seed0"] == run_hash(plain, plan_runs(plain)[0])  # variants change only the sparse runs


def test_suites_without_variants_keep_their_hashes():
    """Run hashes written before variants existed (the paper preset, computed on the commit before them; the tiny
    preset's hashes hold its data files' absolute paths, so they differ between checkouts and are not compared)."""
    expected = {"paper": {"base-seed0": "f91a3b94b63c6f53", "replacement-kl-seed0": "5f7e23bf1a4f2add",
                          "full-seed2": "af9f9236e304db2b"}}
    for name, hashes in expected.items():
        config = load_suite_config(name)
        runs = {run.name: run for run in plan_runs(config)}
        assert {run: run_hash(config, runs[run]) for run in hashes} == hashes


@pytest.mark.parametrize("change, message", [
    ({"variants": {"a": {"rows_per_step": 2, "lr_sweep": [1e-2]}}}, "same number of learning rates"),
    ({"variants": {"a": {"bogus": 1, "lr_sweep": [1e-2, 1e-1]}}}, "variants.a: option 'bogus' is unknown"),
    ({"variants": {"a": {"seed": 1, "lr_sweep": [1e-2, 1e-1]}}}, "'seed' is set by the suite"),
    ({"variants": {"a": {"lr": 1e-2, "lr_sweep": [1e-2, 1e-1]}}}, "'lr' comes from the variant's lr_sweep"),
    ({"variants": {"a": {"rows_per_step": 2}}}, r"variants.a.lr_sweep is required"),
    ({"variants": {"a": {"rows_per_step": 0, "lr_sweep": [1e-2, 1e-1]}}}, "rows_per_step"),
    ({"variants": {"a": {"lr_sweep": [1e-2, -1]}}}, "variants.a.lr_sweep"),
    ({"variants": {"A b": {"lr_sweep": [1e-2, 1e-1]}}}, "a variant's name is part of its runs' names"),
    ({"variants": {"a": {"n_keys": 16, "lr_sweep": [1e-2, 1e-1]}, "b": {"n_keys": 16, "lr_sweep": [1e-1, 2]}}},
     r"variants.b: the same options as variants.a and a configuration in common with it \(epochs, lr\) \(None, 0.1\)"),
    ({"variants": {"a": {"n_keys": 16, "lr_sweep": [1e-2, 1e-1]},
                   "b": {"n_keys": 16, "schedule_sweep": {10: [3e-3], 40: [1e-1, 2]}}}},
     r"variants.b: the same options as variants.a and a configuration in common with it \(epochs, lr\) \(40, 0.1\)"),
    ({"lr_sweep": {"sparse": [1e-2, 1e-1], "lora": [1e-3, 1e-2]}}, "sparse: not used with variants"),
    ({"lr_sweep": {}}, "no learning rates for lora"),
])
def test_variants_are_checked_in_one_line(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message) as error:
        _parse(_raw(tmp_path, **change), tmp_path)
    assert "\n" not in str(error.value)


def test_variants_with_the_same_options_run_when_their_grids_share_no_configuration(tmp_path):
    """A second grid of one method (the same options, other configurations): each variant's runs, the same hash
    where only the variant's name would differ."""
    config = _parse(_raw(tmp_path, variants={"a": {"n_keys": 16, "lr_sweep": [1e-2, 1e-1]},
                                             "b": {"n_keys": 16, "schedule_sweep": {10: [3e-2], 40: [5e-1]}}}),
                    tmp_path)
    runs = [run for run in plan_runs(config) if run.variant]
    assert {(run.variant, run.epochs, run.lr) for run in runs if run.condition == "additive-tfidf"} == {
        ("a", None, 1e-2), ("a", None, 1e-1), ("b", 10, 3e-2), ("b", 40, 5e-1)}
    assert config.variant_options("a") == config.variant_options("b")


def test_a_variants_combination_is_checked_naming_it(tmp_path):
    raw = yaml.safe_load(LOCALITY.read_text())
    raw.update(output_dir=str(tmp_path), variants={"tiny-k": {"n_keys": 2, "lr_sweep": [1, 2, 3, 4, 5]}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"^variants.tiny-k: --topk 8 must be <= --n-keys 2$"):
        load_suite_config(str(path))


def test_locality_measures_on_hand_made_tensors():
    before = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    after = before.clone()
    after[0] = torch.tensor([3.0, 7.0])  # moved by 3 of 5
    after[2, 1] = 3.0  # moved by 1 of 2
    changed = changed_rows(before, after)
    assert changed.tolist() == [True, False, True, False]
    assert row_growth(before, after, changed).tolist() == pytest.approx([0.6, 0.5])
    # question 0, one token: rows 0 (0.25) and 1 (0.75); question 1: rows 2 and 3, then (its last token) 3 and 1
    reads = Reads(question=torch.tensor([0, 0, 1, 1, 1, 1]), slot=torch.tensor([0, 1, 2, 3, 3, 1]),
                  weight=torch.tensor([0.25, 0.75, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64),
                  last=torch.tensor([True, True, False, False, True, True]), questions=2)
    on, total = weight_on(reads, changed)
    assert on.tolist() == [0.25, 0.5] and total.tolist() == [1.0, 2.0]
    on, total = weight_on(reads, changed, last_only=True)
    assert on.tolist() == [0.25, 0.0] and total.tolist() == [1.0, 1.0]
    result = run_locality({1: before}, {1: after}, {1: reads}, [True, True], [True, False])
    assert result["layers"]["1"] == {"slots": 4, "rows_changed": 2, "rows_changed_fraction": 0.5,
                                     "median_growth": pytest.approx(0.55), "read_share": pytest.approx(0.25),
                                     "answer_read_share": pytest.approx(0.125)}
    assert result["overall"]["rows_changed_fraction"] == 0.5
    quartiles = result["quartiles"]
    assert [q["questions"] for q in quartiles] == [1, 1, 0, 0]
    assert quartiles[0]["share_low"] == 0.25 and quartiles[0]["kept"] == 1.0  # ties: in question order
    assert quartiles[1]["kept"] == 0.0 and quartiles[2]["acc_after"] is None


def test_read_overlap_on_hand_made_reads():
    """Old questions' read weight on slots the new questions read: all tokens against every slot a new token reads,
    the answer position against the slots the new questions' last tokens read; over layers, the summed weights."""
    old = Reads(question=torch.tensor([0, 0, 1, 1, 1, 1]), slot=torch.tensor([0, 1, 2, 3, 3, 1]),
                weight=torch.tensor([0.25, 0.75, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64),
                last=torch.tensor([True, True, False, False, True, True]), questions=2)
    new = {1: Reads(question=torch.tensor([0, 0]), slot=torch.tensor([1, 3]),  # slot 1 before the last token
                    weight=torch.tensor([1.0, 1.0], dtype=torch.float64), last=torch.tensor([False, True]),
                    questions=1),
           2: Reads(question=torch.tensor([0]), slot=torch.tensor([0]), weight=torch.tensor([1.0], dtype=torch.float64),
                    last=torch.tensor([True]), questions=1)}
    result = read_overlap({1: old, 2: old}, new, {1: 4, 2: 4})
    # layer 1: question 0 has 0.75 of 1 on slots {1, 3}, question 1 has 1.5 of 2; at the answer, on {3}: 0 and 0.5
    assert result["layers"]["1"] == pytest.approx({"read_overlap": 0.75, "answer_read_overlap": 0.25})
    assert result["layers"]["2"] == pytest.approx({"read_overlap": 0.125, "answer_read_overlap": 0.125})
    # both layers: question 0 (0.75 + 0.25) / 2, question 1 (1.5 + 0) / 4; answer: (0 + 0.25) / 2, (0.5 + 0) / 2
    assert result["overall"] == pytest.approx({"read_overlap": (0.5 + 0.375) / 2, "answer_read_overlap": 0.1875})
    with pytest.raises(ValueError, match="same layers"):
        read_overlap({1: old}, new, {1: 4, 2: 4})


def test_quartiles_split_by_share_lowest_first():
    share = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4])
    rows = quartile_rows(share, [True] * 8, [q % 2 == 0 for q in range(8)])
    assert [bound for q in rows for bound in (q["share_low"], q["share_high"])] == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.8, 0.9])
    assert [q["acc_after"] for q in rows] == [0.0, 0.0, 1.0, 1.0]  # questions 1,5 | 3,7 | 2,4 | 6,0
    with pytest.raises(ValueError, match="one entry per question"):
        quartile_rows(share, [True], [True])


def test_locality_suite_end_to_end(tmp_path, monkeypatch):
    """Two variants of additive TF-IDF on the reduced world: their runs, shared and separate retrofits, results and
    report rows carrying the variant, and locality.md / .json consistent with the runs' own evaluation."""
    from smf.suite.report import write_suite_report
    from smf.suite.runner import run_suite

    raw = yaml.safe_load(LOCALITY.read_text())
    raw.update(output_dir=str(tmp_path / "suite"), seeds=[0], conditions=["base", "additive-tfidf"],
               world={k: v for k, v in SMALL_WORLD.items() if k != "seed"},  # base_per_seed: the run's seed
               pretrain={k: v for k, v in {**SMALL_PRETRAIN, "epochs": 2}.items() if k != "seed"}, lr_sweep={},
               variants={"k4-t2": {"n_keys": 4, "rows_per_step": 2, "lr_sweep": [0.3]},
                         "k8-tall": {"rows_per_step": 64, "lr_sweep": [0.3]}})
    raw["train"].update(layers=[0, 1], n_keys=8, topk=2, key_dim=16, n_background=20)
    raw["stages"] = {"retrofit": {"epochs": 1}, "sparse": {"epochs": 1}}
    path = tmp_path / "locality.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_suite_config(str(path))
    results = {r.get("variant"): r for r in run_suite(config)}
    assert set(results) == {None, "k4-t2", "k8-tall"}
    root = config.output_dir
    assert sorted(p.name for p in (root / "retrofit").iterdir()) == ["additive-nkeys4-seed0", "additive-seed0"]
    trained = json.loads((root / "train" / "additive-tfidf-k4-t2-lr0.3-seed0" / "run_config.json").read_text())
    assert (trained["rows_per_step"], trained["lr"]) == (2, 0.3)  # the variant's option and rate
    assert json.loads((root / "retrofit" / "additive-nkeys4-seed0" / "run_config.json").read_text())["n_keys"] == 4
    written = {p.name for p in write_suite_report(root)}
    assert {"locality.md", "locality.json", "table1.md", "lr_sweep.md"} <= written
    assert "Additive sparse (TF-IDF) [k4-t2]" in (root / "table1.md").read_text()
    assert "Additive sparse (TF-IDF) [k8-tall]" in (root / "lr_sweep.md").read_text()
    assert "k4-t2: n_keys=4, rows_per_step=2" in (root / "accounting.md").read_text()
    measured = json.loads((root / "locality.json").read_text())["runs"]
    assert sorted(measured) == ["additive-tfidf-k4-t2-lr0.3-seed0", "additive-tfidf-k8-tall-lr0.3-seed0"]
    for name, entry in measured.items():
        result = results[entry["variant"]]
        slots, per_step = (16, 2) if entry["variant"] == "k4-t2" else (64, 64)
        for layer in entry["layers"].values():  # the exact update moves only selected rows
            assert layer["slots"] == slots
            assert 0 < layer["rows_changed"] <= min(slots, result["sparse_steps"]["steps"] * per_step)
            assert 0 <= layer["read_share"] <= 1
        quartiles = entry["quartiles"]
        assert sum(q["questions"] for q in quartiles) == SMALL_WORLD["n_retain"]
        after = sum(q["acc_after"] * q["questions"] for q in quartiles) / SMALL_WORLD["n_retain"]
        assert after == pytest.approx(result["metrics"]["retain_acc"])  # the run's own per-question answers
        overlap = entry["read_overlap"]
        assert set(overlap["layers"]) == set(entry["layers"])
        assert all(0 < share <= 1 for share in overlap["overall"].values())
    assert "[k8-tall]" in (root / "locality.md").read_text()

    def no_loading(*args, **kwargs):
        raise AssertionError("a cached measurement was recomputed")

    monkeypatch.setattr("smf.suite.locality_diagnostics.load_model", no_loading)
    from smf.suite.locality_diagnostics import compute_locality

    assert compute_locality(config, list(results.values()), root) == measured
    older = json.loads((root / "locality.json").read_text())
    (root / "locality.json").write_text(json.dumps({"runs": older["runs"]}))  # a cache of an older version
    with pytest.raises(AssertionError, match="recomputed"):  # is measured again, not read with missing fields
        compute_locality(config, list(results.values()), root)


def test_question_reads_weigh_each_real_token_and_head_once(tmp_path):
    from smf.model import attach_memories
    from smf.suite.locality_diagnostics import question_reads
    from smf.tiny import tiny_model, tiny_tokenizer

    torch.manual_seed(0)
    model, tokenizer = tiny_model(), tiny_tokenizer()
    attach_memories(model, layers=[0], mode="additive", n_keys=4, heads=2, topk=3, key_dim=8)
    prompts = ["Question: a?\nAnswer:", "Question: a longer one?\nAnswer:", "Q"]
    reads = question_reads(model.eval(), tokenizer, prompts, batch_size=2)
    (layer,) = reads.values()
    tokens = torch.tensor([len(tokenizer(p)["input_ids"]) for p in prompts], dtype=torch.float64)
    total = torch.bincount(layer.question, weights=layer.weight, minlength=3)
    assert total.tolist() == pytest.approx((2 * tokens).tolist())  # softmax weights sum to 1 per token and head
    last = torch.bincount(layer.question, weights=layer.weight * layer.last.double(), minlength=3)
    assert last.tolist() == pytest.approx([2.0, 2.0, 2.0])  # one last token per question, whatever its padding
    assert int(layer.slot.max()) < 16


def test_locality_preset_shares_the_science_base_and_plans_its_grid():
    science = yaml.safe_load((LOCALITY.parent / "suite_science.yaml").read_text())
    raw = yaml.safe_load(LOCALITY.read_text())
    assert {key: raw[key] for key in ("world", "pretrain", "train")} == \
        {key: science[key] for key in ("world", "pretrain", "train")}
    config = load_suite_config("locality")
    runs = plan_runs(config)
    assert len(runs) == len(config.seeds) * (1 + 12 * 5 + 5)
    grid = {(o["n_keys"], o["rows_per_step"], o["row_optimizer"]) for o in config.variants.values()}
    assert grid == {(n, t if t else n * n, opt) for n in (32, 128) for t in (16, 128, None) for opt in ("adamw", "sgd")}
    layout = SuiteLayout(config.output_dir)
    retrofits = {sparse_stage_dirs(layout, run, config)[0].name for run in runs if run.recipe == "sparse"}
    assert retrofits == {f"additive{tag}-seed{s}" for tag in ("", "-nkeys128") for s in config.seeds}
