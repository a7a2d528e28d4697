"""benchmarks/bench_decode.py and benchmarks/bench_vs_lucidrains.py at tiny sizes: their tables and JSON, and the
comparison's skip without lucidrains' package."""
import importlib.util
import json

import pytest

from helpers import load_benchmark


def test_decode_reports_the_memory_share_and_the_lookups(tmp_path, capsys):
    bench = load_benchmark("bench_decode")
    out = tmp_path / "decode.json"
    assert bench.main(["--n-keys", "8", "--heads", "2", "--topk", "3", "--key-dim", "8", "--prompt-tokens", "3",
                       "--new-tokens", "2", "--repeats", "1", "--lookup-repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert rows["no memories"]["memory_ms"] == 0 and "torch" in rows
    assert all(0 < row["memory_share"] < 1 for name, row in rows.items() if name != "no memories")
    assert set(result["lookup"]) == {"1", "2", "4", "8"}
    assert "memory share" in capsys.readouterr().out


def test_vs_lucidrains_skips_with_a_message_without_the_package(monkeypatch, capsys):
    bench = load_benchmark("bench_vs_lucidrains")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "product_key_memory" else real(name, *a))
    assert bench.main(["--tokens", "4"]) == 0
    assert "skipped: lucidrains' product-key-memory is not installed" in capsys.readouterr().out


def test_vs_lucidrains_table_and_json(tmp_path, capsys):
    pytest.importorskip("product_key_memory")
    bench = load_benchmark("bench_vs_lucidrains")
    out = tmp_path / "lr.json"
    assert bench.main(["--tokens", "5", "--pairs", "1", "--profile", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"forward", "read only", "forward, gated", "forward+backward", "fwd+bwd, gated"}
    assert all(row["ratio"] > 0 for row in result["rows"].values())
    assert "top-k" in result["profile"] and result["profile_theirs"]
    assert "ours/theirs" in capsys.readouterr().out
