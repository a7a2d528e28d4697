"""A user's own data (docs/own-data.md): the schemas and their checks, the training texts and loss masks, the
evaluation roles and their metric keys, the CLI flags and suite keys (refused when mixed with the paper's), and
a reduced own-data suite end to end with its labels in Table 1."""
import json
import logging
from pathlib import Path

import pytest
import yaml

from smf import cli
from smf.data.causal_lm import IGNORE_INDEX
from smf.data.own_data import detect_schema, load_own, tokenize_own
from smf.data.paths import DataPaths
from smf.errors import ConfigError
from smf.eval.settings import EvalSettings
from smf.eval.tasks import evaluate_model, load_eval_sets
from smf.suite.report import write_suite_report
from smf.suite.config import load_suite_config
from smf.suite.runner import run_suite
from smf.train.config import RunConfig
from smf.tiny import tiny_model, tiny_tokenizer

PEOPLE = [("Ada Brook", "Lisbon", "violin"), ("Bo Carter", "Oslo", "chess"), ("Cy Dunn", "Quito", "rowing"),
          ("Di Evans", "Perth", "pottery"), ("Ed Fox", "Lima", "archery"), ("Flo Grant", "Riga", "sailing"),
          ("Gus Hale", "Kyiv", "fencing"), ("Hal Ives", "Baku", "juggling")]


def _write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def own_files(tmp_path_factory) -> dict[str, str]:
    """Small text, qa and mc files of a fictional world, by role."""
    root = tmp_path_factory.mktemp("own")
    bios = [{"text": f"{name} was born in {city} and loves {hobby}. {name} lives in {city}."}
            for name, city, hobby in PEOPLE * 3]
    qa = [{"question": f"Where was {name} born?", "answers": [city, city.lower()]} for name, city, _ in PEOPLE]
    hobbies = [hobby for _, _, hobby in PEOPLE]
    mc = [{"question": f"What does {name} love?", "choices": [hobby, hobbies[(i + 1) % 8], hobbies[(i + 2) % 8]],
           "label": 0} for i, (name, _, hobby) in enumerate(PEOPLE)]
    return {"retrofit": _write_jsonl(root / "retrofit.jsonl", bios[:16]),
            "background": _write_jsonl(root / "background.jsonl", bios[16:]),
            "train": _write_jsonl(root / "train.jsonl", qa + qa),
            "eval_learn": _write_jsonl(root / "learn.jsonl", qa[:4]),
            "eval_heldout": _write_jsonl(root / "heldout.jsonl", bios[16:]),
            "eval_retain": _write_jsonl(root / "retain.jsonl", mc[:4])}


def test_schema_is_told_by_the_columns_and_bad_rows_are_refused_by_row(tmp_path):
    assert detect_schema(["text", "id"], "x") == "text"
    assert detect_schema(["question", "answers"], "x") == "qa"
    assert detect_schema(["question", "choices", "label", "answers"], "x") == "mc"
    with pytest.raises(ConfigError, match="match no schema"):
        detect_schema(["prompt"], "--train-data")
    bad = [({"question": "q?", "answers": []}, "line 2: 'answers' must be a non-empty list"),
           ({"question": "q?", "choices": ["a"], "label": 0}, "line 2: 'choices' must be a list of 2 or more"),
           ({"question": "q?", "choices": ["a", "b"], "label": 2}, "line 2: 'label' must be an int index")]
    for row, message in bad:
        good = {key: value for key, value in {"question": "p?", "answers": ["x"], "choices": ["a", "b"],
                                              "label": 1}.items() if key in row}
        path = _write_jsonl(tmp_path / "rows.jsonl", [good, row])
        with pytest.raises(ConfigError, match=message):
            load_own(path, "--eval-learn")
    path = _write_jsonl(tmp_path / "text.jsonl", [{"text": "a"}])
    with pytest.raises(ConfigError, match="holds text rows; --eval-learn takes qa or mc rows"):
        load_own(path, "--eval-learn", ("qa", "mc"))


