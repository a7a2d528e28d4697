"""LoRA on a model with memories never reaches inside the memories (README, "LoRA on top of memories")."""
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model

from smf.model import LORA_TARGET_REGEX, LORA_TARGETS, apply_lora, attach_memories, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from smf_kernels.memory import PROJECTIONS
from smf_kernels.projection import MemoryProjection


def _lora_module_names(model):
    return [name for name, module in model.named_modules() if hasattr(module, "lora_A")]


def _model_with_memories():
    model = tiny_model()
    attach_memories(model, (2, 5), "additive", **TINY_MEMORY_KWARGS)
    return model


def _check_stacked(peft_model, memories_before):
    names = _lora_module_names(peft_model)
    assert names and not [name for name in names if ".memory." in name]
    assert any(name.endswith("layers.2.mlp.gate_proj") for name in names)  # the original MLP is adapted
    assert len(names) == 8 * len(LORA_TARGETS)
    for block, before in zip(memory_blocks(peft_model), memories_before):
        assert all(torch.equal(v, before[k]) for k, v in block.memory.state_dict().items())
        assert all(type(getattr(block.memory, name)) is MemoryProjection for name in PROJECTIONS)
    peft_model(torch.randint(0, 256, (1, 6)))


def test_apply_lora_never_targets_memory_parameters():
    model = _model_with_memories()
    before = [{k: v.clone() for k, v in b.memory.state_dict().items()} for b in memory_blocks(model)]
    _check_stacked(apply_lora(model, r=4), before)


def test_peft_with_the_documented_targets_stays_out_of_the_memories():
    model = _model_with_memories()
    before = [{k: v.clone() for k, v in b.memory.state_dict().items()} for b in memory_blocks(model)]
    config = LoraConfig(r=4, target_modules=LORA_TARGET_REGEX, task_type="CAUSAL_LM")
    _check_stacked(get_peft_model(model, config), before)


@pytest.mark.parametrize("targets", [list(LORA_TARGETS), "all-linear"])
def test_the_usual_targets_and_all_linear_stay_out_of_the_memories(targets):
    """peft matches names by suffix and "all-linear" takes every nn.Linear: a memory's projections are neither
    (query_map / gate_map / out_map, MemoryProjection modules), so no exclusion is needed."""
    model = _model_with_memories()
    before = [{k: v.clone() for k, v in b.memory.state_dict().items()} for b in memory_blocks(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft says nothing about the memories either
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, task_type="CAUSAL_LM"))
    _check_stacked(peft_model, before)


def test_lora_on_the_memory_projections_by_naming_their_weights():
    """What docs/hf.md shows for LoRA inside the memories on purpose: peft's target_parameters."""
    model = _model_with_memories()
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
    config = LoraConfig(r=2, target_modules=[], target_parameters=["memory.gate_map.weight"], lora_dropout=0.0,
                        init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    trainable = sorted(name for name, p in peft_model.named_parameters() if p.requires_grad)
    assert len(trainable) == 4 and all(".mlp.memory.gate_map.lora_" in name for name in trainable)
    logits = peft_model(ids).logits
    assert not torch.equal(logits, before)
    logits.sum().backward()
    assert all(p.grad is not None for name, p in peft_model.named_parameters() if p.requires_grad)
