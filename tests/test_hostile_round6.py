"""Issue 57's hostile pass over what round 6 built: suites stopped or moved, ``SMF_KERNELS_BACKEND``, flags of a
section a stage does not take, damaged results, one key in two spellings, options a base pretrained with memories
ignores, saves that wrote nothing and ``benchmarks/gpu_run.py``. Each case failed (a traceback, a wrong cause, a
silent success) before this pass."""
from pathlib import Path

import pytest

from smf.model import save_tokenizer
from smf.tiny import tiny_tokenizer
from test_cli_smf import run_main


def cli_refuses(argv, capsys, message):
    """``smf argv`` ends with one line naming ``message``, exit 2."""
    code, err = run_main(argv, capsys)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


# ------------------------------------------------------------------------------------ one key in two spellings
@pytest.mark.parametrize("name, text, message", [
    ("train.yaml", "output_dir: a\nlr: 0.1\noutput-dir: b\n",
     "duplicate key 'output-dir' at line 3 (first 'output_dir' at line 1)"),
    ("train.json", '{"output-dir": "a", "output_dir": "b"}', "duplicate key 'output_dir' (first 'output-dir'"),
])
def test_a_key_in_both_spellings_is_refused_by_name(tmp_path, capsys, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    cli_refuses(["train", "--config", str(path)], capsys, message)


def test_a_suite_key_in_both_spellings_is_refused_by_name_and_line(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text("name: t\nworld:\n  n_old: 40\n  n-old: 41\n")
    cli_refuses(["suite", "--config", str(path), "--output-dir", str(tmp_path / "s"), "--dry-run"], capsys,
                "duplicate key 'n-old' at line 4 (first 'n_old' at line 3)")


# -------------------------------------------------------------------------------- saves that wrote nothing
def test_save_tokenizer_into_a_file_raises(tmp_path):
    path = tmp_path / "model"
    path.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="it is a file, not a folder"):
        save_tokenizer(tiny_tokenizer(), path)


def test_save_tokenizer_whose_subfolder_is_a_file_raises(tmp_path):
    from smf.model import attach_memories
    from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="tokenizer'.*it is a file"):
        save_tokenizer(tiny_tokenizer(), tmp_path)
