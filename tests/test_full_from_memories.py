"""`smf train --recipe full --adapter RETROFIT`: full finetuning of a checkpoint holding memories (every parameter,
memories included), saved as one model that loads back with its memories."""
import json

import torch
from safetensors.torch import load_file

from smf import cli
from smf.model import load_model, memory_blocks
from smf.model.loading import load_with_adapter


def test_full_finetuning_from_a_retrofit_trains_every_parameter_and_reloads(tmp_path):
    retrofit, full = tmp_path / "retrofit", tmp_path / "full"
    assert cli.main(["retrofit", "--preset", "tiny", "--output-dir", str(retrofit), "--epochs", "1"]) == 0
    assert cli.main(["train", "--preset", "tiny", "--recipe", "full", "--adapter", str(retrofit), "--output-dir",
                     str(full), "--epochs", "1", "--lr", "1e-3"]) == 0
    assert json.loads((full / "run_config.json").read_text())["adapter"] == str(retrofit)
    before, _ = load_with_adapter("tiny", retrofit, "cpu")
    after, tokenizer = load_model(None, full, "cpu")
    assert [b.layer_index for b in memory_blocks(after)] == [b.layer_index for b in memory_blocks(before)]
    changed = {name for name, p in after.named_parameters()
               if not torch.equal(p, dict(before.named_parameters())[name])}
    assert {"model.layers.2.mlp.memory.values", "model.layers.2.mlp.alpha", "model.layers.2.mlp.memory.keys",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.2.mlp.gate_proj.weight"} <= changed
    ids = torch.tensor([tokenizer("Question: where?\nAnswer:")["input_ids"]])
    saved = load_file(str(full / "final" / "model.safetensors"))
    assert torch.equal(saved["model.layers.2.mlp.memory.values"], dict(after.named_parameters())[
        "model.layers.2.mlp.memory.values"])
    with torch.no_grad():
        assert torch.isfinite(after(input_ids=ids).logits).all()
