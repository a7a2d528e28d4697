"""The trainer on the tiny preset: per-recipe parameter freezing (docs/method.md#two-stage-training), each recipe
lowers its loss on a repeated batch, and a run killed mid-way then resumed ends bit-identical to a straight run."""
import json

import pytest
import torch

import smf.train.loop as loop
from smf.errors import ConfigError
from smf.model import attach_memories, save_memory_adapter
from smf.tiny import TINY_MEMORY_KWARGS as TINY_MEMORY, TINY_MEMORY_LAYERS, tiny_model
from smf.errors import ConfigError
from smf.train import build_config, train
from smf.train.checkpoint import CHECKPOINT_FILE, LOG_FILE
from smf.train.distributed import World
from smf.train.recipes import build_setup
from smf.train.steps import MemoryUpdateStep
from smf_kernels.sparse import BackgroundStats, SparseMemoryController
from smf_kernels.sparse import fill_plan

WIDTH, INTERMEDIATE, LAYERS, KV_WIDTH = 64, 128, 8, 32  # tiny Qwen-2: hidden, MLP, layers, 2 KV heads x 16


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_run_config(tmp_path, command, recipe, **overrides):
    options = {"preset": "tiny", "output_dir": str(tmp_path / f"{recipe}-run"), **overrides}
    if command == "train":
        options["recipe"] = recipe
    return build_config(command, {}, options).resolved(recipe)


def write_adapter_and_background(directory, mode):
    """An untrained memory adapter of ``mode`` at the tiny preset's layers, and empty background stats."""
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, mode, **TINY_MEMORY)
    model.config._name_or_path = "tiny"
    save_memory_adapter(model, directory / "final")
    stats = BackgroundStats.for_memories(SparseMemoryController(model).memories)
    for name in stats.configs:  # a few fake background batches so that scores are finite
        for _ in range(3):
            stats.add_batch(name, torch.randint(0, 3, (256,)))
    stats.save(directory / "background.safetensors")
    return directory


def memory_params_per_layer():
    n_keys, heads, key_dim = TINY_MEMORY["n_keys"], TINY_MEMORY["heads"], TINY_MEMORY["key_dim"]
    query = WIDTH * heads * key_dim + heads * key_dim
    keys = heads * 2 * n_keys * key_dim // 2
    values = n_keys ** 2 * WIDTH
    gate = out = WIDTH * WIDTH + WIDTH
    return query + keys + values + gate + out, values


@pytest.mark.parametrize("recipe, mode", [("retrofit", "replacement"), ("retrofit", "additive"),
                                          ("sparse", "replacement"), ("sparse", "additive"),
                                          ("sparse", "additive+s"), ("lora", None), ("full", None)])
def test_recipe_trains_exactly_the_spec_parameters(tmp_path, recipe, mode):
    memory, values = memory_params_per_layer()
    if recipe == "retrofit":
        config = tiny_run_config(tmp_path, "retrofit", "retrofit", mode=mode)
        expected = 3 * memory + (0 if mode == "replacement" else 3)
        kinds = {"memory", "alpha"} if mode != "replacement" else {"memory"}
    elif recipe == "sparse":
        adapter = write_adapter_and_background(tmp_path / "adapter", mode)
        config = tiny_run_config(tmp_path, "train", "sparse", adapter=str(adapter), background=str(adapter))
        expected = 3 * values + (3 if mode == "additive+s" else 0)
        kinds = {"values", "alpha"} if mode == "additive+s" else {"values"}
    elif recipe == "lora":
        config = tiny_run_config(tmp_path, "train", "lora")
        r = 16
        per_layer = r * ((WIDTH + WIDTH) + 2 * (WIDTH + KV_WIDTH) + (WIDTH + WIDTH) + 2 * (WIDTH + INTERMEDIATE)
                         + (INTERMEDIATE + WIDTH))
        expected = LAYERS * per_layer
        kinds = {"lora_A", "lora_B"}
    else:
        config = tiny_run_config(tmp_path, "train", "full")
        expected = sum(p.numel() for p in tiny_model().parameters())
        kinds = None
    setup = build_setup(config, World(0, 1, torch.device("cpu")))
    trainable = setup.trainable_parameters()
    assert sum(p.numel() for p in trainable.values()) == expected
    optimized = {id(p) for group in setup.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainable.values()}
    if kinds is not None:  # which kind of parameter each trainable name is
        found = {next(part for part in name.split(".") if part in kinds or part in ("values", "alpha"))
                 for name in trainable}
        assert found == kinds
    assert isinstance(setup.step, MemoryUpdateStep) == (recipe == "sparse")


