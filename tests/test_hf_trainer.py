"""SparseMemoryTrainer: SMF inside transformers.Trainer's own loop (accumulation, clipping, schedule, resume)."""
import logging
import re
import warnings

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from smf.model import attach_memories, configure_trainable
from smf.train.steps import MemoryUpdateStep
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model
from smf_kernels.hf import SparseMemoryTrainer
from smf_kernels.sparse import FillPlan, NonFiniteGradientError, SparseMemoryController

ROWS_PER_STEP = 6
STEPS = 4


class Sequences(torch.utils.data.Dataset):
    def __init__(self, count, length=10, seed=3):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (count, length), generator=generator)
        self.mask = torch.ones_like(self.ids)
        self.mask[::3, -3:] = 0  # some padding, which must not steer selection

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        labels = self.ids[index].masked_fill(self.mask[index] == 0, -100)
        return {"input_ids": self.ids[index], "attention_mask": self.mask[index], "labels": labels}


class RowChecker(TrainerCallback):
    """Per optimizer step: at most T rows per layer change, and only selected ones."""

    def __init__(self, trainer):
        self.trainer, self.before, self.steps_checked = trainer, None, 0

    def _values(self):
        return {name: m.values.detach().clone() for name, m in self.trainer.controller.memories.items()}

    def on_step_begin(self, args, state, control, **kwargs):
        self.before = self._values()

    def on_step_end(self, args, state, control, **kwargs):
        for name, after in self._values().items():
            changed = (after != self.before[name]).any(dim=1).nonzero().squeeze(1)
            selected = self.trainer.last_selected_rows[name]
            assert 0 < changed.numel() <= ROWS_PER_STEP and selected.numel() <= ROWS_PER_STEP
            assert set(changed.tolist()) <= set(selected.tolist()), name
        self.steps_checked += 1


def _model_and_controller(background=None):
    model = tiny_model()
    torch.manual_seed(0)
    attach_memories(model, TINY_MEMORY_LAYERS, "additive+s", **TINY_MEMORY_KWARGS)
    configure_trainable(model, "sparse")
    controller = SparseMemoryController(model, rule="tfidf", rows_per_step=ROWS_PER_STEP, background=background)
    if background is None:
        docs = Sequences(4, seed=7)
        controller.collect_background([{"input_ids": docs.ids[i:i + 1]} for i in range(len(docs))])
    return model, controller


def _trainer(model, controller, output_dir):
    args = TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=5e-2, lr_scheduler_type="linear", max_grad_norm=1e-3, weight_decay=0.01,
        save_steps=2, logging_steps=1, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=11,
        save_only_model=False,
    )
    trainer = SparseMemoryTrainer(model=model, args=args, train_dataset=Sequences(16), controller=controller)
    checker = RowChecker(trainer)
    trainer.add_callback(checker)
    return trainer, checker


def _state(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def test_trainer_does_smf_with_accumulation_clipping_schedule_and_bit_identical_resume(tmp_path):
    model, controller = _model_and_controller()
    start = _state(model)
    trainer, checker = _trainer(model, controller, tmp_path / "unbroken")
    trainer.train()
    assert checker.steps_checked == STEPS and trainer.state.global_step == STEPS
    unbroken = _state(model)
    assert all(not torch.equal(unbroken[name], start[name]) for name in start)
    logged = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(logged) == STEPS and all(entry["grad_norm"] > 1e-3 for entry in logged)  # all clipped
    rates = [entry["learning_rate"] for entry in logged]
    assert rates[0] > rates[-1]  # the linear schedule ran

    resumed_model, resumed_controller = _model_and_controller(background=controller.background)
    resumed, checker = _trainer(resumed_model, resumed_controller, tmp_path / "unbroken")
    resumed.train(resume_from_checkpoint=str(tmp_path / "unbroken" / "checkpoint-2"))
    assert checker.steps_checked == STEPS - 2
    for name, value in _state(resumed_model).items():
        assert torch.equal(value, unbroken[name]), name


def test_trainer_steps_hold_no_gradient_with_a_graph(tmp_path):
    """The value gradients the step restricted were built with autograd on and carried a graph until zeroed,
    which the Trainer's logging turned into "Converting a tensor with requires_grad=True to a scalar" at every
    run. The values now get no .grad, and the rows' compact gradients hold no graph."""
    model, controller = _model_and_controller()
    trainer, _ = _trainer(model, controller, tmp_path)
    ends = []
    real_end = controller._end  # the step's end, as end_step() and the driver's finish() reach it

    def end():
        gradients = real_end()
        ends.append([(grad.requires_grad, grad.grad_fn) for _, _, grad, _ in gradients.tables.values()])
        return gradients

    controller._end = end
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "requires_grad=True to a scalar" in str(w.message)]
    assert len(ends) == STEPS and all(flags == (False, None) for step in ends for flags in step)


