"""The three evaluations of docs/method.md#evaluation: MedMCQA accuracy, WikiText perplexity, TriviaQA
accuracy; :mod:`smf.eval.tasks` runs them on one model with :class:`EvalSettings`, :mod:`smf.eval.command`
is ``smf eval``."""
from smf.eval.medmcqa import evaluate_medmcqa
from smf.eval.settings import EvalSettings
from smf.eval.tasks import evaluate_model, load_eval_sets
from smf.eval.triviaqa import evaluate_triviaqa, normalize_answer
from smf.eval.wikitext import evaluate_wikitext, sliding_windows

__all__ = ["EvalSettings", "evaluate_medmcqa", "evaluate_model", "evaluate_triviaqa", "evaluate_wikitext",
           "load_eval_sets", "normalize_answer", "sliding_windows"]
