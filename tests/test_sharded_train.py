"""``--shard-memories`` through the trainer with 2 gloo processes: the sparse (+S) and retrofit recipes end with
the final adapters of one unsharded process on the same global batches; a sharded run killed between writing
its shard files and its checkpoint, then resumed, ends bit-identical to an unbroken one; its checkpoint
(written by 2 processes) resumes on 1."""
from __future__ import annotations

import datetime
import gc
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from smf.errors import ConfigError
from smf.model.adapter import ADAPTER_WEIGHTS
from smf.train import build_config, train
from smf.train.checkpoint import CHECKPOINT_FILE
from smf.train.sharding import SHARDS_DIR
from test_train_ddp import write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD, KILL_AT = 2, 3
# protocol clean: the authors' sparse loss sums micro-batch means, which differ between 2 processes x 1 example and
# 1 process x 2 (docs/method.md); the comparison of sharded and unsharded runs needs the split-free token mean.
COMMON = {"preset": "tiny", "n_examples": 8, "global_batch_size": 4, "epochs": 2, "lr": 1e-2, "warmup_steps": 1,
          "save_every": 1, "protocol": "clean"}


def run_config(output_dir, recipe, micro_batch_size, adapter, **options):
    """4 steps of 4 examples (2 epochs of 8): micro_batch_size 1 on 2 processes, 2 on one."""
    command = "retrofit" if recipe == "retrofit" else "train"
    options = {**COMMON, "output_dir": str(output_dir), "micro_batch_size": micro_batch_size, **options}
    if command == "train":
        options.update(recipe=recipe, adapter=str(adapter), background=str(adapter))
    return build_config(command, {}, options).resolved(recipe)


def _worker(rank, init_file, root, adapter, job):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=3))  # a stuck peer fails, not hangs
    try:
        if job == "runs":  # the unbroken runs, then the one killed (last: the kill ends these processes)
            for recipe in ("sparse", "retrofit"):
                train(run_config(root / recipe, recipe, 1, adapter, shard_memories=True))
            import smf.train.loop as loop

            real_save = loop.save_checkpoint

            def save_or_die(path, *, step, **kwargs):
                if step == KILL_AT:  # the shard files of this step are written, checkpoint.pt is not
                    os._exit(3)
                real_save(path, step=step, **kwargs)

            loop.save_checkpoint = save_or_die
            train(run_config(root / "killed", "sparse", 1, adapter, shard_memories=True))
        else:
            train(run_config(root / "killed", "sparse", 1, adapter, shard_memories=True, resume=True))
        dist.barrier()
        gc.collect()  # DDP reducers before their process group (see test_sparse_controller.py)
    finally:
        dist.destroy_process_group()


def spawn(tmp_path, adapter, job):
    mp.spawn(_worker, args=(str(tmp_path / f"init-{job}"), tmp_path, adapter, job), nprocs=WORLD, join=True)


def adapter_weights(run_dir):
    return load_file(str(run_dir / "final" / ADAPTER_WEIGHTS))


def assert_close(got, expected, bound):
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        err = float((got[name].double() - tensor.double()).norm() / tensor.double().norm().clamp_min(1e-30))
        assert err < bound, (name, err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-train")
    adapter = root / "adapter"
    write_adapter_and_background(adapter)
    with pytest.raises(mp.ProcessExitedException) as killed:
        spawn(root, adapter, "runs")
    assert killed.value.exit_code == 3, "the unbroken runs finished and the last run was killed on purpose"
    return root, adapter


def test_sharded_sparse_and_retrofit_runs_match_one_unsharded_process(runs):
    root, adapter = runs
    for recipe in ("sparse", "retrofit"):
        single = root / f"single-{recipe}"
        train(run_config(single, recipe, 2, adapter))
        sharded, expected = adapter_weights(root / recipe), adapter_weights(single)
        assert_close(sharded, expected, 1e-5)
        initial = load_file(str(adapter / ADAPTER_WEIGHTS)) if recipe == "sparse" else None
        if initial is not None:  # the run moved the values, so the match is not trivial
            assert any(not torch.equal(initial[n], expected[n]) for n in initial if n.endswith("values"))
    checkpoint = torch.load(root / "sparse" / CHECKPOINT_FILE, weights_only=True)
    assert checkpoint["shards"] == {"dir": f"{SHARDS_DIR}/step-4", "world": WORLD}
    assert not any(name.endswith("values") for name in checkpoint["trainable"])  # they live in the shard files
    assert [p.name for p in (root / "sparse" / SHARDS_DIR).iterdir()] == ["step-4"]  # older steps removed


def test_a_killed_sharded_run_resumes_bit_identical_and_on_another_number_of_processes(runs):
    root, adapter = runs
    killed = root / "killed"
    assert torch.load(killed / CHECKPOINT_FILE, weights_only=True)["step"] == KILL_AT - 1
    assert (killed / SHARDS_DIR / f"step-{KILL_AT}").is_dir()  # written, never named by a checkpoint
    one_process = root / "resumed-on-one"
    shutil.copytree(killed, one_process)
    spawn(root, adapter, "resumed")
    unbroken = adapter_weights(root / "sparse")
    resumed = adapter_weights(killed)
    assert all(torch.equal(resumed[name], unbroken[name]) for name in unbroken)
    # the same checkpoint on one process: each value column now comes from one file or the other
    train(run_config(one_process, "sparse", 2, adapter, shard_memories=True, resume=True))
    assert_close(adapter_weights(one_process), unbroken, 1e-5)


def test_shard_memories_is_refused_where_there_is_nothing_to_split(tmp_path):
    with pytest.raises(ConfigError, match="not of --recipe lora"):
        build_config("train", {}, {"preset": "tiny", "recipe": "lora", "output_dir": str(tmp_path),
                                   "shard_memories": True})
