"""The science preset (docs/science.md) on a reduced world: the generator is deterministic and its sets disjoint, the
world tokenizer writes every word as one token and survives save/load, pretraining teaches the old facts (above
chance) and resumes, and a suite with a world, pretraining and a learning-rate sweep runs every stage end to end and
reports Table 1 at each method's chosen rate. No test says which method wins."""
import json
from pathlib import Path

import pytest
import yaml

from smf.data.world import ATTRIBUTES, FAMILY_NAMES, FIRST_NAMES, WorldOptions, build_world, chance_accuracy, qa_text
from smf.errors import ConfigError
from smf.report.intervals import t_quantile, with_intervals
from smf.report.table import summarize
from smf.suite.config import load_suite_config, parse_suite_config
from smf.suite.plan import plan_runs
from smf.suite.science import chosen_rates

SMALL_WORLD = {"seed": 3, "n_old": 40, "n_new": 8, "bio_renders": 4, "heldout_people": 10, "n_retain": 40}
SMALL_PRETRAIN = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "epochs": 60, "lr": 1e-2, "batch_size": 16, "warmup_steps": 10, "seed": 0}


def _rows(world):
    return {role: [dict(row) for row in dataset] for role, dataset in world.datasets.items()}


def test_world_is_deterministic_per_seed():
    first, again = build_world(SMALL_WORLD), build_world(SMALL_WORLD)
    assert _rows(first) == _rows(again)
    other = build_world({**SMALL_WORLD, "seed": 4})
    assert _rows(other)["pretrain"] != _rows(first)["pretrain"]


def test_world_sets_are_disjoint_and_new_names_reuse_old_parts():
    world = build_world(SMALL_WORLD)
    rows = _rows(world)
    texts = {role: {row["text"] for row in rows[role] if not row["text"].startswith("Question:")}  # biographies
             for role in ("pretrain", "retrofit", "background", "eval_heldout")}
    for role, own in texts.items():
        for other, theirs in texts.items():
            if role != other:
                assert not own & theirs, (role, other)
    old_names = {person.name for person in world.old}
    assert not old_names & {person.name for person in world.new}
    assert {p.first for p in world.new} <= {p.first for p in world.old}
    assert {p.family for p in world.new} <= {p.family for p in world.old}
    new_text = " ".join(row["question"] for row in rows["train"])
    assert not any(name in new_text for name in old_names)  # the finetuning task asks about new people only
    assert len(rows["train"]) == SMALL_WORLD["n_new"] * sum(len(q) for _, _, q in ATTRIBUTES.values())
    assert len(rows["eval_learn"]) == SMALL_WORLD["n_new"] * len(ATTRIBUTES)
    assert len(rows["eval_retain"]) == SMALL_WORLD["n_retain"]


def test_world_options_are_checked():
    with pytest.raises(ConfigError, match="n_old"):
        WorldOptions.from_dict({"n_old": 0})
    with pytest.raises(ConfigError, match="exceeds"):
        WorldOptions.from_dict({"n_old": len(FIRST_NAMES) * len(FAMILY_NAMES), "n_new": 1})