def read_log(run_dir):
    return [json.loads(line) for line in (run_dir / LOG_FILE).read_text().splitlines()]


@pytest.mark.parametrize("recipe, lr", [("retrofit", 1e-2), ("sparse", 5e-2), ("lora", 1e-2), ("full", 1e-3)])
def test_each_recipe_lowers_the_loss_of_a_repeated_batch(tmp_path, recipe, lr):
    # one global batch of 4 examples (n_examples = global batch) seen 6 times
    overrides = {"n_examples": 4, "global_batch_size": 4, "micro_batch_size": 2, "epochs": 6, "lr": lr,
                 "warmup_steps": 0}
    if recipe == "sparse":
        adapter = write_adapter_and_background(tmp_path / "adapter", "replacement")
        overrides.update(adapter=str(adapter), background=str(adapter))
    config = tiny_run_config(tmp_path, "retrofit" if recipe == "retrofit" else "train", recipe, **overrides)
    result = train(config)
    losses = [row["loss"] for row in read_log(tmp_path / f"{recipe}-run")]
    assert result["step"] == 6 and len(losses) == 6
    assert losses[-1] < losses[0] - 0.05, losses
    assert (result["final_dir"] / ("adapter_config.json" if recipe == "lora" else "config.json" if recipe == "full"
                                   else "memory_adapter.json")).is_file()


class Killed(Exception):
    pass


@pytest.mark.parametrize("recipe", ["sparse", "lora"])
def test_killed_and_resumed_run_ends_bit_identical_to_a_straight_run(tmp_path, monkeypatch, recipe):
    # 2 steps per epoch x 2 epochs; checkpoints every 2 steps; the crash hits step 4, after the step-2 checkpoint
    # and the logged step 3, so resume must also drop step 3's log row and redo it. LoRA dropout needs the RNG.
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    overrides = {"n_examples": 8, "global_batch_size": 4, "micro_batch_size": 4, "epochs": 2, "lr": 1e-2,
                 "warmup_steps": 1, "save_every": 2, "adapter": str(adapter), "background": str(adapter)}
    straight = tiny_run_config(tmp_path / "straight", "train", recipe, **overrides)
    train(straight)

    interrupted = tiny_run_config(tmp_path / "killed", "train", recipe, **overrides)
    real_step, calls = loop.run_step, []

    def crash_on_fourth(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise Killed
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "run_step", crash_on_fourth)
    with pytest.raises(Killed):
        train(interrupted)
    monkeypatch.setattr(loop, "run_step", real_step)
    assert len(read_log(tmp_path / "killed" / f"{recipe}-run")) == 3
    result = train(tiny_run_config(tmp_path / "killed", "train", recipe, resume=True, **overrides))
    assert result["step"] == 4

    done = [torch.load(tmp_path / run / f"{recipe}-run" / CHECKPOINT_FILE, weights_only=True)
            for run in ("straight", "killed")]
    assert done[0]["step"] == done[1]["step"] == 4
    assert done[0]["trainable"].keys() == done[1]["trainable"].keys()
    for name, tensor in done[0]["trainable"].items():
        assert torch.equal(tensor, done[1]["trainable"][name]), name
    initial = build_setup(straight, World(0, 1, torch.device("cpu"))).trainable_parameters()
    assert any(not torch.equal(initial[name].detach(), done[0]["trainable"][name]) for name in initial)
    assert [r["loss"] for r in read_log(tmp_path / "straight" / f"{recipe}-run")] == \
        [r["loss"] for r in read_log(tmp_path / "killed" / f"{recipe}-run")]


def test_a_second_run_into_the_same_directory_needs_resume(tmp_path):
    config = tiny_run_config(tmp_path, "retrofit", "retrofit", max_steps=1)
    assert train(config)["final_dir"] is None  # stopped early: checkpoint only
    with pytest.raises(ValueError, match="already holds a run; pass --resume"):
        train(config)
    result = train(tiny_run_config(tmp_path, "retrofit", "retrofit", resume=True))
    assert result["step"] == result["total_steps"] and result["final_dir"].is_dir()


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from smf.train import checkpoint

    path = tmp_path / CHECKPOINT_FILE
    first = {"step": 1, "weights": torch.randn(4, 3)}
    checkpoint.atomic_save(first, path)

    def dies_half_way(obj, handle):
        handle.write(b"partial")
        raise Killed

    monkeypatch.setattr(checkpoint.torch, "save", dies_half_way)
    with pytest.raises(Killed):
        checkpoint.atomic_save({"step": 2, "weights": torch.randn(4, 3)}, path)
    loaded = torch.load(path, weights_only=False)
    assert loaded["step"] == 1 and torch.equal(loaded["weights"], first["weights"])


