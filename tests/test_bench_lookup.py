"""benchmarks/bench_lookup.py: the authors' layer row, the extension built or explained on first use, progress as
it runs and bad arguments in one line."""
import logging
import re
import time

import pytest
import torch

from smf_kernels import backends, build_ext

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_lookup")


def test_tiny_run_times_the_authors_layer_beside_the_backends(bench, caplog):
    with caplog.at_level(logging.INFO, logger="bench_lookup"):
        report = bench.benchmark(bench.parse_args(["--tiny", "--repeats", "1", "--backends", "torch"]))
    progress = [record.getMessage() for record in caplog.records if " ms  (op " in record.getMessage()]
    assert len(progress) == len(report["results"]) == 9  # one line per op and backend, as each op finishes
    assert progress[0].split()[:2] == ["lookup", "torch"] and "(op 8 of 8," in progress[-1]
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


def test_unbuildable_extension_is_explained_and_torch_rows_remain(bench, monkeypatch, caplog):
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: "not built")
    monkeypatch.setattr(build_ext, "missing_build_tools", lambda: ["a C++ compiler (c++)"])
    bench.prepare_extension(bench.parse_args([]))
    out = caplog.text
    assert "cannot be built" in out and "a C++ compiler (c++)" in out and "torch rows" in out


def test_unbuilt_extension_is_built_with_a_message(bench, monkeypatch, caplog):
    reasons = iter(["not built", None])
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: next(reasons))
    monkeypatch.setattr(build_ext, "missing_build_tools", lambda: [])
    monkeypatch.setenv(build_ext.BUILD_ENV_VAR, "0")  # restored after the test
    with caplog.at_level(logging.INFO, logger="bench_lookup"):
        bench.prepare_extension(bench.parse_args([]))
    out = caplog.text
    assert "building the smf_kernels CPU extension" in out and "built." in out
    assert build_ext.os.environ.get(build_ext.BUILD_ENV_VAR) == "1"


def test_an_unknown_backend_is_refused_in_one_line_before_any_work(bench, capsys):
    assert bench.BACKEND_NAMES == backends.BACKENDS
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--backends", "torch", "foo"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("bench_lookup.py: error: argument --backends: invalid choice: 'foo' (choose "
                                       "from 'torch', 'triton', 'ext')\n")


def test_a_backend_that_cannot_run_here_is_one_line(bench, monkeypatch, capsys):
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: "not built" if name == "ext" else None)
    monkeypatch.setattr(bench, "prepare_extension", lambda args: None)
    assert bench.main(["--tiny", "--backends", "ext"]) == 2
    assert capsys.readouterr().err.endswith("bench_lookup.py: error: argument --backends: ext cannot run on cpu: "
                                            "not built\n")


def test_a_quiet_stretch_says_which_op_backend_and_run_is_running(bench, monkeypatch, caplog):
    monkeypatch.setattr(bench.Progress, "QUIET_SECONDS", 0)  # a line at every poll (once a second)
    monkeypatch.setattr(bench, "_timer", lambda device: lambda fn: (time.sleep(0.3), fn(), 0.001)[2])
    progress = bench.Progress()
    progress.start()
    try:
        with caplog.at_level(logging.INFO, logger="bench_lookup"):
            bench.benchmark(bench.parse_args(["--tiny", "--repeats", "2", "--backends", "torch"]), progress)
    finally:
        progress.stop()
    still = [record.getMessage() for record in caplog.records if record.getMessage().startswith("  still ")]
    assert still and all(" s since the start)" in message for message in still)
    assert any(re.match(r"  still timing [\w+ ]+ \(op \d of 8\): (torch|authors), run \d of 2 \(", message)
               for message in still), still
    assert not progress.is_alive() and progress.seen not in logging.getLogger().handlers
