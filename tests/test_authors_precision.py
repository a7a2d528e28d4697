"""The authors' protocol's loss scale and precision (docs/method.md#the-protocol-setting): the sparse stage's
gradient is the sum of its micro-batch means; bf16 weights with the trainable parameters fp32 (none in full
finetuning); evaluation in bf16 on a CUDA device with bf16."""
import pytest
import torch

import smf.train.loop as loop
from helpers import rel_err
from smf.model import attach_memories, memory_blocks
from smf.model.precision import authors_bf16_weights, cast_like_the_authors
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model
from smf.train import train
from smf.train.distributed import World
from smf.train.recipes import build_setup
from smf.train.steps import StepHooks
from test_train_recipes import tiny_run_config, write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = World(0, 1, torch.device("cpu"))


class KeepGradients(StepHooks):
    """Ends a step by keeping the accumulated gradients (no clipping, no optimizer step)."""

    def finish_step(self, optimizer, max_grad_norm):
        self.grads = {name: p.grad.clone() for name, p in self.params.items()}


class NoSchedule:
    def step(self):
        pass


def _micro_batches(lengths=(8, 4)):
    """Micro-batches of 2 sequences of ``lengths`` (one label ignored): 13 and 5 target tokens by default."""
    generator = torch.Generator().manual_seed(3)
    batches = []
    for length, ignored in ((n, 1) for n in lengths):
        ids = torch.randint(0, 256, (2, length), generator=generator)
        labels = ids.clone()
        labels[1, -ignored:] = -100
        batches.append({"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels})
    return batches


def _step_gradients(tmp_path, protocol, lengths=(8, 4)):
    torch.manual_seed(0)  # the same memories for every protocol
    adapter = write_adapter_and_background(tmp_path / f"adapter-{protocol}", "additive+s")
    config = tiny_run_config(tmp_path, "train", "sparse", adapter=str(adapter), background=str(adapter),
                             protocol=protocol, output_dir=str(tmp_path / protocol))
    setup = build_setup(config, CPU)
    setup.step = KeepGradients()
    setup.step.params = setup.trainable_parameters()
    batches = _micro_batches(lengths)
    num_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    loop.run_step(setup.model, setup, NoSchedule(), batches, num_tokens, config, CPU)
    return setup, batches, setup.step.grads


@pytest.mark.parametrize("protocol", ["authors", "clean"])
def test_sparse_stage_gradient_is_the_authors_sum_of_micro_batch_means(tmp_path, protocol):
    setup, batches, grads = _step_gradients(tmp_path, protocol)
    setup.model.zero_grad(set_to_none=True)
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    assert tokens == [13, 5]
    for batch, count in zip(batches, tokens):
        scale = 1 / count if protocol == "authors" else 1 / sum(tokens)  # sum of means / the step's token mean
        (loop.summed_token_loss(setup.model, batch) * scale).backward()
    for name, param in setup.trainable_parameters().items():
        assert rel_err(grads[name], param.grad) < 1e-6, name


def test_the_authors_sparse_gradient_is_larger_by_the_micro_batches(tmp_path):
    """Micro-batches of equal token counts: the sum of their means is (number of micro-batches) x the mean."""
    _, _, authors = _step_gradients(tmp_path, "authors", lengths=(6, 6, 6))
    _, _, clean = _step_gradients(tmp_path, "clean", lengths=(6, 6, 6))
    for name in authors:
        assert rel_err(authors[name], 3 * clean[name]) < 1e-4, name  # fp32 sums in another order


@pytest.mark.parametrize("recipe, mode", [("retrofit", "additive"), ("sparse", "additive+s"), ("lora", None),
                                          ("full", None)])
def test_authors_bf16_weights_keep_the_trainable_parameters_fp32_except_in_full_finetuning(tmp_path, recipe, mode):
    options = {"bf16": "on", "protocol": "authors"}
    if recipe == "sparse":
        adapter = write_adapter_and_background(tmp_path / "adapter", mode)
        options.update(adapter=str(adapter), background=str(adapter))
    elif mode:
        options["mode"] = mode
    config = tiny_run_config(tmp_path, "retrofit" if recipe == "retrofit" else "train", recipe, **options)
    setup = build_setup(config, CPU)
    dtypes = {name: p.dtype for name, p in setup.model.named_parameters()}
    trainable = setup.trainable_parameters()
    expected = torch.bfloat16 if recipe == "full" else torch.float32
    assert trainable and all(p.dtype == expected for p in trainable.values())
    frozen = {name: dtype for name, dtype in dtypes.items() if name not in trainable}
    assert all(dtype == torch.bfloat16 for dtype in frozen.values()), frozen
    if recipe == "sparse":  # the frozen memory keys, query, gate and out projections too
        assert {n.rsplit(".", 1)[-1] for n in frozen if ".memory." in n} >= {"keys", "weight", "bias"}
    assert all(p.dtype == expected for group in setup.optimizer.param_groups for p in group["params"])


def test_clean_protocol_keeps_fp32_weights_under_bf16_autocast(tmp_path):
    config = tiny_run_config(tmp_path, "train", "full", bf16="on", protocol="clean")
    assert all(p.dtype == torch.float32 for p in build_setup(config, CPU).model.parameters())


@pytest.mark.parametrize("recipe", ["sparse", "full"])
def test_authors_bf16_runs_train(tmp_path, recipe):
    options = {"bf16": "on", "protocol": "authors", "max_steps": 1}
    if recipe == "sparse":
        adapter = write_adapter_and_background(tmp_path / "adapter", "additive")
        options.update(adapter=str(adapter), background=str(adapter))
    result = train(tiny_run_config(tmp_path, "train", recipe, **options))
    assert result["step"] == 1


def test_evaluation_in_bf16_where_the_authors_dtype_auto_gives_bf16(monkeypatch):
    assert not authors_bf16_weights("authors", "auto", "cpu")  # their "auto" is bf16 on CUDA only
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert authors_bf16_weights("authors", "auto", "cuda") and not authors_bf16_weights("clean", "auto", "cuda")


def test_a_model_cast_like_the_authors_runs_with_its_memories_in_bf16():
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", backend="torch", **TINY_MEMORY_KWARGS)
    ids = torch.randint(0, 256, (2, 9))
    ref = model(ids).logits
    cast_like_the_authors(model)
    block = memory_blocks(model)[0]
    assert block.memory.values.dtype == block.alpha.dtype == block.up_proj.weight.dtype == torch.bfloat16
    assert rel_err(model(ids).logits, ref) < 3e-2


def test_background_counts_with_bf16_lookup_and_fp32_values_without_autocast():
    """The authors count background reads on the sparse stage's weights: bf16 except the values."""
    model = tiny_model()
    blocks = attach_memories(model, TINY_MEMORY_LAYERS, "additive", backend="torch", **TINY_MEMORY_KWARGS)
    cast_like_the_authors(model, keep_fp32=[b.memory.values for b in blocks])
    assert blocks[0].memory.values.dtype == torch.float32 and blocks[0].memory.keys.dtype == torch.bfloat16
    blocks[0].memory.set_read_counting(True)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 7)))
    assert int(blocks[0].memory.read_counts.sum()) == 7 * blocks[0].memory.heads * blocks[0].memory.topk
