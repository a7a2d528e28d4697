"""Fixtures -> tokens -> tiny model with memories: a few retrofit steps train only the memories."""
from pathlib import Path

import torch

from smf.data import CausalLMCollator, assistant_pairs, load_oasst1, retrofit_and_background, tokenize_examples
from smf.data import oasst
from smf.model import attach_memories, configure_trainable, memory_blocks
from smf.tiny import TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, tiny_model, tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"


def test_retrofit_steps_on_fixtures_lower_the_loss_and_touch_only_memories():
    tokenizer, model = tiny_tokenizer(), tiny_model()
    attach_memories(model, TINY_MEMORY_LAYERS, "additive", **TINY_MEMORY_KWARGS)
    configure_trainable(model, "retrofit")
    pairs = assistant_pairs(load_oasst1(path=FIXTURES / "oasst1_train.jsonl"))
    retrofit, _ = retrofit_and_background(pairs, n_retrofit=8, n_background=2, seed=0)
    features = tokenize_examples(tokenizer, [oasst.format_example(p, tokenizer) for p in retrofit], max_length=128)
    batch = CausalLMCollator(tokenizer.pad_token_id)(features)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(4):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(not torch.equal(p, trained[n]) for n, p in model.named_parameters() if n in trained)
    assert {n for n in trained} >= {f"model.layers.{b.layer_index}.mlp.alpha" for b in memory_blocks(model)}
