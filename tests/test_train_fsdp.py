"""``smf train --fsdp`` with 2 gloo processes (the base model under FSDP2, the memories left out of it): sparse
in each memory mode (and with --shard-memories), LoRA and full finetuning end, loaded into one process (``smf.model.load_run``), with the
weights of one process without FSDP on the same global batches, after the same losses and, for sparse, the
same selected rows; a run killed after an optimizer step resumes from its consolidated checkpoint bit-identical
to an unbroken one."""
from __future__ import annotations

import datetime
import gc
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from smf.errors import ConfigError
from smf.model import load_run
from smf.model.adapter import ADAPTER_WEIGHTS
from smf.train import build_config, train
from smf.train.checkpoint import CHECKPOINT_FILE, LOG_FILE
from test_train_ddp import write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD, KILL_AT = 2, 2
MODES = ("additive", "additive+s", "replacement")
# sparse in each mode with replicated memories, additive+s with them split by columns too (--shard-memories)
RUNS = tuple(f"sparse-{mode}" for mode in MODES) + ("sharded-additive+s", "lora", "full")
# 2 steps of 4 examples; protocol clean (its loss does not depend on how a step is split into micro-batches);
# no LoRA dropout (its random masks differ between 2 processes and 1)
COMMON = {"preset": "tiny", "n_examples": 8, "global_batch_size": 4, "epochs": 1, "lr": 1e-2, "warmup_steps": 1,
          "save_every": 1, "protocol": "clean"}


def run_config(root, run, micro_batch_size, directory=None, **options):
    recipe = "sparse" if run.startswith("sharded") else run.split("-")[0]
    options = {**COMMON, "recipe": recipe, "output_dir": str(root / (directory or run)),
               "micro_batch_size": micro_batch_size, **options}
    if recipe == "sparse":
        adapter = root / f"adapter-{run.split('-', 1)[1]}"
        options.update(adapter=str(adapter), background=str(adapter))
    if recipe == "lora":
        options["lora_dropout"] = 0.0
    return build_config("train", {}, options).resolved(recipe)


def _worker(rank, init_file, root, job):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=3))  # a stuck peer fails, not hangs
    try:
        if job == "runs":  # every run, then the one killed (last: the kill ends these processes)
            for run in RUNS:
                train(run_config(root, run, 1, fsdp=True, shard_memories=run.startswith("sharded")))
            import smf.train.loop as loop

            real_check = loop.check_finite

            def check_or_die(setup, step, world, **options):
                if step == KILL_AT:  # after the optimizer step, before its checkpoint: every rank dies
                    os._exit(3)
                real_check(setup, step, world, **options)

            loop.check_finite = check_or_die
            train(run_config(root, "full", 1, "killed", fsdp=True))
        else:
            train(run_config(root, "full", 1, "killed", fsdp=True, resume=True))
        dist.barrier()
        gc.collect()
    finally:
        dist.destroy_process_group()


def spawn(root, job):
    mp.spawn(_worker, args=(str(root / f"init-{job}"), root, job), nprocs=WORLD, join=True)


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / LOG_FILE).read_text().splitlines()]


def rel_err(got, expected):
    return float((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp-train")
    for mode in MODES:
        write_adapter_and_background(root / f"adapter-{mode}", mode)
    with pytest.raises(mp.ProcessExitedException) as killed:
        spawn(root, "runs")
    assert killed.value.exit_code == 3, "the unbroken runs finished and the last run was killed on purpose"
    return root


@pytest.mark.parametrize("run", RUNS)
def test_fsdp_runs_match_one_process_and_load_into_one(runs, run):
    single = run_config(runs, run, 2, f"single-{run}")
    train(single)
    assert losses(runs / run) == pytest.approx(losses(runs / f"single-{run}"), rel=1e-6)
    fsdp_model, _ = load_run(runs / run)
    single_model, _ = load_run(runs / f"single-{run}")
    got, expected = fsdp_model.state_dict(), single_model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        if not name.endswith("k_proj.bias"):  # a shift softmax ignores: Adam scales its rounding noise up
            assert rel_err(got[name], tensor) < 1e-5, (run, name)
    assert rel_err(torch.cat([t.flatten() for t in got.values()]),
                   torch.cat([t.flatten() for t in expected.values()])) < 1e-6
    if run not in ("lora", "full"):  # the same rows moved, and only they
        initial = load_file(str(runs / f"adapter-{run.split('-', 1)[1]}" / ADAPTER_WEIGHTS))
        finals = [load_file(str(runs / name / "final" / ADAPTER_WEIGHTS)) for name in (run, f"single-{run}")]
        for name in (n for n in initial if n.endswith("values")):
            moved = [(final[name] != initial[name]).any(-1).nonzero().flatten() for final in finals]
            assert moved[0].numel() > 0 and torch.equal(moved[0], moved[1]), name


def test_a_killed_fsdp_run_resumes_bit_identical(runs):
    killed = runs / "killed"
    assert torch.load(killed / CHECKPOINT_FILE, weights_only=True)["step"] == KILL_AT - 1
    spawn(runs, "resumed")
    unbroken = torch.load(runs / "full" / CHECKPOINT_FILE, weights_only=True)
    resumed = torch.load(killed / CHECKPOINT_FILE, weights_only=True)
    assert unbroken["trainable"].keys() == resumed["trainable"].keys()
    assert all(torch.equal(resumed["trainable"][n], t) for n, t in unbroken["trainable"].items())
    for index, state in unbroken["optimizer"]["state"].items():
        assert all(torch.equal(resumed["optimizer"]["state"][index][k], v) for k, v in state.items())
    assert losses(killed) == losses(runs / "full")


def test_fsdp_is_refused_where_it_cannot_run(tmp_path):
    options = {"preset": "tiny", "recipe": "full", "output_dir": str(tmp_path / "one"), "fsdp": True}
    with pytest.raises(ConfigError, match="--fsdp shards the base model over the torchrun processes"):
        train(build_config("train", {}, options).resolved("full"))
    assert not (tmp_path / "one" / CHECKPOINT_FILE).exists()
    with pytest.raises(ConfigError, match="--fsdp is not available with --compile"):
        build_config("train", {}, {**options, "compile": True})
