"""The three evaluations of docs/method.md#evaluation: MedMCQA accuracy, WikiText perplexity, TriviaQA
accuracy; :mod:`smf.eval.tasks` runs them on one model with :class:`EvalSettings`, :mod:`smf.commands.eval`
is ``smf eval``. Names are imported from their modules on first use (:mod:`smf._lazy`)."""
from smf._lazy import lazy_exports

_EXPORTS = {"evaluate_medmcqa": "medmcqa", "EvalSettings": "settings", "evaluate_model": "tasks",
            "load_eval_sets": "tasks", "evaluate_triviaqa": "triviaqa", "normalize_answer": "triviaqa",
            "evaluate_wikitext": "wikitext", "sliding_windows": "wikitext"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