def test_world_tokenizer_one_token_per_word_and_reloads(tmp_path):
    from transformers import AutoTokenizer

    from smf.data.world_tokenizer import world_tokenizer
    from smf.train.pretrain import PretrainOptions, world_model

    tokenizer = world_tokenizer()
    sentence = "the hometown of Abel Aldmoor is Istra ."
    assert len(tokenizer(sentence)["input_ids"]) == len(sentence.split())
    world_model(PretrainOptions(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1),
                tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for row in build_world(SMALL_WORLD).datasets["train"]:
        text = qa_text(row["question"], row["answers"][0])
        assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in tokenizer(sentence)["input_ids"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from smf.train.pretrain import PretrainOptions, pretrain_world

    directory = tmp_path_factory.mktemp("pretrain")
    marker = pretrain_world(WorldOptions.from_dict(SMALL_WORLD), PretrainOptions.from_dict(SMALL_PRETRAIN), directory)
    return directory, marker


def test_pretrained_model_answers_old_questions_above_chance(pretrained):
    directory, marker = pretrained
    assert marker["chance"] == pytest.approx(chance_accuracy())
    assert marker["old_qa_accuracy"] > 3 * chance_accuracy()
    assert (directory / "final" / "config.json").is_file() and not (directory / "pretrain_checkpoint.pt").exists()


def test_pretraining_is_reused_refused_and_resumes(pretrained, tmp_path, monkeypatch):
    from smf.train import pretrain as module

    directory, marker = pretrained
    world, options = WorldOptions.from_dict(SMALL_WORLD), module.PretrainOptions.from_dict(SMALL_PRETRAIN)
    assert module.pretrain_world(world, options, directory)["skipped"]
    short = module.PretrainOptions.from_dict({**SMALL_PRETRAIN, "epochs": 2, "save_every": 3})
    with pytest.raises(ConfigError, match="other world or pretrain options"):
        module.pretrain_world(world, short, directory)
    whole = module.pretrain_world(world, short, tmp_path / "whole")
    original = module._lr_factor

    def stop_at_step_three(step, warmup, total):
        if step == 3:
            raise KeyboardInterrupt  # killed after the checkpoint of step 3
        return original(step, warmup, total)

    monkeypatch.setattr(module, "_lr_factor", stop_at_step_three)
    with pytest.raises(KeyboardInterrupt):
        module.pretrain_world(world, short, tmp_path / "interrupted")
    assert (tmp_path / "interrupted" / module.CHECKPOINT).is_file()
    monkeypatch.setattr(module, "_lr_factor", original)
    resumed = module.pretrain_world(world, short, tmp_path / "interrupted")
    assert resumed["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-4)
    assert resumed["old_qa_accuracy"] == whole["old_qa_accuracy"]


def test_sweep_budget_must_be_equal(tmp_path):
    raw = {"name": "s", "output_dir": str(tmp_path), "seeds": [0], "conditions": ["base", "additive-kl", "lora"],
           "device": "cpu", "world": SMALL_WORLD, "pretrain": SMALL_PRETRAIN,
           "lr_sweep": {"sparse": [1e-3, 1e-2], "lora": [1e-3]}}
    with pytest.raises(ConfigError, match="same number of learning rates"):
        parse_suite_config(raw, tmp_path, check_paths=False)
    with pytest.raises(ConfigError, match="no learning rates for lora"):
        parse_suite_config({**raw, "lr_sweep": {"sparse": [1e-3]}}, tmp_path, check_paths=False)
    with pytest.raises(ConfigError, match="cannot both be given"):
        parse_suite_config({**raw, "data": {"train": "x.jsonl"}}, tmp_path, check_paths=False)
    config = parse_suite_config({**raw, "lr_sweep": {"sparse": [1e-3, 1e-2], "lora": [1e-3, 3e-3]}}, tmp_path,
                                check_paths=False)
    assert [run.name for run in plan_runs(config)] == [
        "base-seed0", "additive-kl-lr0.001-seed0", "additive-kl-lr0.01-seed0", "lora-lr0.001-seed0",
        "lora-lr0.003-seed0"]
    assert config.model == str(tmp_path.resolve() / "pretrain" / "final")


def test_chosen_rate_and_intervals():
    results = [{"condition": "lora", "seed": s, "lr": lr, "metrics": {"learn_acc": acc}}
               for s, lr, acc in [(0, 1e-3, 0.2), (1, 1e-3, 0.4), (0, 1e-2, 0.3), (1, 1e-2, 0.3),
                                  (0, 3e-2, 0.3), (1, 3e-2, 0.3)]]
    assert chosen_rates(results) == {("lora", "exact", "all", None): 1e-3}  # mean 0.3 = 0.3: ties go to the lower rate
    records = [{"condition": "lora", "seed": r["seed"], **r["metrics"]} for r in results if r["lr"] == 1e-2]
    records[0]["learn_acc"] = 0.1
    (summary,) = with_intervals(summarize(records), records)
    mean, half = summary.stats["learn_acc"]
    assert mean == pytest.approx(0.2) and half == pytest.approx(12.706 * 0.1414213 / 2 ** 0.5, rel=1e-4)
    (summary,) = with_intervals(summarize(records[:1]), records[:1])
    assert summary.stats["learn_acc"] == (0.1, None)  # one seed: no interval
    assert t_quantile(3) == 4.303


def test_science_suite_end_to_end(tmp_path):
    """Every stage of the preset on the reduced world: world, pretraining, the retrofits of both SMF variants,
    background, sparse (plain and +S), LoRA, full, each with two configurations (a schedule swept), evaluation, report
    (matched learning with the hypotheses and the cost beside kept)."""
    from smf.suite.report import write_suite_report
    from smf.suite.runner import run_suite

    raw = yaml.safe_load((Path(__file__).parents[1] / "smf" / "configs" / "suite_science.yaml").read_text())
    raw.update(output_dir=str(tmp_path / "suite"), seeds=[3],  # base_per_seed: world seed 3, as SMALL_WORLD's
               world={k: v for k, v in SMALL_WORLD.items() if k != "seed"},
               pretrain={k: v for k, v in {**SMALL_PRETRAIN, "epochs": 2}.items() if k != "seed"},
               lr_sweep={}, schedule_sweep={"lora": {1: [1e-3], 2: [1e-3]}, "full": {1: [1e-3], 2: [1e-3]}})
    raw["variants"]["large-step"].update(n_keys=8, rows_per_step=16, lr_sweep=[1e-2, 3e-2])
    raw["variants"]["paper-like"].update(n_keys=8, rows_per_step=32, schedule_sweep={1: [1e-2], 2: [1e-2]})
    assert raw["base_per_seed"] and raw["matched_learning"] and raw["hypotheses"]
    raw["train"].update(layers=[0, 1], n_keys=8, topk=4, key_dim=16, rows_per_step=16, n_background=20)
    raw["stages"] = {"retrofit": {"epochs": 1}, "sparse": {"epochs": 1}, "lora": {"epochs": 1}, "full": {"epochs": 1}}
    path = tmp_path / "science.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_suite_config(str(path))
    results = run_suite(config)
    assert len(results) == 1 + 2 * (len(config.conditions) - 1)
    assert {r["condition"] for r in results} == set(config.conditions)
    assert [r.get("epochs") for r in results if r["condition"] == "full"] == [None, 2]  # plan order
    for result in results:
        assert set(result["metrics"]) == {"learn_acc", "heldout_ppl", "retain_acc"}
        assert (result.get("lr") is None) == (result["condition"] == "base")
    written = {p.name for p in write_suite_report(config.output_dir)}
    assert {"table1.md", "pareto.png", "lr_sweep.md", "report.md", "science_diagnostics.md", "matched_learning.md",
            "environment.md"} <= written
    diagnostics = json.loads((config.output_dir / "science_diagnostics.json").read_text())
    assert set(diagnostics["retrofit"]) == {"additive-seed3", "additive-alphalr0.0005-seed3"}
    (reset,) = diagnostics["alpha_reset"]
    assert reset.startswith("additive+s-tfidf-paper-like-")
    report = (config.output_dir / "report.md").read_text()
    assert "95% Student-t interval" in report and "new-fact acc" in report and "# Environment" in report
    matched_json = json.loads((config.output_dir / "matched_learning.json").read_text())
    matched = matched_json["rows"]
    assert all("vs_reference" in cell for row in matched if row["method"][0] != "full"
               for cell in row["levels"].values())  # every method compared with full finetuning
    assert sorted(h["name"] for h in matched_json["hypotheses"]) == sorted(raw["hypotheses"])
    assert all(h["verdict"] == "inconclusive" for h in matched_json["hypotheses"])  # one seed: no interval
    text = (config.output_dir / "matched_learning.md").read_text()
    assert "## Cost beside kept" in text and "## Per seed" in text and "**exploratory**" in text
    environment = json.loads((config.output_dir / "environment.json").read_text())
    (base,) = environment["bases"]
    assert base["seed"] == 3 and base["metrics"] == next(r["metrics"] for r in results if r["condition"] == "base")
    assert environment["environments"][0]["runs"] == len(results)
    world = json.loads((config.output_dir / "bases" / "seed3" / "world" / "world.json").read_text())
    assert world["options"] == WorldOptions.from_dict(SMALL_WORLD).to_dict()


def test_tiny_preset_says_it_is_a_smoke_test():
    notice = load_suite_config("tiny").notice
    assert "Smoke test" in notice and "mean nothing" in notice and "--config science" in notice
