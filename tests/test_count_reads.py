"""count_reads "loss": memory reads counted only at the positions whose next-token label the loss scores, checked
against the reads recomputed from each memory's inputs; and the option through `smf train`."""
import json

import pytest
import torch

from smf import cli
from smf.data.causal_lm import IGNORE_INDEX
from smf.model import attach_memories, loss_positions, memory_blocks, reads_counted_at_loss
from smf.tiny import tiny_model
from smf.vocabulary import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS


def test_loss_positions_shift_the_scored_labels_onto_the_inputs():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6, IGNORE_INDEX], [1, 2, 3, 4, 5]])
    assert loss_positions(labels).tolist() == [[False, True, True, False, False], [True, True, True, True, False]]


def _counted_reads(model, batch, positions):
    """(M,) reads per memory expected from the memories' inputs: lookup of the hidden states at ``positions``."""
    inputs = {}
    hooks = [block.memory.register_forward_hook(
        lambda module, args, out, index=block.layer_index: inputs.__setitem__(index, args[0].detach()))
        for block in memory_blocks(model)]
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for hook in hooks:
        hook.remove()
    expected = {}
    for block in memory_blocks(model):
        _, slots = block.memory.lookup(inputs[block.layer_index].reshape(-1, inputs[block.layer_index].shape[-1]))
        chosen = slots.view(*positions.shape, -1)[positions].reshape(-1)
        expected[block.layer_index] = torch.bincount(chosen, minlength=block.memory.num_slots)
    return expected


def test_reads_are_counted_only_where_the_loss_scores():
    torch.manual_seed(3)
    model = tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, **TINY_MEMORY_KWARGS)
    input_ids = torch.randint(3, 200, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0  # right padding
    labels = input_ids.clone()
    labels[:, :4] = IGNORE_INDEX  # a prompt
    labels[attention_mask == 0] = IGNORE_INDEX
    labels[2, 6] = IGNORE_INDEX  # a hole inside the answer
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    positions = loss_positions(labels)
    expected = _counted_reads(model, batch, positions)
    everywhere = _counted_reads(model, batch, attention_mask.bool())
    other = {"input_ids": input_ids.clone(), "attention_mask": attention_mask}  # the same tokens, another tensor
    for block in memory_blocks(model):
        block.memory.set_read_counting(True)
    with torch.no_grad(), reads_counted_at_loss(model, [batch]):
        model(input_ids=batch["input_ids"], attention_mask=attention_mask)
        counted = {block.layer_index: block.memory.read_counts.clone() for block in memory_blocks(model)}
        for block in memory_blocks(model):
            block.memory.reset_read_counts()
        model(input_ids=other["input_ids"], attention_mask=attention_mask)  # not a step's batch: counted as usual
    for block in memory_blocks(model):
        index = block.layer_index
        assert torch.equal(counted[index], expected[index])
        assert int(counted[index].sum()) == int(positions.sum()) * block.memory.heads * block.memory.topk
        assert torch.equal(block.memory.read_counts, everywhere[index])
        assert block.read_mask is None  # cleared after the context


def test_smf_train_takes_count_reads(tmp_path, capsys):
    retrofit, background, sparse = (tmp_path / name for name in ("retrofit", "background", "sparse"))
    assert cli.main(["retrofit", "--preset", "tiny", "--output-dir", str(retrofit), "--epochs", "1"]) == 0
    assert cli.main(["background", "--preset", "tiny", "--adapter", str(retrofit), "--output-dir",
                     str(background)]) == 0
    assert cli.main(["train", "--preset", "tiny", "--adapter", str(retrofit), "--background", str(background),
                     "--output-dir", str(sparse), "--count-reads", "loss", "--max-steps", "1"]) == 0
    assert json.loads((sparse / "run_config.json").read_text())["count_reads"] == "loss"
    capsys.readouterr()
    code = cli.main(["train", "--preset", "tiny", "--recipe", "lora", "--output-dir", str(tmp_path / "lora"),
                     "--count-reads", "loss"])
    assert code == 2 and "--count-reads is not used" in capsys.readouterr().err
