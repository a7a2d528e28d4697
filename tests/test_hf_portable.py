"""A model saved with memories loads with equal logits, in its dtype, wherever transformers loads models:
``trust_remote_code=True`` in a process without smf (the code saved beside the weights), and a plain
``AutoModelForCausalLM`` load with ``import smf.model`` for any architecture (types registered on first use)."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

import smf.model.remote_code as remote_code
from smf.model import attach_memories, from_pretrained, memory_blocks
from smf.model.hf_auto import REMOTE_CODE_FILE, saved_code
from smf.tiny import TINY_MEMORY_KWARGS, tiny_model
from test_hf_save_load import _trained_looking

REPO = Path(__file__).resolve().parents[1]
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# Architectures attach_memories takes that smf registers no type for at import (issue 28: these failed in a
# fresh process until register_memory_type was called), and two whose checkpoints transformers converts.
CONFIGS = {
    "phi3": lambda: tf.Phi3Config(**SIZES, pad_token_id=0),
    "falcon": lambda: tf.FalconConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4),
    "stablelm": lambda: tf.StableLmConfig(**SIZES),
    "granite": lambda: tf.GraniteConfig(**SIZES),
    "olmo": lambda: tf.OlmoConfig(**SIZES, pad_token_id=0),
    "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, max_position_embeddings=64),
}

# Runs in a fresh interpreter that cannot import smf: loads each directory with trust_remote_code=True
# and prints, per directory, whether the logits equal the saved ones bit for bit, and the dtypes.
WITHOUT_SMF = r"""
import importlib.abc, json, sys

