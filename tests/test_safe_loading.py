"""Files the project loads never run code, and bad ones fail clearly without changing the model.

Training checkpoints (torch.load weights_only=True), memory adapters and background statistics
(safetensors + JSON): a crafted pickle, a truncated file, random bytes and a file written for
another model each raise a clear error, and the model keeps its parameters.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from smf.model import attach_memories, load_memory_adapter, memory_blocks, save_memory_adapter
from smf.tiny import tiny_model
from smf.train.checkpoint import load_checkpoint, save_checkpoint, rng_state
from smf.train.config import ConfigError
from smf_kernels.sparse import BackgroundStats

MEMORY = {"n_keys": 4, "heads": 2, "topk": 2, "key_dim": 8}


class _WritesAFileWhenUnpickled:
    """Unpickling this runs os.system: the attack a crafted checkpoint.pt would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name].detach(), tensor), name


def _training_state(width: int = 3):
    torch.manual_seed(1)
    model = nn.Linear(width, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _save(path: Path, width: int = 3) -> None:
    model, optimizer, scheduler = _training_state(width)
    save_checkpoint(path, step=1, model=model, optimizer=optimizer, scheduler=scheduler, rng_states=[rng_state()],
                    run_options={"recipe": "test"})


def _load(path: Path, model, optimizer, scheduler) -> int:
    return load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, rank=0, world_size=1)


def test_checkpoint_round_trip_restores_weights_and_rng(tmp_path):
    path = tmp_path / "checkpoint.pt"
    saved_model, _, _ = _training_state()
    _save(path)
    after_save = torch.rand(3)  # the draw that follows the saved RNG state
    model, optimizer, scheduler = _training_state()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert _load(path, model, optimizer, scheduler) == 1
    _assert_unchanged(model, _snapshot(saved_model))
    assert torch.equal(torch.rand(3), after_save)


def test_a_crafted_pickle_checkpoint_fails_without_running_its_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "checkpoint.pt"
    torch.save({"step": 1, "trainable": {}, "optimizer": {}, "scheduler": {}, "rng": [_WritesAFileWhenUnpickled(marker)],
                "options": {}}, path)
    model, optimizer, scheduler = _training_state()
    before = _snapshot(model)
    with pytest.raises(ConfigError, match="not a loadable training checkpoint"):
        _load(path, model, optimizer, scheduler)
    assert not marker.exists()
    _assert_unchanged(model, before)


@pytest.mark.parametrize("damage", ["truncated", "random", "other_model", "not_a_dict", "optimizer_state_shape",
                                    "negative_moment"])
def test_a_bad_checkpoint_fails_clearly_and_leaves_the_model_unchanged(tmp_path, damage):
    path = tmp_path / "checkpoint.pt"
    if damage == "other_model":
        _save(path, width=5)
    elif damage == "not_a_dict":
        torch.save([torch.zeros(2)], path)
    elif damage in ("optimizer_state_shape", "negative_moment"):  # the parameters fit; AdamW's moments do not
        _save(path)
        state = torch.load(path, weights_only=True)
        moments = state["optimizer"]["state"][0]
        if damage == "optimizer_state_shape":
            moments["exp_avg"] = torch.zeros(3, 2)
        else:
            moments["exp_avg_sq"] = -moments["exp_avg_sq"].abs() - 1
        torch.save(state, path)
    else:
        _save(path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    model, optimizer, scheduler = _training_state()
    before, optimizer_before = _snapshot(model), str(optimizer.state_dict())
    with pytest.raises(ConfigError, match=str(path)):
        _load(path, model, optimizer, scheduler)
    _assert_unchanged(model, before)
    assert str(optimizer.state_dict()) == optimizer_before


def _adapter(tmp_path: Path) -> Path:
    model = tiny_model(seed=0)
    attach_memories(model, layers=[1], mode="additive", **MEMORY)
    return save_memory_adapter(model, tmp_path / "adapter")


@pytest.mark.parametrize("damage", ["truncated", "random", "other_config", "bad_json", "missing_tensor"])
def test_a_bad_adapter_fails_clearly_and_leaves_the_model_unchanged(tmp_path, damage):
    directory = _adapter(tmp_path)
    weights, config = directory / "memory_adapter.safetensors", directory / "memory_adapter.json"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif damage == "random":
        weights.write_bytes(os.urandom(weights.stat().st_size))
    elif damage == "other_config":  # the json says n_keys 6; the tensors have 4 * 4 slots
        config.write_text(config.read_text().replace('"n_keys": 4', '"n_keys": 6'))
    elif damage == "bad_json":
        config.write_text(config.read_text()[:20])
    else:  # additive mode needs alpha
        config.write_text(config.read_text().replace('"additive"', '"additive+s"'))
        from safetensors.torch import load_file, save_file
        tensors = load_file(str(weights))
        del tensors["layers.1.alpha"]
        save_file(tensors, str(weights))
    model = tiny_model(seed=0)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="memory_adapter"):
        load_memory_adapter(model, directory)
    assert memory_blocks(model) == []
    _assert_unchanged(model, before)


