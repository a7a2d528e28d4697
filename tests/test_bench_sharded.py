"""benchmarks/bench_sharded.py: a tiny run over 2 gloo processes measures what the byte model predicts, and
the model's tables print."""
import importlib
import json
from pathlib import Path

import pytest


@pytest.fixture
def bench(monkeypatch):
    # imported by name, not through helpers.load_benchmark: the spawned ranks unpickle its functions by module
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("bench_sharded")


def test_tiny_run_on_two_ranks_sends_what_the_model_predicts(bench, tmp_path, one_thread):
    out = tmp_path / "sharded.json"
    assert bench.main(["--world-sizes", "2", "--n-keys", "8", "--d-model", "30", "--heads", "2", "--topk", "4",
                       "--key-dim", "8", "--tokens", "9", "--rows-per-step", "8", "--steps", "1",
                       "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["world"] == 2 and result["tokens_per_second"] > 0
    for rank in result["ranks"]:
        assert rank["ledger_bytes"] == rank["predicted_read_bytes"] > 0
        # socket bytes: the model's plus gloo's message headers (a few hundred bytes)
        assert 0 <= rank["wchar_bytes"] - rank["predicted_step_bytes"] < 4096
        assert rank["values_and_state_bytes"] <= rank["target_bytes"]


def test_model_tables_print(bench, capsys):
    assert bench.main(["--model"]) == 0
    printed = capsys.readouterr().out
    assert "| 8 | paper (16K slots) |" in printed and "fewer than one column per GPU" in printed
