"""Data for the SMF experiments: loaders (hub ids by default, local paths for fixtures), prompt
formatting, and tokenisation for causal-LM training (docs/method.md#two-stage-training, #evaluation,
#public-datasets-and-the-fixtures). Names are imported from their modules on first use (:mod:`smf._lazy`)."""
from smf._lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(("IGNORE_INDEX", "CausalLMCollator", "tokenize_example", "tokenize_examples", "tokenize_text"),
                    "causal_lm"),
    **dict.fromkeys(("load_triviaqa", "load_wikitext", "triviaqa_prompt"), "eval_sets"),
    **dict.fromkeys(("load_medmcqa", "load_training_rows"), "medmcqa"),
    **dict.fromkeys(("assistant_pairs", "authors_retrofit_and_background", "load_oasst1", "response_texts",
                     "retrofit_and_background"), "oasst"),
    **dict.fromkeys(("DEFAULT_PROTOCOL", "PROTOCOLS", "Protocol", "get_protocol"), "protocol"),
    **dict.fromkeys(("load_split", "shuffled", "subset"), "sources"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
