"""benchmarks/bench_lookup.py: the authors' layer row, and the extension built or explained on first use."""
import pytest
import torch

from smf_kernels import backends, build_ext

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_lookup")


def test_tiny_run_times_the_authors_layer_beside_the_backends(bench):
    report = bench.benchmark(bench.parse_args(["--tiny", "--repeats", "1", "--backends", "torch"]))
    layer = {r["backend"]: r for r in report["results"] if r["op"] == "layer fwd+bwd"}
    assert set(layer) == {"authors", "torch"}
    assert layer["authors"]["speedup_vs_authors"] == 1.0
    assert all(r["speedup_vs_authors"] is None for r in report["results"] if r["op"] != "layer fwd+bwd")
    assert "| layer fwd+bwd  | authors |" in bench.format_table(report)


def test_authors_layer_reads_the_slots_of_the_reference_lookup(bench):
    layer = bench.authors_layer_class()(24, n_keys=9, heads=2, topk=4, key_dim=16, value_dim=24)
    query = torch.randn(31, 2, 16)
    scores, slots = layer.lookup(query)
    from smf_kernels.reference import product_key_topk_reference

    want_scores, want_slots = product_key_topk_reference(query, layer.keys.detach(), 4)
    assert torch.equal(slots, want_slots) and torch.allclose(scores, want_scores)
    assert layer(torch.randn(5, 24)).shape == (5, 24)


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-smf")
    assert any("no-such-compiler-smf" in tool for tool in build_ext.missing_build_tools())


def test_unbuildable_extension_is_explained_and_torch_rows_remain(bench, monkeypatch, capsys):
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: "not built")
    monkeypatch.setattr(build_ext, "missing_build_tools", lambda: ["a C++ compiler (c++)"])
    bench.prepare_extension(bench.parse_args([]))
    out = capsys.readouterr().out
    assert "cannot be built" in out and "a C++ compiler (c++)" in out and "torch rows" in out


def test_unbuilt_extension_is_built_with_a_message(bench, monkeypatch, capsys):
    reasons = iter(["not built", None])
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: next(reasons))
    monkeypatch.setattr(build_ext, "missing_build_tools", lambda: [])
    monkeypatch.setenv(build_ext.BUILD_ENV_VAR, "0")  # restored after the test
    bench.prepare_extension(bench.parse_args([]))
    out = capsys.readouterr().out
    assert "building the smf_kernels CPU extension" in out and "built." in out
    assert build_ext.os.environ.get(build_ext.BUILD_ENV_VAR) == "1"