SPARSE_RUN = {"n_examples": 8, "global_batch_size": 4, "epochs": 1, "lr": 1e-2, "warmup_steps": 0}


def test_both_fillers_of_the_rows_gradient_train_the_same_weights(tmp_path, monkeypatch):
    """2 micro-batches per step: reads kept until the step's end, or (a step with more tokens than slots) a
    counting forward first and backwards that write the T selected rows: the same weights within fp32
    rounding."""
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    overrides = {**SPARSE_RUN, "micro_batch_size": 2, "adapter": str(adapter), "background": str(adapter)}
    finals = []
    for name, kept_reads_per_slot in (("kept", 10 ** 9), ("counted", 0)):
        monkeypatch.setattr(fill_plan, "KEPT_READS_PER_SLOT", kept_reads_per_slot)
        train(tiny_run_config(tmp_path / name, "train", "sparse", **overrides))
        finals.append(torch.load(tmp_path / name / "sparse-run" / CHECKPOINT_FILE, weights_only=True)["trainable"])
    for name, tensor in finals[0].items():
        torch.testing.assert_close(tensor, finals[1][name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("update", ["exact", "dense_masked", "authors"])
@pytest.mark.parametrize("micro_batch_size", [4, 2])
def test_every_update_trains_with_one_micro_batch_per_step_or_several(tmp_path, update, micro_batch_size):
    """--optimizer dense_masked with one micro-batch per step raised (the step asked the controller to select
    before the backward, which that mode refused). Every --update runs either way and logs its rows; only the
    exact update never moves a row it did not select."""
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    train(tiny_run_config(tmp_path, "train", "sparse", update=update, micro_batch_size=micro_batch_size,
                          adapter=str(adapter), background=str(adapter), **SPARSE_RUN))
    records = [json.loads(line) for line in (tmp_path / "sparse-run" / LOG_FILE).read_text().splitlines()]
    assert len(records) == 2 and all(r["selected_rows"] > 0 for r in records)
    if update == "exact":
        assert all(r["rows_moved_outside"] == 0 for r in records)


def test_the_exact_step_copies_no_value_table(tmp_path):
    """The exact update moves no unselected row (tests/test_sparse_exact.py), so its step log states 0 without
    the copy of every value table per step that measuring it took (twice the value memory on a sharded table)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    adapter = write_adapter_and_background(tmp_path / "adapter", "additive")
    config = tiny_run_config(tmp_path, "train", "sparse", adapter=str(adapter), background=str(adapter))
    setup = build_setup(config, World(0, 1, torch.device("cpu")))
    table = next(iter(setup.step.update.memories.values())).values.shape

    class TableCopies(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.clone.default and tuple(out.shape) == tuple(table):
                TableCopies.copies += 1
            return out

    ids = torch.randint(0, 200, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with TableCopies():
        setup.step.begin_step(setup.model, [batch])
        loss = setup.model(**batch).loss
        setup.step.after_forward()
        loss.backward()
        setup.step.finish_step(setup.optimizer, max_grad_norm=1.0)
        log = setup.step.step_log()
    assert TableCopies.copies == 0 and log["rows_moved_outside"] == 0 and log["selected_rows"] > 0


@pytest.mark.parametrize("micro_batch_size", [4, 2])
def test_compiled_sparse_run_trains_the_eager_weights(tmp_path, monkeypatch, micro_batch_size):
    """--compile: rows chosen in the backward (one micro-batch) or after the counting pass (two); every step
    compiles without a graph break, and the weights end where the eager run's do. The test compiles with
    aot_eager (dynamo + AOTAutograd, as Inductor traces, without building C++)."""
    real_compile = torch.compile
    monkeypatch.setattr(loop.torch, "compile", lambda model, **kwargs: real_compile(
        model, backend="aot_eager", fullgraph=True))
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    overrides = {"n_examples": 4, "global_batch_size": 4, "micro_batch_size": micro_batch_size, "epochs": 1,
                 "lr": 1e-2, "warmup_steps": 0, "adapter": str(adapter), "background": str(adapter)}
    finals = []
    for name, options in (("eager", {}), ("compiled", {"compile": True})):
        torch._dynamo.reset()
        train(tiny_run_config(tmp_path / name, "train", "sparse", **options, **overrides))
        finals.append(torch.load(tmp_path / name / "sparse-run" / CHECKPOINT_FILE, weights_only=True)["trainable"])
    for name, tensor in finals[0].items():
        torch.testing.assert_close(tensor, finals[1][name], rtol=1e-5, atol=1e-6)


def test_background_refuses_a_split_that_is_not_the_retrofit_runs(tmp_path):
    from smf.model.loading import RUN_CONFIG
    from smf.train.background import check_held_out_split
    from smf.train.config import ConfigError

    for protocol in ("clean", "authors"):
        retrofit = tiny_run_config(tmp_path, "retrofit", "retrofit", protocol=protocol)
        (tmp_path / protocol / "final").mkdir(parents=True)
        (tmp_path / protocol / RUN_CONFIG).write_text(json.dumps(retrofit.to_dict()))
        adapter = str(tmp_path / protocol)
        check_held_out_split(tiny_run_config(tmp_path, "background", "background", protocol=protocol,
                                             adapter=str(tmp_path / protocol / "final")))
        other_size = tiny_run_config(tmp_path, "background", "background", adapter=adapter, protocol=protocol,
                                     n_examples=retrofit.n_examples - 1)
        if protocol == "clean":  # the background set is held out of the first n_examples
            with pytest.raises(ConfigError, match="n-examples"):
                check_held_out_split(other_size)
        else:  # the authors' background set comes from its own pool, whatever the retrofit's size
            check_held_out_split(other_size)
        with pytest.raises(ConfigError, match="data-seed"):
            check_held_out_split(tiny_run_config(tmp_path, "background", "background", adapter=adapter,
                                                 protocol=protocol, data_seed=retrofit.data_seed + 1))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("lr, message, checkpoint", [
    (1e300, "step 1's update overflows float32", False),  # finite, but not as a float32 scalar of the update
    # step 1 leaves weights near 1e38: step 2's gradient (its logits) overflows, refused before anything moves
    (1e37, "the step's gradient of .* holds inf or NaN", True),
])
def test_a_run_that_diverges_fails_clearly(tmp_path, lr, message, checkpoint):
    """A finite but absurd learning rate used to end in a traceback, or in exit 0 with NaN weights. The run
    stops with one clear error; the directory keeps only a checkpoint of finite weights for --resume."""
    config = tiny_run_config(tmp_path, "train", "lora", lr=lr, warmup_steps=0, max_steps=2, save_every=1)
    with pytest.raises(ConfigError, match=f"training diverged: .*{message}"):
        train(config)
    run_dir = tmp_path / "lora-run"
    assert run_dir.exists() == checkpoint and not (run_dir / "final").exists()
    if checkpoint:
        saved = torch.load(run_dir / CHECKPOINT_FILE, weights_only=True)
        assert saved["step"] == 1 and all(bool(t.isfinite().all()) for t in saved["trainable"].values())


def test_no_checkpoint_holds_non_finite_weights(tmp_path):
    world = World(0, 1, torch.device("cpu"))
    setup = build_setup(tiny_run_config(tmp_path, "train", "lora"), world)
    loop.check_finite(setup, 3, world)
    with torch.no_grad():
        next(iter(setup.trainable_parameters().values()))[0] = float("nan")
    with pytest.raises(ConfigError, match="training diverged: after step 3 .* holds non-finite values"):
        loop.check_finite(setup, 3, world)


def test_a_non_finite_gradient_stops_a_sparse_run_with_one_line_and_moves_nothing(tmp_path):
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    config = tiny_run_config(tmp_path, "train", "sparse", adapter=str(adapter), background=str(adapter))
    setup = build_setup(config, World(0, 1, torch.device("cpu")))
    trainable = setup.trainable_parameters()
    alpha = next(p for name, p in trainable.items() if "alpha" in name)
    before = {name: p.detach().clone() for name, p in trainable.items()}
    ids = torch.randint(0, 200, (2, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    setup.step.begin_step(setup.model, [batch])
    loss = setup.model(**batch).loss + alpha * float("nan")
    setup.step.after_forward()
    loss.backward()
    with pytest.raises(ConfigError, match=r"training diverged: the step's gradient of \S*alpha\S* holds inf or NaN"):
        setup.step.finish_step(setup.optimizer, max_grad_norm=1.0)
    assert all(torch.equal(p.detach(), before[name]) for name, p in trainable.items())
