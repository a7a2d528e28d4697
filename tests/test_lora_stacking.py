"""LoRA on a model with memories never reaches inside the memories (README, "LoRA on top of memories")."""
import pytest
import torch
from peft import LoraConfig, get_peft_model

from smf.model import LORA_TARGET_REGEX, LORA_TARGETS, apply_lora, attach_memories, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model


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
        assert type(block.memory.gate_proj) is torch.nn.Linear
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
def test_the_usual_targets_with_the_documented_exclusion_stay_out_of_the_memories(targets):
    """The workaround the memories' warning and docs/hf.md give, which needs no smf: exclude_modules."""
    model = _model_with_memories()
    before = [{k: v.clone() for k, v in b.memory.state_dict().items()} for b in memory_blocks(model)]
    config = LoraConfig(r=4, target_modules=targets, exclude_modules=r".*\.memory\..*", task_type="CAUSAL_LM")
    _check_stacked(get_peft_model(model, config), before)


def test_a_plain_list_of_names_would_reach_the_memory_gate():
    """Why the regex: peft matches names by suffix, and the memory has its own gate_proj (which warns)."""
    config = LoraConfig(r=4, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    with pytest.warns(UserWarning, match=r"peft wraps the gate_proj of a ProductKeyMemory in a peft\..*LoRA will "
                                         r"train this memory projection.*exclude_modules=r'\.\*\\\.memory.*"
                                         r"smf.model.apply_lora\(model\).*LORA_TARGET_REGEX"):
        names = _lora_module_names(get_peft_model(_model_with_memories(), config))
    assert "base_model.model.model.layers.2.mlp.memory.gate_proj" in names