def test_a_good_adapter_still_loads(tmp_path):
    directory = _adapter(tmp_path)
    model = tiny_model(seed=0)
    blocks = load_memory_adapter(model, directory)
    assert [b.layer_index for b in blocks] == [1]


def _background(tmp_path: Path) -> tuple[Path, dict]:
    model = tiny_model(seed=0)
    blocks = attach_memories(model, layers=[1], mode="additive", **MEMORY)
    memories = {"layer1": blocks[0].memory}
    stats = BackgroundStats.for_memories(memories)
    stats.add_batch("layer1", torch.randint(0, 3, (16,)))
    path = tmp_path / "background.safetensors"
    stats.save(path)
    return path, memories


def _rewrite_background(path: Path, doc_freq=None, reads=None, num_batches=None, n_keys=None) -> None:
    """The background file at ``path`` with some of its values replaced (a tampered file)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    header = json.loads(metadata["smf_background"])
    layer = header["layers"]["layer1"]
    if num_batches is not None:
        layer["num_batches"] = num_batches
    if n_keys is not None:
        layer["config"]["n_keys"] = n_keys
    for field, change in (("doc_freq", doc_freq), ("reads", reads)):
        if change is not None:
            tensors[f"layer1.{field}"] = change(tensors[f"layer1.{field}"].clone())
    save_file(tensors, str(path), metadata={"smf_background": json.dumps(header)})


def _set(index, value):
    def change(tensor):
        tensor[index] = value
        return tensor
    return change


@pytest.mark.parametrize("tamper, message", [
    (dict(doc_freq=_set(3, -1)), r"doc_freq .* negative"),
    (dict(doc_freq=_set(3, 2)), r"doc_freq .* exceed.* num_batches 1"),
    (dict(num_batches=0), r"doc_freq .* exceed.* num_batches 0"),
    (dict(reads=_set(0, -5)), r"reads .* negative"),
    (dict(reads=lambda reads: reads * 0), r"reads .* fewer than doc_freq"),
    (dict(n_keys=100_000), r"layer1\.doc_freq must be \(M,\) = \(10000000000,\)"),
    (dict(n_keys=0), r"'n_keys': int >= 1"),
])
def test_a_tampered_background_file_is_refused_before_anything_is_allocated(tmp_path, tamper, message):
    """Values that would make every TF-IDF / KL score NaN, and a header whose sizes disagree with its tensors
    (n_keys = 1e5 claims 1e10 slots: ~80 GB if allocated before the check), fail with one clear error."""
    path, memories = _background(tmp_path)
    _rewrite_background(path, **tamper)
    with pytest.raises(ValueError, match=message):
        BackgroundStats.load(path)


@pytest.mark.parametrize("damage", ["truncated", "random", "pickle", "other_memory"])
def test_a_bad_background_file_fails_clearly(tmp_path, damage):
    path, memories = _background(tmp_path)
    marker = tmp_path / "pwned"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif damage == "random":
        path.write_bytes(os.urandom(path.stat().st_size))
    elif damage == "pickle":
        torch.save({"x": _WritesAFileWhenUnpickled(marker)}, path)
    else:
        other = dict(memories)
        other["layer1"] = type(memories["layer1"])(d_model=memories["layer1"].d_model, n_keys=5, heads=2, topk=2,
                                                   key_dim=8)
        memories = other
    with pytest.raises(ValueError, match="background|safetensors"):
        BackgroundStats.load(path, memories)
    assert not marker.exists()