def test_training_text_and_answer_only_loss():
    tokenizer = tiny_tokenizer()
    row = {"question": "Where was Ada born?", "answers": ["Lisbon", "lisbon"]}
    every = tokenize_own(tokenizer, row, "qa", "all")
    answer = tokenize_own(tokenizer, row, "qa", "answer")
    assert every["input_ids"] == answer["input_ids"] == tokenizer("Question: Where was Ada born?\nAnswer: Lisbon")[
        "input_ids"]
    assert every["labels"] == every["input_ids"]
    prompt_tokens = len(tokenizer("Question: Where was Ada born?\nAnswer:")["input_ids"])
    assert answer["labels"][:prompt_tokens] == [IGNORE_INDEX] * prompt_tokens
    assert answer["labels"][prompt_tokens:] == answer["input_ids"][prompt_tokens:]
    assert tokenizer.decode(answer["input_ids"][prompt_tokens:]).strip() == "Lisbon"
    mc = tokenize_own(tokenizer, {"question": "Q?", "choices": ["no", "yes"], "label": 1}, "mc", "answer")
    assert tokenizer.decode([t for t, label in zip(mc["input_ids"], mc["labels"]) if label != IGNORE_INDEX]).strip() \
        == "yes"


def test_roles_are_scored_by_their_stand_ins_rule_under_their_metric_keys(own_files, tmp_path, caplog):
    model, tokenizer = tiny_model(), tiny_tokenizer()
    data = DataPaths(**{key: own_files[key] for key in ("eval_learn", "eval_heldout", "eval_retain")})
    settings = EvalSettings(tasks=("learn", "heldout", "retain"), triviaqa_max_new_tokens=4, wikitext_window=64,
                            wikitext_stride=32)
    with caplog.at_level(logging.INFO, logger="smf.eval"):
        metrics, _ = evaluate_model(model, tokenizer, load_eval_sets(data, settings, "clean"), settings, tmp_path,
                                    "clean")
    logged = [record.getMessage().split()[:2] for record in caplog.records if record.name.startswith("smf.eval")]
    assert logged == [["learn", "accuracy"], ["heldout", "perplexity"], ["retain", "accuracy"]]  # not the paper's
    assert set(metrics) == {"learn_acc", "heldout_ppl", "retain_acc"}
    assert 0 <= metrics["learn_acc"] <= 1 and 0 <= metrics["retain_acc"] <= 1 and metrics["heldout_ppl"] > 1
    retain = [json.loads(line) for line in (tmp_path / "retain.jsonl").read_text().splitlines()]
    assert len(retain) == 4 and all(len(r["scores"]) == 3 and r["label"] == 0 for r in retain)
    assert len((tmp_path / "learn.jsonl").read_text().splitlines()) == 4


def test_paper_and_own_keys_are_not_mixed(own_files):
    with pytest.raises(ConfigError, match="cannot be mixed"):
        DataPaths(wikitext="/w.jsonl", eval_learn=own_files["eval_learn"])
    with pytest.raises(ValueError, match="mix the paper's tasks"):
        EvalSettings(tasks=("medmcqa", "learn"))


def test_cli_refuses_own_data_flags_beside_the_paper_ones_by_name(own_files, tmp_path, capsys):
    code = cli.main(["train", "--preset", "tiny", "--recipe", "full", "--output-dir", str(tmp_path / "run"),
                     "--train-data", own_files["train"], "--medmcqa-path", own_files["train"]])
    assert code == 2 and "--train-data and --medmcqa-path cannot both be given" in capsys.readouterr().err
    code = cli.main(["eval", "--model", "tiny", "--eval-learn", own_files["eval_learn"], "--wikitext-path",
                     own_files["eval_heldout"]])
    assert code == 2 and "--eval-learn cannot be combined with --wikitext-path" in capsys.readouterr().err
    code = cli.main(["train", "--preset", "tiny", "--recipe", "full", "--output-dir", str(tmp_path / "run"),
                     "--loss-on", "answer"])
    assert code == 2 and "--loss-on is not used" in capsys.readouterr().err