def test_compiled_trainer_chooses_rows_in_the_backward_and_trains_the_eager_weights(tmp_path):
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model, controller = _model_and_controller()
        args = TrainingArguments(
            output_dir=str(tmp_path / f"compiled-{compiled}"), max_steps=2, per_device_train_batch_size=4,
            gradient_accumulation_steps=1, learning_rate=5e-2, max_grad_norm=1e-3, report_to=[], use_cpu=True,
            dataloader_num_workers=0, seed=11, save_strategy="no", torch_compile=compiled,
            torch_compile_backend="aot_eager")
        trainer = SparseMemoryTrainer(model=model, args=args, train_dataset=Sequences(8), controller=controller)
        torch._dynamo.utils.counters.clear()
        trainer.train()
        if compiled:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
            assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        runs[compiled] = _state(model)
    for name, value in runs[True].items():
        torch.testing.assert_close(value, runs[False][name], rtol=1e-5, atol=1e-6)
    model, controller = _model_and_controller()
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        SparseMemoryTrainer(model=model, controller=controller, args=TrainingArguments(
            output_dir=str(tmp_path / "refused"), report_to=[], use_cpu=True, torch_compile=True,
            gradient_accumulation_steps=2))


def test_trainer_rejects_a_missing_controller(tmp_path):
    model, controller = _model_and_controller()
    with pytest.raises(TypeError, match="SparseMemoryController"):
        SparseMemoryTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                                 use_cpu=True), controller=object())


def test_trainer_logs_how_many_rows_each_step_updates(tmp_path):
    model, controller = _model_and_controller()
    trainer, _ = _trainer(model, controller, tmp_path)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    slots = sum(memory.num_slots for memory in controller.memories.values())
    assert len(logged) == STEPS
    for entry in logged:
        assert 0 < entry["selected_rows"] <= ROWS_PER_STEP * len(controller.memories)
        assert entry["selected_fraction"] == pytest.approx(entry["selected_rows"] / slots)
    assert logged[-1]["selected_rows"] == sum(rows.numel() for rows in trainer.last_selected_rows.values())


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_a_non_finite_gradient_raises_or_skips_and_never_moves_a_row(tmp_path, nonfinite):
    model, controller = _model_and_controller()
    controller.nonfinite = nonfinite
    start = _state(model)
    alpha = next(p for name, p in model.named_parameters() if p.requires_grad and "alpha" in name)
    alpha.register_hook(lambda grad: grad * float("nan"))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=5e-2, max_grad_norm=1.0, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, save_strategy="no")
    trainer = SparseMemoryTrainer(model=model, args=args, train_dataset=Sequences(8), controller=controller)
    if nonfinite == "raise":
        with pytest.raises(NonFiniteGradientError, match="alpha"):
            trainer.train()
        assert not controller.in_step
    else:
        trainer.train()
        assert controller.skipped_steps == 2
    for name, value in _state(model).items():
        assert torch.equal(value, start[name]), name


@pytest.mark.parametrize("where", ["arguments", "model"])
def test_gradient_checkpointing_is_refused_when_the_trainer_is_built(tmp_path, where):
    model, controller = _model_and_controller()
    flags = {"gradient_checkpointing": True} if where == "arguments" else {}
    if where == "model":
        model.gradient_checkpointing_enable()
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **flags)
    with pytest.raises(ValueError, match="count them twice.*gradient_checkpointing_disable"):
        SparseMemoryTrainer(model=model, args=args, train_dataset=Sequences(4), controller=controller)


def test_rows_per_step_not_below_the_slot_count_warns_naming_the_fix(caplog):
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    with caplog.at_level(logging.WARNING, logger="smf_kernels.sparse"):
        SparseMemoryController(model, rows_per_step=256)  # a log line, not a UserWarning echoing a source line
    assert re.search("rows_per_step=256 is not below the number of slots.*not sparse.*512 of 16,384", caplog.text)


def test_a_step_whose_forward_raised_is_discarded_and_training_can_start_again(tmp_path):
    model, controller = _model_and_controller()
    trainer, checker = _trainer(model, controller, tmp_path / "run")
    compute_loss = trainer.compute_loss

    def fails_once(*args, **kwargs):
        trainer.compute_loss = compute_loss
        compute_loss(*args, **kwargs)  # the memories count this micro-batch's reads, then the loss "fails"
        raise RuntimeError("out of memory (simulated)")

    trainer.compute_loss = fails_once
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.train()
    assert not controller.in_step and all(int(m.read_counts.sum()) == 0 for m in controller.memories.values())
    trainer.args.max_steps = 1  # one clean step shows the recovery (and writes no checkpoint)
    trainer.train()
    assert checker.steps_checked == 1


@pytest.mark.parametrize("accumulation, expected", [(1, FillPlan("rows_first", select_after_forward=True)),
                                                    (2, FillPlan("reads_kept"))])
def test_the_trainer_and_smf_train_fill_a_step_the_same_way(tmp_path, accumulation, expected):
    """The same situation (micro-batches per step, eager, one process, fewer tokens than slots): the Trainer
    begins its step with the fill smf train's step (MemoryUpdateStep) begins it with."""
    model, controller = _model_and_controller()
    plans, real_begin = [], controller.begin_step

    def begin_step(fill="reads_kept"):
        plans.append(fill)
        real_begin(fill)

    controller.begin_step = begin_step
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=accumulation, report_to=[], use_cpu=True,
                             dataloader_num_workers=0, save_strategy="no")
    SparseMemoryTrainer(model=model, args=args, train_dataset=Sequences(4), controller=controller).train()
    batches = [Sequences(2)[0]] * accumulation
    MemoryUpdateStep(controller, autocast=None, step_tokens=2 * 10).begin_step(model, batches)
    controller.abort_step()
    assert plans == [expected, expected]
