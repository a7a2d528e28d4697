"""Checkpoints saved before the memory projections were renamed (``query_proj`` / ``gate_proj`` / ``out_proj``, now
``query_map`` / ``gate_map`` / ``out_map``) still load, with the logits the old code computed: the fixture
tests/fixtures/old_projection_names/ was written by the code of commit 8b023a6 (make_old_projection_fixture.py).

The stored logits come from another CPU: its matrix kernels may sum in another order (AVX-512 or not, thread
count), so the logits are compared within the precision of float32 through this depth, not bit for bit."""
import shutil
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import load_file

import smf.model.memory_spec as memory_spec
from smf.model import from_pretrained, load_memory_adapter, memory_blocks
from smf.train.checkpoint import load_checkpoint, rng_state, save_checkpoint
from smf_kernels import ProductKeyMemory
from smf_kernels.memory import LEGACY_PROJECTIONS, PROJECTIONS
from smf_kernels.projection import MemoryProjection
from smf_kernels.sharded import ShardedProductKeyMemory
from smf_kernels.sharded.layout import ColumnShard, column_bounds
from test_hf_portable import WITHOUT_SMF, _run

FIXTURE = Path(__file__).parent / "fixtures" / "old_projection_names"
REFERENCE = load_file(FIXTURE / "reference.safetensors")
# float32 logits (largest 4.75, ulp 4.8e-7) after 2 decoder layers, a memory and the head, dot products of <= 32
# terms: another order of summation moves each op's result by a few ulps and the depth adds them up; another CPU
# measured 2.1e-6. 1e-4 (~200 ulps of the largest logit) leaves room for any x86 CPU and stays four orders below
# what a wrongly mapped projection changes (a random weight moves the logits by ~1).
LOGITS_ATOL = 1e-4
OLD_KEYS = [f"model.layers.1.mlp.memory.{old}.{tensor}" for old in LEGACY_PROJECTIONS for tensor in ("weight", "bias")]

# Runs where smf is importable but not imported: the old saved code asks smf for its memories, and smf hands back
# that code's own plain ones (smf's have other names than the checkpoint).
OLD_CODE_BESIDE_SMF = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM

results = {}
for directory in sys.argv[1:]:
    ref = torch.load(directory + "/ref.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    results[directory] = {"max_diff": (model(ref["ids"]).logits - ref["logits"]).abs().max().item(),
                          "memory": type(model.model.layers[1].mlp.memory).__name__}
