"""Tokenisation with prompt masking, truncation, and the padding collator (with the tiny model)."""
import pytest
import torch

from smf.data import IGNORE_INDEX, CausalLMCollator, tokenize_example, tokenize_examples
from smf.tiny import tiny_model, tiny_tokenizer


def test_prompt_is_masked_and_target_plus_eos_trained():
    tokenizer = tiny_tokenizer()
    example = tokenize_example(tokenizer, "Question: 2+2?\nAnswer:", " A. 4")
    prompt_len = len("Question: 2+2?\nAnswer:".encode())
    assert example["input_ids"] == list("Question: 2+2?\nAnswer: A. 4".encode()) + [tokenizer.eos_token_id]
    assert example["labels"] == [IGNORE_INDEX] * prompt_len + list(" A. 4".encode()) + [tokenizer.eos_token_id]


def test_truncation_and_dropping_untrainable_examples():
    tokenizer = tiny_tokenizer()
    example = tokenize_example(tokenizer, "abcdef", "ghij", max_length=8)
    assert example["input_ids"] == list(b"abcdefgh") and example["labels"] == [IGNORE_INDEX] * 6 + list(b"gh")
    kept = tokenize_examples(tokenizer, [{"prompt": "p" * 10, "target": "t"}, {"prompt": "p", "target": "t"}],
                             max_length=10)
    assert len(kept) == 1 and kept[0]["input_ids"] == [ord("p"), ord("t"), tokenizer.eos_token_id]
    with pytest.raises(ValueError, match="max_length"):
        tokenize_example(tokenizer, "a", "b", max_length=0)


@pytest.mark.parametrize("side", ["right", "left"])
def test_collator_pads_and_masks(side):
    features = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [9], "labels": [9]}]
    batch = CausalLMCollator(pad_token_id=256, padding_side=side)(features)
    if side == "right":
        assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 256, 256]]
        assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
        assert batch["labels"].tolist() == [[-100, 6, 7], [9, -100, -100]]
    else:
        assert batch["input_ids"].tolist() == [[5, 6, 7], [256, 256, 9]]
        assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, 9]]
    assert all(t.dtype == torch.long for t in batch.values())
    with pytest.raises(ValueError, match="padding_side"):
        CausalLMCollator(pad_token_id=0, padding_side="middle")


def test_padded_batch_loss_matches_unpadded_examples():
    tokenizer, model = tiny_tokenizer(), tiny_model()
    examples = [{"prompt": "Question: ok?\nAnswer:", "target": " B. yes"},
                {"prompt": "Hi", "target": "a much longer target than the other one"}]
    features = tokenize_examples(tokenizer, examples)
    batch = CausalLMCollator(tokenizer.pad_token_id)(features)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    batch_nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                                  reduction="sum")
    single_nll = torch.zeros(())
    for feature in features:
        ids, labels = torch.tensor([feature["input_ids"]]), torch.tensor([feature["labels"]])
        single_logits = model(ids).logits
        single_nll += torch.nn.functional.cross_entropy(single_logits[0, :-1], labels[0, 1:], reduction="sum")
    assert abs(batch_nll.item() - single_nll.item()) / single_nll.item() < 1e-5
