"""smf.model.memory_diagnostics: alpha, the branch's share, the change of the predictions with a branch switched
off, read entropy over the slots (checked against reads recomputed from the memories' inputs); the inert warning
(library, and `smf retrofit`'s memory_diagnostics.json)."""
import json
import logging
import math

import pytest
import torch

from smf import cli
from smf.model import attach_memories, memory_blocks
from smf.model.diagnostics import INERT_KL, memory_diagnostics
from smf.tiny import tiny_model
from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS


def _batches():
    generator = torch.Generator().manual_seed(5)
    first = {"input_ids": torch.randint(3, 250, (2, 13), generator=generator),
             "attention_mask": torch.ones(2, 13, dtype=torch.long)}
    first["attention_mask"][1, 9:] = 0
    return [first, {"input_ids": torch.randint(3, 250, (1, 7), generator=generator)}]


def _model(mode: str, alpha: float | None = None):
    torch.manual_seed(1)
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, mode, **TINY_MEMORY_KWARGS)
    if alpha is not None:
        for block in memory_blocks(model):
            block.alpha.data.fill_(alpha)
    return model


def _reads(model, batches):
    """layer -> (M,) reads recomputed with each memory's lookup on its inputs at the real positions."""
    inputs = {}
    hooks = [b.memory.register_forward_hook(lambda m, args, out, i=b.layer_index: inputs.setdefault(i, []).append(
        args[0].detach())) for b in memory_blocks(model)]
    masks = []
    with torch.no_grad():
        for batch in batches:
            mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
            masks.append(mask.bool())
            model(input_ids=batch["input_ids"], attention_mask=mask)
    for hook in hooks:
        hook.remove()
    reads = {}
    for block in memory_blocks(model):
        slots = [block.memory.lookup(x.reshape(-1, x.shape[-1]))[1].view(*mask.shape, -1)[mask].reshape(-1)
                 for x, mask in zip(inputs[block.layer_index], masks)]
        reads[block.layer_index] = torch.bincount(torch.cat(slots), minlength=block.memory.num_slots)
    return reads


def test_diagnostics_of_a_strong_additive_memory():
    model = _model("additive", alpha=3.0)
    model.train()
    block = memory_blocks(model)[0]
    block.memory.set_read_counting(True)
    block.memory.read_counts.fill_(7)
    result = memory_diagnostics(model, _batches())
    assert model.training and block.memory.count_reads and bool((block.memory.read_counts == 7).all())  # restored
    assert result.tokens == 2 * 13 - 4 + 7
    expected = _reads(model, _batches())
    for layer in result.layers:
        counts = expected[layer.layer]
        p = counts[counts > 0].double() / counts.sum()
        assert layer.read_entropy == pytest.approx(float(-(p * p.log()).sum()), rel=1e-9)
        assert layer.read_entropy_fraction == pytest.approx(layer.read_entropy / math.log(256), rel=1e-9)
        assert layer.slots_read == pytest.approx(float((counts > 0).double().mean()))
        assert layer.alpha == pytest.approx(3.0) and 0 < layer.branch_share < 10
        assert layer.kl_off > INERT_KL and 0 <= layer.top1_agreement <= 1 and not layer.inert
    assert result.kl_all_off > 0 and result.inert_layers == []


def test_a_zero_alpha_branch_is_inert_and_warned(caplog):
    model = _model("additive", alpha=0.0)
    with caplog.at_level(logging.WARNING, logger="smf.model.diagnostics"):
        result = memory_diagnostics(model, _batches())
    assert result.inert_layers == list(TINY_MEMORY_LAYERS)
    assert all(layer.kl_off == pytest.approx(0, abs=1e-9) and layer.top1_agreement == 1.0 and
               layer.branch_share == 0.0 for layer in result.layers)
    assert sum("is inert" in record.message for record in caplog.records) == len(TINY_MEMORY_LAYERS)


def test_a_replacement_branch_is_the_whole_block_output():
    result = memory_diagnostics(_model("replacement"), _batches(), warn=False)
    assert all(layer.alpha is None and layer.branch_share == pytest.approx(1.0, rel=1e-6) for layer in result.layers)


def test_smf_retrofit_writes_memory_diagnostics(tmp_path, caplog):
    run_dir = tmp_path / "retrofit"
    with caplog.at_level(logging.INFO, logger="smf"):
        assert cli.main(["retrofit", "--preset", "tiny", "--output-dir", str(run_dir), "--epochs", "1"]) == 0
    written = json.loads((run_dir / "memory_diagnostics.json").read_text())
    assert [layer["layer"] for layer in written["layers"]] == list(TINY_MEMORY_LAYERS)
    assert written["tokens"] > 0 and "inert" in written["layers"][0]
    # the tiny preset's inert memories are expected: said at info level, not warned (warned on a real model)
    inert = [layer["layer"] for layer in written["layers"] if layer["inert"]]
    notes = [record for record in caplog.records if "inert" in record.getMessage()]
    assert [record.levelno for record in notes] == ([logging.INFO] if inert else [])
    assert "memory diagnostics: each memory switched off in turn" in caplog.text