def test_cli_trains_on_own_qa_and_evaluates_the_roles(own_files, tmp_path, capsys):
    run_dir = tmp_path / "full"
    assert cli.main(["train", "--preset", "tiny", "--recipe", "full", "--output-dir", str(run_dir), "--train-data",
                     own_files["train"], "--loss-on", "answer", "--epochs", "1"]) == 0
    options = json.loads((run_dir / "run_config.json").read_text())
    assert options["train_data"] == own_files["train"] and options["loss_on"] == "answer"
    assert options["n_examples"] == 20  # the tiny preset's; without a size own files are used whole:
    assert RunConfig(output_dir=str(run_dir), train_data=own_files["train"]).resolved("full").n_examples is None
    assert RunConfig(output_dir=str(run_dir)).resolved("full").n_examples == 60_000  # MedMCQA: the paper's
    capsys.readouterr()
    assert cli.main(["eval", "--adapter", str(run_dir), "--eval-learn", own_files["eval_learn"], "--eval-retain",
                     own_files["eval_retain"], "--output-dir", str(tmp_path / "eval")]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert set(metrics["metrics"]) == {"learn_acc", "retain_acc"}
    assert metrics["settings"]["tasks"] == ["learn", "retain"]


def _suite_file(tmp_path: Path, own_files: dict, **changes) -> Path:
    raw = {"name": "own", "model": "tiny", "output_dir": str(tmp_path / "suite"), "seeds": [0],
           "conditions": ["base", "additive-tfidf", "full"], "device": "cpu", "protocol": "clean",
           "data": dict(own_files),
           "train": {"preset": "tiny", "epochs": 1, "save_every": 1},
           "stages": {"sparse": {"loss_on": "answer"}},
           "eval": {"triviaqa_max_new_tokens": 4, "wikitext_window": 64, "wikitext_stride": 32},
           "labels": {"learn_acc": "new-fact acc", "retain_acc": "old-fact acc"}, **changes}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_suite_config_checks_own_roles(own_files, tmp_path):
    config = load_suite_config(str(_suite_file(tmp_path, own_files)))
    assert config.eval.tasks == ("learn", "heldout", "retain") and config.data.own
    no_retrofit = {key: value for key, value in own_files.items() if key not in ("retrofit", "background")}
    with pytest.raises(ConfigError, match="data.retrofit is required"):
        load_suite_config(str(_suite_file(tmp_path, own_files, data=no_retrofit)))
    with pytest.raises(ConfigError, match="cannot be mixed"):
        load_suite_config(str(_suite_file(tmp_path, own_files, data={**own_files, "wikitext": own_files["train"]})))
    with pytest.raises(ConfigError, match="unknown metric key 'medmcqa'"):
        load_suite_config(str(_suite_file(tmp_path, own_files, labels={"medmcqa": "x"})))
    with pytest.raises(ConfigError, match="own data is evaluated by the roles given"):
        load_suite_config(str(_suite_file(tmp_path, own_files, eval={"tasks": ["medmcqa"]})))


def test_own_data_suite_end_to_end_with_labels(own_files, tmp_path):
    config = load_suite_config(str(_suite_file(tmp_path, own_files)))
    results = run_suite(config)
    assert [set(r["metrics"]) for r in results] == [{"learn_acc", "heldout_ppl", "retain_acc"}] * 3
    sparse = json.loads((config.output_dir / "train" / "additive-tfidf-seed0" / "run_config.json").read_text())
    assert (sparse["train_data"], sparse["loss_on"]) == (own_files["train"], "answer")
    background = json.loads((config.output_dir / "background" / "additive-seed0" / "run_config.json").read_text())
    assert background["background_data"] == own_files["background"]
    write_suite_report(config.output_dir)
    table = (config.output_dir / "table1.md").read_text()
    assert "new-fact acc ↑" in table and "heldout_ppl ↓" in table and "old-fact acc ↑" in table
    assert "old-fact acc" in (config.output_dir / "suite_status.md").read_text()
    assert (config.output_dir / "pareto.png").stat().st_size > 0


def test_smf_background_defaults_to_the_retrofits_own_texts(own_files, tmp_path):
    retrofit, background = tmp_path / "retrofit", tmp_path / "background"
    assert cli.main(["retrofit", "--preset", "tiny", "--retrofit-data", own_files["retrofit"], "--epochs", "1",
                     "--output-dir", str(retrofit)]) == 0
    assert cli.main(["background", "--preset", "tiny", "--adapter", str(retrofit), "--output-dir",
                     str(background)]) == 0
    options = json.loads((background / "run_config.json").read_text())
    assert options["background_data"] == own_files["retrofit"] and options["oasst_path"] is None
