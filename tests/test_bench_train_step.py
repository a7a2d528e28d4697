"""benchmarks/bench_train_step.py: each recipe set up as `smf train` sets it up, and stepped by the trainer."""
import json

import pytest
import torch

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_train_step")


def test_tiny_step_of_every_recipe_trains_what_the_recipe_trains(bench, tmp_path, one_thread):
    out = tmp_path / "steps.json"
    assert bench.main(["--tiny", "--device", "cpu", "--micro-batches", "2", "--micro-batch-size", "2",
                       "--seq-len", "32", "--rows", "8", "--warmup", "0", "--repeats", "1", "--json", str(out)]) == 0
    results = {r["recipe"]: r for r in json.loads(out.read_text())}
    assert set(results) == set(bench.RECIPES)
    assert all(r["step_ms"] > 0 and r["peak_gib"] > 0 for r in results.values())  # CPU: the RSS high-water mark
    model, layers, memory = bench.build_model(tiny=True)
    assert results["full"]["trainable"] == sum(p.numel() for p in model.parameters())
    # sparse: the three memories' value tables only; retrofit: every memory parameter, more than that
    hidden = model.config.hidden_size
    assert results["sparse"]["trainable"] == len(layers) * memory["n_keys"] ** 2 * hidden
    assert results["sparse"]["trainable"] < results["retrofit"]["trainable"] < results["full"]["trainable"]
    assert 0 < results["lora"]["trainable"] < results["full"]["trainable"]


def test_sparse_step_moves_only_selected_value_rows(bench):
    torch.manual_seed(0)
    setup, config, _ = bench.build_setup("sparse", True, torch.device("cpu"), 8, None)
    values = {name: m.values.detach().clone() for name, m in setup.step.update.memories.items()}
    from smf.train.distributed import World
    from smf.train.loop import cosine_schedule, run_step

    batches = bench.micro_batches(setup.model.config.vocab_size, 2, 2, 24, torch.device("cpu"), seed=0)
    scheduler = cosine_schedule(setup.optimizer, warmup_steps=0, total_steps=4)
    run_step(setup.model, setup, scheduler, batches, 48, config, World(0, 1, torch.device("cpu")))
    for name, memory in setup.step.update.memories.items():
        moved = (memory.values.detach() != values[name]).any(dim=1).nonzero().flatten()
        assert 0 < moved.numel() <= 8, name
        assert set(moved.tolist()) <= set(setup.step.rows[name].tolist()), name


def test_compiled_sparse_step_runs_and_reports(bench, tmp_path, monkeypatch):
    """--compile wraps the model as smf train --compile does (traced here with aot_eager: no C++ build)."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: real_compile(model, backend="aot_eager"))
    out = tmp_path / "steps.json"
    assert bench.main(["--tiny", "--device", "cpu", "--recipes", "sparse", "--compile", "--micro-batches", "1",
                       "--micro-batch-size", "2", "--seq-len", "16", "--rows", "8", "--warmup", "1", "--repeats", "1",
                       "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())
    assert result["recipe"] == "sparse" and result["step_ms"] > 0 and result["host_ms"] is None
