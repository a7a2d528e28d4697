"""A saved model whose weights file lacks a memory tensor is refused, naming the tensors, by every loader: smf's
``from_pretrained``, ``AutoModelForCausalLM`` / ``AutoModel`` with smf imported, the saved code's plain classes,
and ``smf eval --model`` in one line (issue 42 item 7: each loaded NaN or arbitrary memory values, and
transformers' load report called them newly initialised)."""
import importlib.util

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import smf.model.remote_code as remote_code
from smf.model import attach_memories, from_pretrained
from smf.model.hf_auto import saved_code
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from test_cli_reliability import one_line_error
from test_cli_smf import run_main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny additive model with memories at layers 2 and 5, saved; returns its directory."""
    model = tiny_model()
    attach_memories(model, (2, 5), "additive", backend="torch", **TINY_MEMORY_KWARGS)
    directory = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(directory)
    return directory


def _without(saved, tmp_path, *suffixes):
    """A copy of ``saved`` whose weights file lacks every tensor whose name ends with one of ``suffixes``."""
    directory = tmp_path / "damaged"
    directory.mkdir()
    for path in saved.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    weights = load_file(directory / "model.safetensors")
    kept = {name: tensor for name, tensor in weights.items() if not name.endswith(suffixes)}
    assert len(kept) < len(weights)
    save_file(kept, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _plain_saved_class(directory, monkeypatch):
    """The causal LM class of the code saved in ``directory``, building its plain memories."""
    monkeypatch.setenv(remote_code.PLAIN_ENV, "1")
    path = directory / "modeling_smf_memories.py"
    assert path.read_text() == saved_code("qwen2")
    spec = importlib.util.spec_from_file_location(f"saved_{abs(hash(directory))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, module.MODEL_CLASS_NAME)


LOADERS = {  # name: load(directory, monkeypatch, **from_pretrained options)
    "smf.model.from_pretrained": lambda directory, monkeypatch, **kw: from_pretrained(directory, **kw),
    "AutoModelForCausalLM with smf": lambda directory, monkeypatch, **kw: tf.AutoModelForCausalLM.from_pretrained(
        directory, trust_remote_code=True, **kw),
    "AutoModel with smf": lambda directory, monkeypatch, **kw: tf.AutoModel.from_pretrained(directory, **kw),
    "the saved code's plain class": lambda directory, monkeypatch, **kw: _plain_saved_class(
        directory, monkeypatch).from_pretrained(directory, **kw),
}


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("missing", [("mlp.memory.values",), ("mlp.memory.keys",), ("mlp.alpha",),
                                     ("layers.5.mlp.memory.gate_map.weight", "layers.2.mlp.memory.values")])
def test_a_checkpoint_lacking_a_memory_tensor_is_refused_naming_it(saved, tmp_path, monkeypatch, loader, missing):
    directory = _without(saved, tmp_path, *missing)
    with pytest.raises(ValueError) as refused:
        LOADERS[loader](directory, monkeypatch)
    message = str(refused.value)
    assert message.startswith(f"{directory}: the checkpoint lacks the memory tensors ") and "\n" not in message
    named = message.split("memory tensors ")[1].split(";")[0].split(", ")
    prefix = "" if loader == "AutoModel with smf" else "model."
    if missing[0].startswith("mlp."):
        assert named == [f"{prefix}layers.{i}.{missing[0]}" for i in (2, 5)]
    else:
        assert named == sorted(prefix + name for name in missing)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_memory_tensor_of_another_shape_is_refused_even_when_mismatches_are_ignored(saved, tmp_path, monkeypatch,
                                                                                     loader):
    """``ignore_mismatched_sizes=True`` made transformers leave such a tensor uninitialised (NaN values)."""
    directory = _without(saved, tmp_path, "layers.5.mlp.memory.values")
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.5.mlp.memory.values"] = torch.zeros(10, 64)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the checkpoint holds the memory tensors (model\.)?layers\.5\.mlp\.memory"
                                         r"\.values in other shapes; a model with memories loads only whole"):
        LOADERS[loader](directory, monkeypatch, ignore_mismatched_sizes=True)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_whole_checkpoint_loads_with_finite_logits_and_its_loading_info(saved, monkeypatch, loader):
    model = LOADERS[loader](saved, monkeypatch)
    out = model(torch.randint(0, 256, (1, 5)))
    assert torch.isfinite(out[0]).all()
    _, info = tf.AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"]


def test_smf_eval_of_a_model_lacking_memory_values_is_one_line(saved, tmp_path, capsys):
    directory = _without(saved, tmp_path, "memory.values")
    code, err = run_main(["eval", "--model", str(directory), "--output-dir", str(tmp_path / "eval")], capsys)
    last = err.strip().splitlines()[-1]  # after the progress bar of reading the weights
    one_line_error(code, last, f"--model {str(directory)!r} cannot be loaded ({directory}: the checkpoint lacks the "
                               "memory tensors model.layers.2.mlp.memory.values")
