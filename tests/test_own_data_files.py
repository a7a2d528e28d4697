"""Own-data files that cannot be used are refused in one line naming the file, the line and what was expected, before
any model loads (issue 42 item 6): empty files, other encodings, malformed JSON, rows that are not objects, too few
rows for one global batch; through `smf train`, `smf background`, `smf eval` and `smf suite` (config check)."""
import json
from pathlib import Path

import pytest
import yaml

from smf.data.own_data import load_own
from smf.errors import ConfigError
from test_cli_reliability import one_line_error
from test_cli_smf import run_main

QA = {"question": "Where was Ada born?", "answers": ["Lisbon"]}


def _rows(n: int) -> str:
    return "".join(json.dumps({**QA, "question": f"Where was person {i} born?"}) + "\n" for i in range(n))


BAD_FILES = {  # name: (file name, bytes, what the one line must say)
    "empty": ("e.jsonl", b"", "holds no rows (expected text or qa or mc rows"),
    "blank lines only": ("b.jsonl", b"\n  \n\r\n", "holds no rows"),
    "Latin-1 on line 3": ("l.jsonl", (_rows(2) + '{"text": "caf\u00e9"}\n').encode("latin-1"),
                          "line 3: not UTF-8 text (byte 0xe9); save the file as UTF-8"),
    "malformed JSON on line 2": ("m.jsonl", b'{"text": "a"}\n{"text": "b"\n{"text": "c"}\n',
                                 "line 2: expected a JSON object per line (Expecting ',' delimiter at column 13)"),
    "an array on line 2": ("a.jsonl", b'{"text": "a"}\n[1, 2]\n', "line 2: expected a JSON object (a row), got list"),
    "a truncated JSON array": ("t.json", b'[{"text": "a"},\n {"text": "b"', "line 2: expected a JSON array of row "
                                                                            "objects"),
    "a number in a JSON array": ("n.json", b'[{"text": "a"}, 5]', "item 1: expected a JSON object (a row), got int"),
    "an unpaired surrogate escape": ("s.jsonl", b'{"text": "a"}\n{"text": "a\\ud800b"}\n',
                                     "line 2: expected Unicode text, got an unpaired surrogate escape (\\ud800)"),
    "nested too deeply": ("d.jsonl", b"[" * 100_000 + b"]" * 100_000, "line 1: expected a JSON object per line "
                                                                      "(nested too deeply)"),
    "a bad row after a blank line": ("r.jsonl", b'{"text": "a"}\n\n{"text": 7}\n', "line 3: 'text' must be a string"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_own_file_is_one_line_naming_file_line_and_what_was_expected(tmp_path, name):
    file_name, data, message = BAD_FILES[name]
    path = tmp_path / file_name
    path.write_bytes(data)
    with pytest.raises(ConfigError) as refused:
        load_own(path, "--train-data")
    assert str(refused.value).startswith(f"--train-data {str(path)!r}") and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_own_files_are_read_exactly(tmp_path):
    """A BOM, CRLF line ends, blank lines, a JSON array in a .json file, missing columns read as null (and so
    refused by the row check), other columns ignored."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "caf\xc3\xa9", "id": 1}\r\n\r\n{"text": "b"}\r\n')
    assert load_own(path, "x") == ([{"text": "caf\u00e9"}, {"text": "b"}], "text")
    path = tmp_path / "array.json"
    path.write_text(json.dumps([QA, QA]))
    assert load_own(path, "x") == ([QA, QA], "qa")
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps(QA) + "\n")
    with pytest.raises(ConfigError, match="line 1: 'question' must be a non-empty string, got None"):
        load_own(path, "x")


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusals must come before it."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")

    for target in ("smf.train.loop.build_setup", "smf.train.background.load_with_adapter",
                   "smf.model.loading.load_model"):
        monkeypatch.setattr(target, loaded)


def test_train_refuses_too_few_rows_before_any_model_loads(tmp_path, capsys, no_model):
    path = tmp_path / "ten.jsonl"
    path.write_text(_rows(10))
    out = tmp_path / "run"
    code, err = run_main(["train", "--preset", "tiny", "--recipe", "full", "--train-data", str(path),
                          "--global-batch-size", "16", "--micro-batch-size", "4", "--output-dir", str(out)], capsys)
    one_line_error(code, err, f"--train-data {str(path)!r}: 10 rows, fewer than one global batch of 16; lower "
                              "--global-batch-size or add rows")
    code, err = run_main(["train", "--preset", "tiny", "--recipe", "full", "--train-data", str(path),
                          "--n-examples", "6", "--output-dir", str(out)], capsys)  # the preset's global batch: 8
    one_line_error(code, err, "6 rows of its 10 (n_examples), fewer than one global batch of 8")
    assert not out.exists()


def test_background_and_eval_refuse_a_bad_file_before_any_model_loads(tmp_path, capsys, no_model):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "a"}\n{"text": \n')
    code, err = run_main(["background", "--preset", "tiny", "--adapter", str(tmp_path), "--background-data",
                          str(bad), "--output-dir", str(tmp_path / "bg")], capsys)
    one_line_error(code, err, f"--background-data {str(bad)!r}, line 2: expected a JSON object per line")
    learn = tmp_path / "learn.jsonl"
    learn.write_bytes(b"")
    code, err = run_main(["eval", "--model", "tiny", "--eval-learn", str(learn), "--output-dir",
                          str(tmp_path / "eval")], capsys)
    one_line_error(code, err, f"eval_learn {str(learn)!r} holds no rows")
    assert not (tmp_path / "bg").exists() and not (tmp_path / "eval").exists()


def test_suite_config_check_reads_every_own_file(tmp_path, capsys):
    files = {"retrofit": "texts.jsonl", "train": "train.jsonl", "eval_learn": "learn.jsonl",
             "eval_heldout": "texts.jsonl"}
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps({"text": f"text {i}"}) + "\n" for i in range(20)))
    (tmp_path / "train.jsonl").write_text(_rows(12))
    (tmp_path / "learn.jsonl").write_bytes(_rows(2).encode() + b'{"question": "q", "answers": ["\xff"]}\n')
    raw = {"model": "tiny", "output_dir": str(tmp_path / "suite"), "seeds": [0], "device": "cpu",
           "conditions": ["base", "additive-tfidf", "lora"], "data": files,
           "train": {"preset": "tiny", "global_batch_size": 8}, "stages": {"lora": {"global_batch_size": 16}}}
    config = tmp_path / "suite.yaml"
    config.write_text(yaml.safe_dump(raw))
    code, err = run_main(["suite", "--config", str(config), "--dry-run"], capsys)
    one_line_error(code, err, f"data.train {str(tmp_path / 'train.jsonl')!r}: 12 rows, fewer than one global batch "
                              "of 16; lower global_batch_size (train or stages.lora) or add rows")
    config.write_text(yaml.safe_dump({**raw, "stages": {}}))
    code, err = run_main(["suite", "--config", str(config), "--dry-run"], capsys)
    one_line_error(code, err, f"data.eval_learn {str(tmp_path / 'learn.jsonl')!r}, line 3: not UTF-8 text")
    (tmp_path / "learn.jsonl").write_text(_rows(3))
    assert run_main(["suite", "--config", str(config), "--dry-run"], capsys)[0] == 0
    assert not (tmp_path / "suite").exists()
