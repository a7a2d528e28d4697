"""benchmarks/fsdp_memory_model.py: its parameter counts are those of the models, and docs/sharding.md shows the
tables it prints."""
from pathlib import Path

from helpers import load_benchmark

DOCS = Path(__file__).resolve().parents[1] / "docs" / "sharding.md"


def test_counts_and_docs_tables(capsys):
    model = load_benchmark("fsdp_memory_model")
    small = model.counts("Qwen-2.5-0.5B")
    assert small["base"] == 494_032_768 and small["values"] == 3 * 16_384 * 896  # the paper's model and memories
    full = model.per_rank(small, "full", "FSDP2", 8)
    assert full["base"] == 4 * small["base"] / 8 and full["training state"] == 12 * small["base"] / 8
    assert model.main([]) == 0
    printed = capsys.readouterr().out
    docs = DOCS.read_text()
    missing = [line for line in printed.splitlines() if line.startswith("|") and line not in docs]
    assert not missing, f"docs/sharding.md lacks rows of benchmarks/fsdp_memory_model.py: {missing[:3]}"
