"""benchmarks/bench_train_step.py: each recipe set up as `smf train` sets it up, and stepped as the trainer steps it,
without pydantic (a stock CUDA image has none)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark and its helper modules (guarded.py)


@pytest.fixture(scope="module")
def bench():
    import bench_train_step  # imported by name: its dataclasses look their module up in sys.modules

    return bench_train_step


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
    setup, settings, _ = bench.build_setup("sparse", True, torch.device("cpu"), 8, None)
    values = {name: m.values.detach().clone() for name, m in setup.step.update.memories.items()}
    batches = bench.micro_batches(setup.model.config.vocab_size, 2, 2, 24, torch.device("cpu"), seed=0)
    scheduler = bench.cosine_schedule(setup.optimizer, warmup_steps=0, total_steps=4)
    bench.train_step(setup.model, setup, scheduler, batches, 48, settings, torch.device("cpu"))
    for name, memory in setup.step.update.memories.items():
        moved = (memory.values.detach() != values[name]).any(dim=1).nonzero().flatten()
        assert 0 < moved.numel() <= 8, name
        assert set(moved.tolist()) <= set(setup.step.rows[name].tolist()), name


@pytest.mark.parametrize("recipe", ["sparse", "lora"])
def test_step_is_the_trainers_step(bench, recipe, one_thread):
    """train_step (pydantic-free) and smf.train.loop.run_step leave bit-identical parameters and losses over two steps,
    with the settings smf train resolves for the recipe (the authors' protocol: the sparse loss sums micro-batch
    means)."""
    from smf.train.config import RECIPE_LR, RunConfig
    from smf.train.distributed import World
    from smf.train.loop import run_step

    device = torch.device("cpu")
    config = RunConfig(rows_per_step=8).resolved(recipe)
    runs = []
    for trainer in ("bench", "loop"):
        torch.manual_seed(0)
        setup, settings, _ = bench.build_setup(recipe, True, device, 8, None)
        assert setup.optimizer.param_groups[0]["lr"] == RECIPE_LR[recipe]
        scheduler = bench.cosine_schedule(setup.optimizer, warmup_steps=1, total_steps=4)
        losses = []
        for seed in range(2):
            torch.manual_seed(seed)  # LoRA's dropout draws
            batches = bench.micro_batches(setup.model.config.vocab_size, 2, 2, 24, device, seed=seed)
            tokens = sum(int(b["attention_mask"].sum()) for b in batches)
            if trainer == "bench":
                losses.append(bench.train_step(setup.model, setup, scheduler, batches, tokens, settings, device))
            else:
                losses.append(run_step(setup.model, setup, scheduler, batches, tokens, config, World(0, 1, device)))
        runs.append((losses, {name: p.detach().clone() for name, p in setup.model.named_parameters()}))
    (bench_losses, bench_params), (loop_losses, loop_params) = runs
    assert all(torch.equal(a, b) for a, b in zip(bench_losses, loop_losses))
    assert bench_params.keys() == loop_params.keys()
    assert all(torch.equal(bench_params[name], loop_params[name]) for name in bench_params), \
        [name for name in bench_params if not torch.equal(bench_params[name], loop_params[name])][:5]


def test_settings_are_smf_trains_defaults(bench):
    from smf.train.config import RECIPE_LR, RunConfig

    assert bench.LR == {recipe: RECIPE_LR[recipe] for recipe in bench.RECIPES}
    for recipe in bench.RECIPES:
        config, settings = RunConfig().resolved(recipe), bench.StepSettings(recipe=recipe)
        assert (settings.bf16, settings.max_grad_norm, settings.protocol, settings.compile) == \
            (config.bf16, config.max_grad_norm, config.protocol, config.compile), recipe


def test_a_step_runs_without_pydantic(tmp_path):
    """The benchmark imports and steps with pydantic blocked, as on a stock CUDA image."""
    out = tmp_path / "steps.jsonl"
    script = (f"import sys; sys.modules['pydantic'] = None; sys.modules['pydantic_core'] = None; "
              f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]; import bench_train_step; "
              f"sys.exit(bench_train_step.main(['--tiny', '--device', 'cpu', '--recipes', 'sparse', '--micro-batches', "
              f"'1', '--micro-batch-size', '2', '--seq-len', '16', '--rows', '8', '--warmup', '0', '--repeats', '1', "
              f"'--jsonl', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["start", "done"] and rows[1]["result"]["recipe"] == "sparse"


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