print("RESULTS", json.dumps(results))
"""


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(REFERENCE["ids"]).logits


def _assert_old_logits(logits: torch.Tensor) -> None:
    torch.testing.assert_close(logits, REFERENCE["logits"], rtol=0, atol=LOGITS_ATOL)


def _fixture_copy(tmp_path: Path) -> Path:
    """The saved directory with the reference as the subprocess scripts of test_hf_portable read it."""
    directory = Path(shutil.copytree(FIXTURE / "hf", tmp_path / "old"))
    torch.save({"ids": REFERENCE["ids"], "logits": REFERENCE["logits"]}, directory / "ref.pt")
    return directory


def test_the_fixture_holds_the_old_names():
    with safe_open(FIXTURE / "hf" / "model.safetensors", "pt") as handle:
        assert set(OLD_KEYS) <= set(handle.keys())
    assert "gate_proj = nn.Linear" in (FIXTURE / "hf" / "modeling_smf_memories.py").read_text()


def test_the_legacy_names_agree_between_smf_kernels_and_the_saved_code():
    assert memory_spec.LEGACY_KEY_MAPPING == {rf"\.memory\.{old}\.": f".memory.{new}."
                                              for old, new in LEGACY_PROJECTIONS.items()}


@pytest.mark.parametrize("load", [from_pretrained, tf.AutoModelForCausalLM.from_pretrained],
                         ids=["smf.model.from_pretrained", "AutoModelForCausalLM with smf"])
def test_smf_loads_the_old_checkpoint_with_the_old_logits_and_saves_the_new_names(tmp_path, load):
    model = load(FIXTURE / "hf")
    [block] = memory_blocks(model)
    block.memory.backend = "torch"
    assert all(type(getattr(block.memory, name)) is MemoryProjection for name in PROJECTIONS)
    _assert_old_logits(_logits(model))
    model.save_pretrained(tmp_path / "resaved")
    with safe_open(tmp_path / "resaved" / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
    assert not names & set(OLD_KEYS) and "model.layers.1.mlp.memory.gate_map.weight" in names


def test_the_old_and_the_resaved_directory_load_through_their_saved_code(tmp_path):
    """Without smf: the old saved code (old names) and the current one smf writes when it saves the loaded model.
    Where smf is importable, the old saved code's own plain memories (smf's have other names)."""
    old = _fixture_copy(tmp_path)
    resaved = tmp_path / "resaved"
    from_pretrained(old, backend="torch").save_pretrained(resaved)
    shutil.copy(old / "ref.pt", resaved / "ref.pt")
    without = _run(WITHOUT_SMF, [old, resaved], tmp_path, with_smf=False)
    assert without[str(old)]["max_diff"] <= LOGITS_ATOL and without[str(resaved)]["max_diff"] <= LOGITS_ATOL
    beside = _run(OLD_CODE_BESIDE_SMF, [old], tmp_path, with_smf=True)[str(old)]
    assert beside["max_diff"] <= LOGITS_ATOL and beside["memory"] == "PlainProductKeyMemory"


def test_an_old_memory_adapter_loads_with_the_old_logits():
    base = tf.Qwen2ForCausalLM.from_pretrained(FIXTURE / "hf")
    load_memory_adapter(base, FIXTURE / "adapter", backend="torch")
    _assert_old_logits(_logits(base))


def test_a_state_dict_of_the_old_names_loads_into_a_memory_and_a_sharded_one():
    weights = load_file(FIXTURE / "hf" / "model.safetensors")
    prefix = "model.layers.1.mlp.memory."
    old = {key[len(prefix):]: tensor for key, tensor in weights.items() if key.startswith(prefix)}
    memory = ProductKeyMemory(16, n_keys=4, heads=2, topk=2, key_dim=8)
    memory.load_state_dict(old, strict=True)
    for name, tensor in old.items():
        assert torch.equal(memory.get_parameter(name.replace("_proj", "_map")), tensor)
    sharded = ShardedProductKeyMemory(16, n_keys=4, heads=2, topk=2, key_dim=8)
    sharded.shard = ColumnShard(16, 1, 2, tuple(column_bounds(16, 2)))  # as rank 1 of 2: the full table is cut
    sharded.values = torch.nn.Parameter(torch.zeros(16, 8))
    sharded.load_state_dict(old, strict=True)
    assert torch.equal(sharded.values, old["values"][:, 8:])
    assert torch.equal(sharded.gate_map.bias, old["gate_proj.bias"])
    with pytest.raises(RuntimeError, match="Unexpected key.*gate_proj.weight"):  # both names: which one is meant?
        memory.load_state_dict({**memory.state_dict(), "gate_proj.weight": old["gate_proj.weight"]})


def test_a_whole_model_state_dict_of_the_old_names_loads_as_the_trainer_resumes_one():
    """transformers' Trainer resumes a checkpoint with ``model.load_state_dict(state_dict, False)``."""
    model = from_pretrained(FIXTURE / "hf", backend="torch")
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    result = model.load_state_dict(load_file(FIXTURE / "hf" / "model.safetensors"), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]  # tied to the embeddings
    _assert_old_logits(_logits(model))


def test_a_training_checkpoint_of_the_old_names_resumes(tmp_path):
    def training_state():
        torch.manual_seed(2)
        memory = ProductKeyMemory(16, n_keys=4, heads=2, topk=2, key_dim=8, backend="torch")
        optimizer = torch.optim.AdamW(memory.parameters(), lr=1e-2)
        return memory, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    memory, optimizer, scheduler = training_state()
    memory(torch.randn(5, 16)).sum().backward()
    optimizer.step()
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, step=1, model=memory, optimizer=optimizer, scheduler=scheduler, rng_states=[rng_state()],
                    run_options={"recipe": "retrofit"})
    state = torch.load(path, weights_only=True)
    state["trainable"] = {name.replace("_map.", "_proj."): tensor for name, tensor in state["trainable"].items()}
    torch.save(state, path)  # as the code before the rename wrote it
    resumed, optimizer, scheduler = training_state()
    assert load_checkpoint(path, model=resumed, optimizer=optimizer, scheduler=scheduler, rank=0, world_size=1) == 1
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), memory.parameters(), strict=True))
