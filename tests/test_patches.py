"""Knowledge patches (smf_kernels/patch.py, smf/model/patch.py; docs/hf.md#knowledge-patches): the rows a finetune
changed, saved against fingerprinted base tensors; merged, stacked and unmerged bit for bit; refused on another base
or a damaged file with nothing changed; written by `smf train --save-patch` and SparseMemoryTrainer.save_patch."""
import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import TrainingArguments

import smf_kernels.patch as patch_module
from smf.model import attach_memories, configure_trainable, load_patch, save_patch
from smf.model.loading import load_with_adapter
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model
from smf.train import train
from smf_kernels import ProductKeyMemory
from smf_kernels.hf import SparseMemoryTrainer
from smf_kernels.patch import PATCH_CONFIG, PATCH_WEIGHTS, MemoryPatch, fingerprint
from smf_kernels.sparse import RowSparseAdamW, SparseMemoryController
from test_hf_trainer import Sequences
from test_train_recipes import tiny_run_config, write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")

D_MODEL, VALUE_DIM = 40, 72  # awkward sizes: 13 ** 2 = 169 slots


def _memory(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return ProductKeyMemory(D_MODEL, n_keys=13, heads=2, topk=3, key_dim=10, value_dim=VALUE_DIM).to(dtype)


def _finetuned(base, rows, seed=1):
    """A copy of ``base`` whose value ``rows`` moved by a random step (as a sparse update moves them)."""
    model = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        step = torch.randn(len(rows), VALUE_DIM, generator=generator).to(model.values.dtype)
        model.values[torch.tensor(rows)] += step
    return model


def _state(module):
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _same(a, b):
    """Two states equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                    b[k].reshape(-1).view(torch.uint8)) for k in a)


def _inputs(dtype=torch.float32):
    return torch.randn(7, D_MODEL, generator=torch.Generator().manual_seed(5)).to(dtype)


def _patch_bytes(directory):
    return sum(os.path.getsize(directory / name) for name in (PATCH_WEIGHTS, PATCH_CONFIG))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_patch_turns_a_fresh_base_into_the_finetuned_memory_and_back(tmp_path, dtype):
    base = _memory(dtype)
    rows = [0, 3, 17, 18, 100, 168]
    model = _finetuned(base, rows)
    patch = MemoryPatch.between(model, base)
    assert list(patch.entries) == ["values"] and patch.entries["values"].indices.tolist() == rows
    patch.save(tmp_path / "patch")

    fresh, before = copy.deepcopy(base), _state(base)
    loaded = MemoryPatch.load(tmp_path / "patch")
    assert loaded.entries["values"].data.dtype == dtype
    loaded.merge(fresh)
    x = _inputs(dtype)
    assert torch.equal(fresh(x), model(x)) and _same(_state(fresh), _state(model))
    loaded.unmerge(fresh)
    assert _same(_state(fresh), before)


def test_only_bitwise_changes_count_and_negative_zero_is_one():
    base = _memory()
    with torch.no_grad():
        base.values[5] = 0.0
    model = copy.deepcopy(base)
    with torch.no_grad():
        model.values[5, 2] = -0.0  # equal as floats, not as bits
    assert MemoryPatch.between(model, base).entries["values"].indices.tolist() == [5]
    assert MemoryPatch.between(copy.deepcopy(base), base).entries == {}


def test_the_patch_is_within_a_tenth_of_the_minimal_delta(tmp_path):
    torch.manual_seed(0)
    base = ProductKeyMemory(D_MODEL, n_keys=41, heads=2, topk=3, key_dim=10, value_dim=VALUE_DIM)  # 1681 slots
    rows = sorted(torch.randperm(1681)[:50].tolist())
    model = copy.deepcopy(base)
    with torch.no_grad():
        model.values[torch.tensor(rows)] *= 1.5
    save_patch(model, base, tmp_path / "patch")
    minimal = len(rows) * (VALUE_DIM * 4 + 8)  # the changed rows and their int64 indices
    assert _patch_bytes(tmp_path / "patch") <= 1.1 * minimal


def test_the_fingerprint_does_not_depend_on_the_chunk_size(monkeypatch):
    values = _memory().values
    whole = fingerprint(values, {"n_keys": 13})
    monkeypatch.setattr(patch_module, "CHUNK_BYTES", 3 * VALUE_DIM * 4 + 5)
    assert fingerprint(values, {"n_keys": 13}) == whole
    assert fingerprint(values, {"n_keys": 14}) != whole
    assert fingerprint(values.detach().to(torch.float64), {"n_keys": 13}) != whole


def test_two_patches_stack_in_order_and_unmerge_in_reverse_to_the_base_bit_for_bit():
    base = _memory()
    first = _finetuned(base, [1, 2, 50])
    second = _finetuned(first, [2, 51, 160], seed=2)
    with torch.no_grad():
        second.keys.mul_(1.25)  # a non-value tensor changes too: a whole-tensor entry
    one, two = MemoryPatch.between(first, base), MemoryPatch.between(second, first)
    assert {name: entry.kind for name, entry in two.entries.items()} == {"keys": "tensor", "values": "rows"}

    model, start = copy.deepcopy(base), _state(base)
    with pytest.raises(ValueError, match="made for another base"):
        two.merge(model)  # made on top of the first
    assert _same(_state(model), start)
    one.merge(model)
    two.merge(model)
    assert _same(_state(model), _state(second))
    merged = _state(model)
    with pytest.raises(ValueError, match="unmerge later patches first"):
        one.unmerge(model)
    assert _same(_state(model), merged)
    two.unmerge(model)
    assert _same(_state(model), _state(first))
    one.unmerge(model)
    assert _same(_state(model), start)


def test_a_patch_for_another_base_is_refused_naming_the_table_and_both_fingerprints(tmp_path):
    base = _memory()
    save_patch(_finetuned(base, [4, 9]), base, tmp_path / "patch")
    other = _memory(seed=7)
    before = _state(other)
    patch = load_patch(tmp_path / "patch")
    with pytest.raises(ValueError) as err:
        patch.merge(other)
    message = str(err.value)
    assert "values" in message and patch.entries["values"].base in message
    assert fingerprint(other.values, other.config()) in message and "nothing was changed" in message
    assert _same(_state(other), before)


def test_non_value_tensors_that_changed_travel_whole():
    base = _memory()
    model = _finetuned(base, [7])
    with torch.no_grad():
        model.query_map.weight.add_(0.01)
        model.out_map.bias.add_(0.5)
    patch = MemoryPatch.between(model, base)
    kinds = {name: entry.kind for name, entry in patch.entries.items()}
    assert kinds == {"query_map.weight": "tensor", "out_map.bias": "tensor", "values": "rows"}
    fresh = copy.deepcopy(base)
    patch.merge(fresh)
    assert torch.equal(fresh(_inputs()), model(_inputs()))
    patch.unmerge(fresh)
    assert _same(_state(fresh), _state(base))


def test_given_rows_are_saved_and_must_cover_every_change():
    base = _memory()
    model = _finetuned(base, [3, 30])
    touched = torch.tensor([3, 12, 30])  # row 12 touched but unchanged: saved as given
    patch = MemoryPatch.between(model, base, rows={"": touched})
    assert patch.entries["values"].indices.tolist() == [3, 12, 30]
    with pytest.raises(ValueError, match="misses rows that changed, e.g. \\[30\\]"):
        MemoryPatch.between(model, base, rows={"": torch.tensor([3, 12])})
    for bad, message in ((torch.tensor([3, 3, 30]), "strictly ascending"), (torch.tensor([3, 169]), "outside"),
                         (torch.tensor([3, 30], dtype=torch.int32), "int64")):
        with pytest.raises(ValueError, match=message):
            MemoryPatch.between(model, base, rows={"": bad})


def _rewrite(directory, tensors=None, config=None):
    """The patch in ``directory`` with its tensors and/or JSON edited, the checksum made to fit again (so that the
    other checks are what refuses it)."""
    stored = load_file(str(directory / PATCH_WEIGHTS))
    spec = json.loads((directory / PATCH_CONFIG).read_text())
    if tensors is not None:
        stored = tensors(stored)
        save_file(stored, str(directory / PATCH_WEIGHTS))
    if config is not None:
        config(spec)
    spec["weights_sha256"] = patch_module.hashlib.sha256((directory / PATCH_WEIGHTS).read_bytes()).hexdigest()
    (directory / PATCH_CONFIG).write_text(json.dumps(spec))


def _truncate(directory):
    data = (directory / PATCH_WEIGHTS).read_bytes()
    (directory / PATCH_WEIGHTS).write_bytes(data[:len(data) // 2])


def _entry(spec):
    return spec["entries"][0]


DAMAGES = {
    "truncated": (_truncate, "sha256 differs"),
    "not json": (lambda d: (d / PATCH_CONFIG).write_text('{"format": "smf-memory-patch", '), "not valid JSON"),
    "json rows edited": (lambda d: _rewrite(d, config=lambda s: _entry(s).update(rows=5)), "must be \\(5, 72\\)"),
    "json shape edited": (lambda d: _rewrite(d, config=lambda s: _entry(s).update(shape=[169, 73])),
                          "must be \\(4, 73\\)"),
    "json entry dropped": (lambda d: _rewrite(d, config=lambda s: s.update(entries=[])), "unexpected"),
    "wrong row shape": (lambda d: _rewrite(d, tensors=lambda t: {
        **t, "values:rows": t["values:rows"][:, :-1].contiguous()}), "must be \\(4, 72\\)"),
    "index out of range": (lambda d: _rewrite(d, tensors=lambda t: {
        **t, "values:indices": torch.tensor([1, 2, 3, 169], dtype=torch.int32)}), "outside \\[0, 169\\)"),
    "index repeated": (lambda d: _rewrite(d, tensors=lambda t: {
        **t, "values:indices": torch.tensor([1, 2, 2, 3], dtype=torch.int32)}), "strictly ascending"),
    "index dtype": (lambda d: _rewrite(d, tensors=lambda t: {**t, "values:indices": t["values:indices"].long()}),
                    "must be torch.int32"),
    "non-finite row": (lambda d: _rewrite(d, tensors=lambda t: {
        **t, "values:rows": t["values:rows"].index_fill(0, torch.tensor([1]), float("nan"))}), "non-finite"),
    "another format": (lambda d: _rewrite(d, config=lambda s: s.update(version=2)), "not a knowledge patch config"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_patch_is_refused_before_the_model_is_touched(tmp_path, damage):
    base = _memory()
    save_patch(_finetuned(base, [5, 6, 60, 61]), base, tmp_path / "patch")
    spoil, message = DAMAGES[damage]
    spoil(tmp_path / "patch")
    model, before = copy.deepcopy(base), _state(base)
    with pytest.raises(ValueError, match=message):
        load_patch(tmp_path / "patch").merge(model)
    assert _same(_state(model), before)


def test_a_missing_file_is_named(tmp_path):
    base = _memory()
    save_patch(_finetuned(base, [5]), base, tmp_path / "patch")
    (tmp_path / "patch" / PATCH_WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=PATCH_WEIGHTS):
        load_patch(tmp_path / "patch")


def test_smf_train_save_patch_writes_a_patch_that_merges_to_the_finetuned_logits(tmp_path):
    """20 SMF steps of `smf train --save-patch` (additive+s: alpha trains too) on the tiny preset."""
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    config = tiny_run_config(tmp_path, "train", "sparse", adapter=str(adapter), background=str(adapter),
                             n_examples=20, global_batch_size=4, micro_batch_size=2, epochs=4, lr=5e-2, warmup_steps=0,
                             save_patch=True)
    result = train(config)
    assert result["step"] == 20
    patch = load_patch(result["final_dir"] / "patch")
    kinds = {name.split(".mlp.")[-1] for name in patch.entries}
    assert kinds == {"alpha", "memory.values"}
    changed = sum(entry.data.numel() * 4 for entry in patch.entries.values() if entry.kind == "rows")
    assert _patch_bytes(result["final_dir"] / "patch") <= 1.1 * changed

    finetuned, _ = load_with_adapter("tiny", result["final_dir"])
    model, _ = load_with_adapter("tiny", adapter / "final")
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        patch.merge(model)
        assert torch.equal(model(input_ids=ids).logits, finetuned(input_ids=ids).logits)
        patch.unmerge(model)
        assert torch.equal(model(input_ids=ids).logits, before)


def test_the_trainer_saves_the_patch_of_its_run(tmp_path):
    model = tiny_model()
    torch.manual_seed(0)
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    configure_trainable(model, "sparse")
    base = copy.deepcopy(model)
    controller = SparseMemoryController(model, rule="tfidf", rows_per_step=6)
    docs = Sequences(4, seed=7)
    controller.collect_background([{"input_ids": docs.ids[i:i + 1]} for i in range(len(docs))])
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2,
                             learning_rate=5e-2, report_to=[], use_cpu=True, dataloader_num_workers=0, seed=11,
                             save_strategy="no")
    trainer = SparseMemoryTrainer(model=model, args=args, train_dataset=Sequences(8), controller=controller)
    trainer.train()
    saved = trainer.save_patch(tmp_path / "patch", base, optimizer_rows=True)
    assert {entry.kind for entry in saved.entries.values()} == {"rows"} and len(saved.entries) == 3
    for entry in saved.entries.values():  # 3 steps of at most 6 rows; each saved row stepped at least once
        assert 0 < len(entry.indices) <= 18 and entry.moments["row_step"].min() >= 1
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(4))
    load_patch(tmp_path / "patch").merge(base)
    model.eval()
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).logits, model(input_ids=ids).logits)


def _row_steps(memory, optimizer, steps, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randperm(memory.num_slots, generator=generator)[:11].sort().values
        optimizer.step_rows(memory.values, rows, torch.randn(11, VALUE_DIM, generator=generator))


def test_a_patch_with_its_optimizer_rows_continues_training_as_the_finetuned_run(tmp_path):
    base = _memory()
    model = copy.deepcopy(base)
    optimizer = RowSparseAdamW([model.values], lr=1e-2, weight_decay=0.1)
    _row_steps(model, optimizer, 3, seed=1)
    save_patch(model, base, tmp_path / "patch", optimizer=optimizer)
    patch = load_patch(tmp_path / "patch")
    assert set(patch.entries["values"].moments) == {"row_step", "exp_avg", "exp_avg_sq"}

    resumed = copy.deepcopy(base)
    patch.merge(resumed)
    resumed_optimizer = RowSparseAdamW([resumed.values], lr=1e-2, weight_decay=0.1)
    patch.load_optimizer_rows(resumed, resumed_optimizer)
    _row_steps(model, optimizer, 2, seed=2)
    _row_steps(resumed, resumed_optimizer, 2, seed=2)
    assert _same(_state(resumed), _state(model))
    for key, value in optimizer.row_state(model.values).items():
        assert torch.equal(resumed_optimizer.row_state(resumed.values)[key], value), key
    assert torch.equal(resumed_optimizer.touched_rows(resumed.values), optimizer.touched_rows(model.values))
    with pytest.raises(ValueError, match="carries no optimizer rows"):
        MemoryPatch.between(model, base).load_optimizer_rows(resumed, resumed_optimizer)


def test_a_patch_with_optimizer_rows_keeps_a_touched_row_whose_bits_did_not_move(tmp_path):
    base = _memory()
    model = copy.deepcopy(base)
    optimizer = RowSparseAdamW([model.values], lr=1e-2, weight_decay=0.0)
    rows = torch.tensor([3, 17])
    optimizer.step_rows(model.values, rows, torch.zeros(2, VALUE_DIM))  # a zero gradient: the rows keep their bits
    optimizer.step_rows(model.values, torch.tensor([5]), torch.randn(1, VALUE_DIM))
    assert MemoryPatch.between(model, base).entries["values"].indices.tolist() == [5]
    patch = MemoryPatch.between(model, base, optimizer=optimizer)
    assert patch.entries["values"].indices.tolist() == [3, 5, 17]
    assert patch.entries["values"].moments["row_step"].tolist() == [1, 1, 1]


def test_damaged_optimizer_rows_are_refused(tmp_path):
    base = _memory()
    model = copy.deepcopy(base)
    optimizer = RowSparseAdamW([model.values], lr=1e-2)
    _row_steps(model, optimizer, 2, seed=1)
    save_patch(model, base, tmp_path / "patch", optimizer=optimizer)
    _rewrite(tmp_path / "patch", tensors=lambda t: {**t, "values:exp_avg_sq": -t["values:exp_avg_sq"]})
    with pytest.raises(ValueError, match="exp_avg_sq holds negative values"):
        load_patch(tmp_path / "patch")
