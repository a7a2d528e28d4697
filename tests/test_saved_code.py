"""The code saved beside a model's weights (modeling_smf_memories.py) and smf's own loader: one set of rules for
``config.smf_memories`` (issue 34), standard metadata, smf's memories where smf is importable, the plain top-k.

The saved code is imported here from the text ``save_pretrained`` writes; ``SMF_SAVED_CODE_PLAIN=1`` makes it
build its plain memories in this process (where smf is importable). Loading in a process without smf is covered
by tests/test_hf_portable.py."""
import ast
import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import smf.model.remote_code as remote_code
from smf.model import attach_memories, from_pretrained, memory_blocks
from smf.model.hf_auto import memory_model_class, register_memory_type, saved_code
from smf.model.memory_spec import AUTO_CLASSES, MEMORY_MODES
from smf.tiny import TINY_MEMORY_KWARGS, tiny_config, tiny_model
from smf.vocabulary import MEMORY_MODES as VOCABULARY_MODES
from smf_kernels import ProductKeyMemory
from smf_kernels.sparse import SparseMemoryController

REPO = Path(__file__).resolve().parents[1]
GOOD = {"layers": [2, 5], "mode": "additive", "memory_kwargs": dict(TINY_MEMORY_KWARGS, value_dim=64),
        "layers_path": "model.layers", "mlp_attr": "mlp"}
# Each a change to GOOD, and the field the error must name (issue 34: each of these loaded, or failed late).
BAD = [
    ({"memory_kwargs": dict(TINY_MEMORY_KWARGS, topk=-1)}, "memory_kwargs.topk"),
    ({"memory_kwargs": dict(TINY_MEMORY_KWARGS, topk=32)}, "memory_kwargs.topk"),
    ({"memory_kwargs": dict(TINY_MEMORY_KWARGS, key_dim=31)}, "memory_kwargs.key_dim"),
    ({"memory_kwargs": dict(TINY_MEMORY_KWARGS, n_keys="16")}, "memory_kwargs.n_keys"),
    ({"memory_kwargs": dict(TINY_MEMORY_KWARGS, width=3)}, "memory_kwargs"),
    ({"layers": [2, 99]}, "layers"),
    ({"layers": [-1]}, "layers"),
    ({"layers": [2, 2]}, "layers"),
    ({"layers": []}, "layers"),
    ({"layers": [True]}, "layers"),
    ({"mode": "multiplicative"}, "mode"),
    ({"layers_path": "model.blocks"}, "layers_path"),
    ({"layers_path": 3}, "layers_path"),
    ({"mlp_attr": None}, "mlp_attr"),
    ({"extra": 1}, "config.smf_memories must have the fields"),
]


