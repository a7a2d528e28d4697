"""The three evaluations of SPEC §6: MedMCQA accuracy, WikiText perplexity, TriviaQA accuracy."""
from smf.eval.medmcqa import evaluate_medmcqa
from smf.eval.triviaqa import evaluate_triviaqa, normalize_answer
from smf.eval.wikitext import evaluate_wikitext, sliding_windows

__all__ = ["evaluate_medmcqa", "evaluate_triviaqa", "evaluate_wikitext", "normalize_answer", "sliding_windows"]
