"""The world tokenizer: a Qwen-2 style byte-level BPE whose merges make every word of the synthetic world one token.

Its BPE is trained (the ``tokenizers`` library) on a corpus built from :func:`smf.data.world.world_words` alone, so it
does not depend on a world's seed or sizes (a ``new_kind`` world's has the new kinds' words as well, and every other
world's is the one tokenizer of the default): each word appears at the start of a text and after a space, and the
templates appear filled and joined by blank lines, so every word (with and without its leading space) ends up a single token. The name parts are
tokens of their own, so a new person's name is a new sequence of tokens that pretraining trained (docs/science.md).

It is a ``Qwen2Tokenizer`` (the pre-tokenizer, normaliser and decoder of Qwen-2.5's) with the tiny preset's special
tokens (``<|endoftext|>`` pads, ``<|im_end|>`` is eos; :mod:`smf.tiny`), so a model directory saved with it loads
through ``AutoTokenizer`` as a hub Qwen-2 model does (transformers rebuilds a qwen2 model's tokenizer from its vocab
and merges, whatever class the directory names).
"""
from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from smf.data.world import ATTRIBUTES, NEW_KINDS, WorldOptions, generic_texts, world_words
from smf.tiny import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS

__all__ = ["world_tokenizer", "world_tokenizer_corpus"]


def world_tokenizer_corpus(new_kind: bool = False) -> list[str]:
    """The texts the BPE is trained on: every word alone and after a space, every template with every value (with
    ``new_kind``, those of :data:`smf.data.world.NEW_KINDS` too, and their generic sentences)."""
    texts = [f"{word} {word}" for word in world_words(new_kind) if word != "\n"]
    for values, bios, questions in (*ATTRIBUTES.values(), *(NEW_KINDS.values() if new_kind else ())):
        for value in values:
            texts += [template.format(name="Abel Aldmoor", value=value) for template in bios]
        texts += [f"Question: {question.format(name='Abel Aldmoor')}\nAnswer: {value}"
                  for question in questions for value in values]
    texts += generic_texts() if new_kind else []
    return texts + ["\n\n".join(texts)]  # texts joined by blank lines, as pretraining and perplexity join them


def world_tokenizer(options: WorldOptions | None = None):
    """The world tokenizer (see the module docstring) of a world of ``options`` (None: the default world's): a
    ``Qwen2Tokenizer``, right padding."""
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=100_000, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(world_tokenizer_corpus(bool(options and options.new_kind)), trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, unk_token=None, eos_token=EOS_TOKEN,
                               pad_token=PAD_TOKEN, padding_side="right", model_max_length=1024)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