def _saved_module(tmp_path: Path):
    """modeling_smf_memories.py for Qwen-2 as save_pretrained writes it, imported."""
    path = tmp_path / "modeling_smf_memories.py"
    path.write_text(saved_code("qwen2"))
    spec = importlib.util.spec_from_file_location(f"saved_{abs(hash(tmp_path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _config(config_class, spec):
    config = config_class(**tiny_config().to_dict())
    config.smf_memories = spec
    return config


def test_memory_modes_are_smfs():
    assert MEMORY_MODES == VOCABULARY_MODES


@pytest.mark.parametrize("change,field", BAD, ids=[field + "-" + str(i) for i, (_, field) in enumerate(BAD)])
def test_a_bad_spec_is_refused_naming_the_field_by_smf_and_by_the_saved_code(tmp_path, monkeypatch, change, field):
    monkeypatch.setenv(remote_code.PLAIN_ENV, "1")
    module = _saved_module(tmp_path)
    spec = {**copy.deepcopy(GOOD), **change}
    library_class = memory_model_class(register_memory_type("qwen2"))
    for model_class, config_class in ((library_class, library_class.config_class),
                                      (module.Qwen2ForCausalLMWithSmfMemories, module.config_class)):
        with pytest.raises(ValueError, match=r"config\.smf_memories") as raised:
            model_class(_config(config_class, spec))
        assert field in str(raised.value), (model_class, str(raised.value))


def test_from_pretrained_refuses_a_tampered_directory_before_building(tmp_path):
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["smf_memories"]["memory_kwargs"]["topk"] = -1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: config\.smf_memories\.memory_kwargs\.topk must be a positive"):
        from_pretrained(tmp_path)


@settings(max_examples=25, deadline=None)
@given(layers=st.lists(st.integers(-2, 9), max_size=3), mode=st.sampled_from([*MEMORY_MODES, "additive_s", ""]),
       n_keys=st.sampled_from([0, 4, 16, 2.0]), topk=st.sampled_from([-1, 1, 4, 17]),
       key_dim=st.sampled_from([0, 7, 8, 32]), value_dim=st.sampled_from([None, 0, 24]))
def test_any_spec_is_refused_by_name_or_builds_a_model_with_finite_logits(layers, mode, n_keys, topk, key_dim,
                                                                          value_dim):
    spec = {"layers": layers, "mode": mode, "layers_path": "model.layers", "mlp_attr": "mlp",
            "memory_kwargs": {"n_keys": n_keys, "heads": 2, "topk": topk, "key_dim": key_dim, "value_dim": value_dim}}
    model_class = memory_model_class(register_memory_type("qwen2"))
    try:
        model = model_class(_config(model_class.config_class, spec))
    except ValueError as err:
        assert str(err).startswith("config.smf_memories"), err
        return
    assert [b.layer_index for b in memory_blocks(model)] == sorted(layers)
    assert torch.isfinite(model(torch.randint(0, 256, (1, 5))).logits).all()


def test_saved_metadata_names_the_memory_class_and_maps_the_other_heads(tmp_path):
    model = tiny_model()
    attach_memories(model, (2, 5), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLMWithSmfMemories"]
    assert set(config["auto_map"]) == {"AutoConfig", *AUTO_CLASSES}
    assert config["auto_map"]["AutoModel"] == "modeling_smf_memories.Qwen2ModelWithSmfMemories"


@pytest.mark.parametrize("plain", [False, True])
def test_every_mapped_head_loads_its_memories_with_smf_and_with_the_saved_code(tmp_path, monkeypatch, plain):
    """With smf imported, transformers takes smf's registered classes even for trust_remote_code=True; the saved
    code's own classes are loaded from its file here (``SMF_SAVED_CODE_PLAIN=1``: its plain memories)."""
    model = tiny_model()
    attach_memories(model, (2, 5), "replacement", backend="torch", **TINY_MEMORY_KWARGS)
    with torch.no_grad():
        model.model.layers[2].mlp.memory.values.normal_()
    model.save_pretrained(tmp_path / "saved")
    auto_map = json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"]
    if plain:
        monkeypatch.setenv(remote_code.PLAIN_ENV, "1")
        module = _saved_module(tmp_path)
    ids = torch.randint(0, 256, (2, 7))
    want = model.model(ids).last_hidden_state
    for auto_name in AUTO_CLASSES:
        load = (getattr(module, auto_map[auto_name].split(".")[1]).from_pretrained if plain else
                lambda *args, **kwargs: getattr(tf, auto_name).from_pretrained(*args, trust_remote_code=True, **kwargs))
        if auto_name == "AutoModelForQuestionAnswering":  # transformers' Qwen-2 head keeps its decoder under
            # 'transformer', the causal LM's checkpoint under 'model': no weight of it loads, memories included
            with pytest.raises(ValueError, match=r"lacks the memory tensors transformer\.layers\.2\.mlp\.memory\."
                                                 r".* \(and \d+ other weights"):
                load(tmp_path / "saved", num_labels=2)
            continue
        loaded = load(tmp_path / "saved", num_labels=2)
        memories = [m for m in loaded.modules() if type(m).__name__.endswith("ProductKeyMemory")]
        assert len(memories) == 2, auto_name
        assert all(isinstance(m, ProductKeyMemory) != plain for m in memories), auto_name
        if auto_name == "AutoModel":
            for memory in memories:
                memory.backend = "torch"
            assert torch.allclose(loaded(ids).last_hidden_state, want, atol=1e-5), auto_name


def test_a_trust_remote_code_model_trains_with_the_controller_where_smf_is_importable(tmp_path):
    """Issue 35: a process that loads with trust_remote_code=True gets smf_kernels' memories, which the
    controller (and so SparseMemoryTrainer) finds."""
    model = tiny_model()
    attach_memories(model, (2, 5), "additive+s", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    assert [b.layer_index for b in memory_blocks(loaded)] == [2, 5]
    controller = SparseMemoryController(loaded, rule="tfidf", rows_per_step=4)
    assert len(controller.memories) == 2


@pytest.mark.parametrize("targets", [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                     "all-linear"])
def test_peft_with_the_usual_targets_leaves_the_plain_memories_alone(tmp_path, monkeypatch, targets):
    peft = pytest.importorskip("peft")
    monkeypatch.setenv(remote_code.PLAIN_ENV, "1")
    model = tiny_model()
    attach_memories(model, (2,), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path / "saved")
    loaded = _saved_module(tmp_path).Qwen2ForCausalLMWithSmfMemories.from_pretrained(tmp_path / "saved")
    projections = [module for name, module in loaded.named_modules() if name.endswith(("_map", ".memory"))]
    assert projections and not [m for m in projections if "Linear" in type(m).__name__]  # no type a tool takes as one
    wrapped = [name for name, module in peft.get_peft_model(loaded, peft.LoraConfig(r=2, target_modules=targets))
               .named_modules() if hasattr(module, "lora_A")]
    assert len(wrapped) == 8 * 7 and "base_model.model.model.layers.2.mlp.gate_proj" in wrapped
    assert not [name for name in wrapped if ".memory." in name]


def test_the_plain_top_k_ranks_as_a_full_stable_sort():
    """NaN above +inf above finite above -inf, ties to the lower column, on rows full of ties."""
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        columns = int(torch.randint(1, 40, (1,), generator=generator))
        k = int(torch.randint(1, columns + 1, (1,), generator=generator))
        scores = torch.randint(-3, 4, (4, 3, columns), generator=generator).float()
        draw = torch.rand(scores.shape, generator=generator)
        scores[draw < 0.1] = float("nan")
        scores[(draw >= 0.1) & (draw < 0.2)] = float("inf")
        scores[(draw >= 0.2) & (draw < 0.3)] = -float("inf")
        if case % 2:
            scores += torch.randn(scores.shape, generator=generator) * (draw > 0.6)
        values, got = remote_code._ranked_topk(scores, k)
        want_values, want = torch.sort(scores, dim=-1, descending=True, stable=True)
        assert torch.equal(got, want[..., :k]), case
        assert torch.equal(values.nan_to_num(7.0), want_values[..., :k].nan_to_num(7.0)), case


def test_smf_model_has_no_import_cycle():
    """Issue 35: attach and hf_auto imported each other (hf_auto inside a function)."""
    package = REPO / "smf" / "model"
    modules = {f"smf.model.{p.stem}": p for p in package.glob("*.py") if p.stem != "__init__"}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                targets.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.module == "smf.model":
                targets |= {f"smf.model.{a.name}" for a in node.names} & set(modules)
        graph[name] = targets - {name}

    def reaches(start, goal, seen=()):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, (*seen, nxt))) for nxt in graph[start])

    assert "smf.model.hf_auto" in graph["smf.model.attach"]
    assert [name for name in graph if reaches(name, name)] == []