class NoSmf(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("smf", "smf_kernels"):
            raise ImportError(f"{name} is blocked: this process checks loading without smf")

sys.meta_path.insert(0, NoSmf())
import torch
from transformers import AutoModelForCausalLM

results = {}
for directory in sys.argv[1:]:
    ref = torch.load(directory + "/ref.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
    logits = model(ref["ids"]).logits
    dtypes = {name: str(p.dtype) for name, p in model.named_parameters()}
    results[directory] = {"equal": torch.equal(logits, ref["logits"]), "class": type(model).__name__,
                          "max_diff": (logits - ref["logits"]).abs().max().item(),
                          "memory_dtypes": sorted({d for n, d in dtypes.items() if ".memory." in n or "alpha" in n}),
                          "embedding_dtype": str(model.get_input_embeddings().weight.dtype)}
assert not [name for name in sys.modules if name.split(".")[0] in ("smf", "smf_kernels")]
print("RESULTS", json.dumps(results))
"""

# Runs in a fresh interpreter that imports smf.model and nothing else of smf: a plain Auto load per directory.
WITH_SMF = r"""
import json, sys
import torch
import smf.model
from transformers import AutoModelForCausalLM

results = {}
for directory in sys.argv[1:]:
    ref = torch.load(directory + "/ref.pt", weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    for block in smf.model.memory_blocks(model):
        block.memory.backend = "torch"
    results[directory] = {"equal": torch.equal(model(ref["ids"]).logits, ref["logits"]),
                          "layers": [b.layer_index for b in smf.model.memory_blocks(model)]}
print("RESULTS", json.dumps(results))
"""


def _save(model, directory: Path, vocab: int) -> Path:
    """save_pretrained ``model`` (memories on the torch backend, the remote code's arithmetic) and its logits."""
    _trained_looking(model)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(directory)
    torch.save({"ids": ids, "logits": logits}, directory / "ref.pt")
    return directory


def _bf16_model(tmp_path: Path):
    """A tiny Qwen-2 with trained-looking additive+s memories, loaded in bf16 (``model.to(bfloat16)`` would also
    round the rotary ``inv_freq`` buffer, which no load reproduces)."""
    model = tiny_model()
    attach_memories(model, (2, 5), "additive+s", backend="torch", **TINY_MEMORY_KWARGS)
    _trained_looking(model)
    model.save_pretrained(tmp_path / "fp32")
    return from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16, backend="torch")


def _run(script: str, directories, tmp_path: Path, with_smf: bool) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if with_smf:
        env["PYTHONPATH"] = str(REPO)
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")  # the copies of the saved code land here
    result = subprocess.run([sys.executable, "-c", script, *map(str, directories)], capture_output=True, text=True,
                            timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def _imports(tree) -> set[str]:
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    return imported | {node.module.split(".")[0] for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and node.level == 0}


def test_the_saved_code_needs_only_torch_and_transformers_and_tries_smf():
    """The saved file imports the standard library, torch and transformers; smf only inside a try that falls
    back on ImportError (smf's memories where it is importable and names their projections as the file does)."""
    tree = ast.parse(saved_code("qwen2"))
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(isinstance(h.type, ast.Name) and h.type.id == "ImportError"
                                             for h in node.handlers):
            guarded |= _imports(ast.Module(body=node.body, type_ignores=[]))
    assert guarded == {"smf", "smf_kernels", "transformers"}  # transformers.conversion_mapping: 5.x only
    unguarded = _imports(tree) - guarded
    assert unguarded <= {"__future__", "os", "warnings", "torch", "transformers"}, unguarded
    assert "memory_spec" not in {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}


@pytest.mark.parametrize("mode", ["additive+s", "replacement"])
def test_the_plain_memory_layer_equals_product_key_memory_on_the_torch_backend(mode):
    model = tiny_model()
    attach_memories(model, (1,), mode, backend="torch", **TINY_MEMORY_KWARGS)
    _trained_looking(model)
    smf_memory = memory_blocks(model)[0].memory
    plain = remote_code.PlainProductKeyMemory(**smf_memory.config())
    plain.load_state_dict(smf_memory.state_dict())
    x = torch.randn(3, 11, 64)
    assert torch.equal(plain(x), smf_memory(x))


@pytest.mark.slow  # a fresh interpreter
def test_without_smf_trust_remote_code_loads_equal_logits_in_the_saved_dtype(tmp_path):
    directories = []
    for mode in ("additive", "replacement"):
        model = tiny_model()
        attach_memories(model, (2, 5), mode, backend="torch", **TINY_MEMORY_KWARGS)
        directories.append(_save(model, tmp_path / mode, 256))
    directories.append(_save(_bf16_model(tmp_path), tmp_path / "bf16", 256))
    for arch in ("gpt_neox", "falcon"):  # a checkpoint key conversion; a layout of smf.model.LAYOUTS
        model = tf.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
        attach_memories(model, (1,), "additive", backend="torch", **TINY_MEMORY_KWARGS)
        directories.append(_save(model, tmp_path / arch, 300))
    assert (tmp_path / "bf16" / REMOTE_CODE_FILE).is_file()
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == \
        "modeling_smf_memories.Qwen2ForCausalLMWithSmfMemories"
    results = _run(WITHOUT_SMF, directories, tmp_path, with_smf=False)
    for directory in directories:
        got = results[str(directory)]
        assert got["equal"] and got["class"].endswith("WithSmfMemories"), (directory.name, got)
        assert got["memory_dtypes"] == ["torch.float32"], (directory.name, got)
    assert results[str(tmp_path / "bf16")]["embedding_dtype"] == "torch.bfloat16"  # dtype "auto": the checkpoint's
    assert results[str(tmp_path / "additive")]["embedding_dtype"] == "torch.float32"


@pytest.mark.slow  # a fresh interpreter
def test_with_smf_imported_every_architecture_loads_without_registering_by_hand(tmp_path):
    directories = []
    for arch, config in CONFIGS.items():
        model = tf.AutoModelForCausalLM.from_config(config()).eval()
        attach_memories(model, (0, 2), "additive", backend="torch", **TINY_MEMORY_KWARGS)
        directories.append(_save(model, tmp_path / arch, 300))
    results = _run(WITH_SMF, directories, tmp_path, with_smf=True)
    assert {Path(d).name: r for d, r in results.items()} == {
        arch: {"equal": True, "layers": [0, 2]} for arch in CONFIGS}


def test_import_registers_no_type_eagerly():
    script = ("import smf.model, sys\n"
              "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
              "print(sorted(k for k in dict.keys(CONFIG_MAPPING._extra_content) if k.endswith('_smf_memories')))\n"
              "print('torch._dynamo' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "False"], result.stdout


def test_bf16_round_trip_is_exact_and_loads_in_the_checkpoints_dtype(tmp_path):
    model = _bf16_model(tmp_path)
    assert all(b.alpha.dtype == torch.float32 for b in memory_blocks(model))
    ids = torch.randint(0, 256, (2, 9))
    ref = model(ids).logits
    model.save_pretrained(tmp_path / "bf16")
    loaded = from_pretrained(tmp_path / "bf16", backend="torch")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(b.alpha.dtype == torch.float32 and b.memory.values.dtype == torch.float32 for b in memory_blocks(loaded))
    assert torch.equal(loaded(ids).logits, ref)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    for block in memory_blocks(plain):
        block.memory.backend = "torch"
    assert memory_blocks(plain)[0].alpha.dtype == torch.float32 and torch.equal(plain(ids).logits, ref)


def test_plain_base_class_load_keeps_every_base_weight(tmp_path):
    """Additive blocks keep the MLP's own weight names: a plain Qwen2ForCausalLM load of the directory
    is the base model (memories ignored as unexpected keys), nothing re-initialised."""
    model = tiny_model()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    attach_memories(model, (2, 5), "additive", **TINY_MEMORY_KWARGS)
    model.save_pretrained(tmp_path)
    plain = tf.Qwen2ForCausalLM.from_pretrained(tmp_path)
    assert not memory_blocks(plain)
    state = plain.state_dict()
    assert state.keys() == base_state.keys() and all(torch.equal(state[k], v) for k, v in base_state.items())


def test_a_directory_of_the_older_layout_loads(tmp_path):
    """Saved 2026-11-22 to 11-24, the original MLP of an additive block under ``...mlp.mlp.*``."""
    model = tiny_model()
    attach_memories(model, (2,), "additive", backend="torch", **TINY_MEMORY_KWARGS)
    _trained_looking(model)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    renamed = {k.replace("layers.2.mlp.", "layers.2.mlp.mlp.") if ".mlp.memory." not in k and "alpha" not in k else k: v
               for k, v in weights.items()}
    assert "model.layers.2.mlp.mlp.up_proj.weight" in renamed
    save_file(renamed, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 6))
    loaded = from_pretrained(tmp_path, backend="torch")
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    loaded.save_pretrained(tmp_path / "again")  # saved again: the current layout, not the one it was read from
    assert load_file(tmp_path / "again" / "model.safetensors").keys() == weights.keys()
