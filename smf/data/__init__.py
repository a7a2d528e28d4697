"""Data for the SMF experiments: loaders (hub ids by default, local paths for fixtures), prompt
formatting, and tokenisation for causal-LM training (docs/method.md#two-stage-training, #evaluation,
#public-datasets-and-the-fixtures)."""
from smf.data.causal_lm import IGNORE_INDEX, CausalLMCollator, tokenize_example, tokenize_examples, tokenize_text
from smf.data.eval_sets import load_triviaqa, load_wikitext, triviaqa_prompt
from smf.data.medmcqa import load_medmcqa, load_training_rows
from smf.data.oasst import (assistant_pairs, authors_retrofit_and_background, load_oasst1, response_texts,
                            retrofit_and_background)
from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS, Protocol, get_protocol
from smf.data.sources import load_split, shuffled, subset

__all__ = [
    "IGNORE_INDEX",
    "CausalLMCollator",
    "DEFAULT_PROTOCOL",
    "PROTOCOLS",
    "Protocol",
    "assistant_pairs",
    "authors_retrofit_and_background",
    "get_protocol",
    "load_training_rows",
    "response_texts",
    "tokenize_text",
    "load_medmcqa",
    "load_oasst1",
    "load_split",
    "load_triviaqa",
    "load_wikitext",
    "retrofit_and_background",
    "shuffled",
    "subset",
    "tokenize_example",
    "tokenize_examples",
    "triviaqa_prompt",
]
