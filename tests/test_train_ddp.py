"""Data parallelism through the trainer: 2 gloo processes with micro-batch m each end with the same
weights as 1 process with micro-batch 2m and the same global batch (sparse +S: controller-synchronised
selection plus DDP on alpha; full: plain DDP)."""
import datetime
import gc
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from smf.model import attach_memories, save_memory_adapter
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model
from smf.train import build_config, train
from smf.train.checkpoint import CHECKPOINT_FILE
from smf_kernels.sparse import BackgroundStats, SparseMemoryController

WORLD = 2
RECIPES = ("sparse", "full")


pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(root, recipe, micro_batch_size, adapter):
    # Protocol clean: its loss, the token mean of the whole step, does not depend on how the step is split into
    # micro-batches; the authors' sparse loss (a sum of micro-batch means) does, so no two splits compare.
    options = {"preset": "tiny", "recipe": recipe, "output_dir": str(root / recipe), "n_examples": 8,
               "global_batch_size": 4, "micro_batch_size": micro_batch_size, "epochs": 2, "lr": 1e-2,
               "warmup_steps": 1, "adapter": str(adapter), "background": str(adapter), "protocol": "clean"}
    if recipe == "full":  # the base model's full finetuning (with --adapter it would finetune the memories too)
        options = {name: value for name, value in options.items() if name not in ("adapter", "background")}
    return build_config("train", {}, options).resolved(recipe)


def write_adapter_and_background(directory, mode="additive+s"):
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, mode, **TINY_MEMORY_KWARGS)
    model.config._name_or_path = "tiny"
    save_memory_adapter(model, directory)
    stats = BackgroundStats.for_memories(SparseMemoryController(model).memories)
    generator = torch.Generator().manual_seed(3)
    for name in stats.configs:
        for _ in range(3):
            stats.add_batch(name, torch.randint(0, 3, (256,), generator=generator))
    stats.save(directory / "background.safetensors")


def _worker(rank, init_file, root, adapter):
    torch.set_num_threads(1)  # two processes share the cores (torchrun sets OMP_NUM_THREADS=1 likewise)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=3))  # a stuck peer fails, not hangs
    try:
        for recipe in RECIPES:
            train(run_config(root, recipe, micro_batch_size=1, adapter=adapter))
        dist.barrier()
        gc.collect()  # DDP reducers before their process group (see test_sparse_controller.py)
    finally:
        dist.destroy_process_group()


def final_weights(run_dir):
    return torch.load(run_dir / CHECKPOINT_FILE, weights_only=False)["trainable"]


def test_two_gloo_processes_match_one_process_with_twice_the_micro_batch(tmp_path):
    adapter = tmp_path / "adapter"
    write_adapter_and_background(adapter)
    mp.spawn(_worker, args=(str(tmp_path / "init"), tmp_path / "ddp", adapter), nprocs=WORLD, join=True)
    for recipe in RECIPES:
        train(run_config(tmp_path / "single", recipe, micro_batch_size=2, adapter=adapter))
        ddp, single = final_weights(tmp_path / "ddp" / recipe), final_weights(tmp_path / "single" / recipe)
        initial = {n: p for n, p in tiny_model().named_parameters()} if recipe == "full" else None
        assert ddp.keys() == single.keys()
        for name, tensor in single.items():
            if name.endswith("k_proj.bias"):
                # softmax ignores a shift shared by all keys: this gradient is zero up to rounding, and Adam
                # scales rounding noise up to full-size steps; it is checked only as part of the total below
                continue
            err = float((ddp[name].double() - tensor.double()).norm() / tensor.double().norm())
            assert err < 1e-5, (recipe, name, err)
        flat = [torch.cat([t.double().flatten() for t in weights.values()]) for weights in (ddp, single)]
        assert float((flat[0] - flat[1]).norm() / flat[1].norm()) < 1e-5
        if initial is not None:  # the run moved the weights, so the match is not trivial
            assert any(not torch.equal(initial[n].detach(), single[n]) for n in initial if n in single)
