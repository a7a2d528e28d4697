"""The nine conditions of the paper, their display names, and the paper's Table 1 (docs/method.md#paper-results)."""
from __future__ import annotations

from smf.vocabulary import DEFAULT_MODEL

PAPER_MODEL_ID = DEFAULT_MODEL  # the name smf.report has always exported

# Metric keys of a result record, and whether higher is better: the paper's, or those of own data
# (docs/own-data.md; in the same order: learning accuracy, held-out perplexity, retained accuracy).
METRICS = ("medmcqa_acc", "wikitext_ppl", "triviaqa_acc")
OWN_METRICS = ("learn_acc", "heldout_ppl", "retain_acc")
HIGHER_IS_BETTER = {"medmcqa_acc": True, "wikitext_ppl": False, "triviaqa_acc": True,
                    "learn_acc": True, "heldout_ppl": False, "retain_acc": True, "retain_heldout_acc": True}
METRIC_TITLES = {"medmcqa_acc": "MedMCQA acc", "wikitext_ppl": "WikiText PPL", "triviaqa_acc": "TriviaQA acc",
                 **{key: key for key in (*OWN_METRICS, "retain_heldout_acc")}}  # own-data columns: titled by their key
# unless labelled; retain_heldout_acc: an optional own-data metric (docs/own-data.md), not a Table 1 column


def metric_keys(records) -> tuple[str, ...]:
    """The metric keys of result records (dicts holding them): :data:`OWN_METRICS` when any record holds one,
    else the paper's :data:`METRICS`."""
    own = any(key in record for record in records for key in OWN_METRICS)
    return OWN_METRICS if own else METRICS


def metric_title(metric: str, labels: dict[str, str] | None = None) -> str:
    """The column title of ``metric``: its label when given (a suite config's ``labels``), else the default."""
    return (labels or {}).get(metric) or METRIC_TITLES[metric]

# Condition name (smf.vocabulary.CONDITIONS) -> display name, in the paper's table order.
DISPLAY_NAMES = {
    "base": "Base Qwen",
    "replacement-kl": "Replacement sparse (KL)",
    "replacement-tfidf": "Replacement sparse (TF-IDF)",
    "additive-kl": "Additive sparse (KL)",
    "additive-tfidf": "Additive sparse (TF-IDF)",
    "additive+s-kl": "Additive sparse +S (KL)",
    "additive+s-tfidf": "Additive sparse +S (TF-IDF)",
    "lora": "LoRA",
    "full": "Full finetune",
}


def display_name(condition: str, model: str | None = None, variant: str | None = None) -> str:
    """The row name of ``condition``; the base row names the model actually used ("Base Qwen" for the
    paper's model or when ``model`` is None, else "Base (model)"); a run of a suite's ``variant`` adds it in
    brackets ("Additive sparse (TF-IDF) [s1024-t16-sgd]")."""
    if condition == "base" and model is not None and model != DEFAULT_MODEL:
        return f"Base ({model.rstrip('/').rsplit('/', 1)[-1]})"
    return DISPLAY_NAMES[condition] + ("" if variant is None else f" [{variant}]")

# Method family (colour in the figure) and slot-selection rule (marker; None for non-sparse).
FAMILIES = {"base": "Base", "replacement-kl": "Replacement", "replacement-tfidf": "Replacement",
            "additive-kl": "Additive", "additive-tfidf": "Additive", "additive+s-kl": "Additive +S",
            "additive+s-tfidf": "Additive +S", "lora": "LoRA", "full": "Full finetune"}
SELECTION_RULES = {"replacement-kl": "KL", "replacement-tfidf": "TF-IDF", "additive-kl": "KL",
                   "additive-tfidf": "TF-IDF", "additive+s-kl": "KL", "additive+s-tfidf": "TF-IDF"}

# Paper Table 1: condition -> metric -> (mean, std over seeds). Base WikiText PPL has no spread.
PAPER_TABLE1 = {
    "base": {"medmcqa_acc": (0.344, 0.002), "wikitext_ppl": (13.146, 0.0), "triviaqa_acc": (0.256, 0.001)},
    "replacement-kl": {"medmcqa_acc": (0.354, 0.010), "wikitext_ppl": (16.577, 0.045),
                       "triviaqa_acc": (0.179, 0.017)},
    "replacement-tfidf": {"medmcqa_acc": (0.355, 0.010), "wikitext_ppl": (16.501, 0.106),
                          "triviaqa_acc": (0.207, 0.005)},
    "additive-kl": {"medmcqa_acc": (0.369, 0.006), "wikitext_ppl": (12.723, 0.039), "triviaqa_acc": (0.252, 0.016)},
    "additive-tfidf": {"medmcqa_acc": (0.346, 0.003), "wikitext_ppl": (12.773, 0.025),
                       "triviaqa_acc": (0.255, 0.004)},
    "additive+s-kl": {"medmcqa_acc": (0.378, 0.001), "wikitext_ppl": (13.139, 0.068),
                      "triviaqa_acc": (0.223, 0.018)},
    "additive+s-tfidf": {"medmcqa_acc": (0.369, 0.010), "wikitext_ppl": (13.456, 0.472),
                         "triviaqa_acc": (0.245, 0.013)},
    "lora": {"medmcqa_acc": (0.390, 0.011), "wikitext_ppl": (15.470, 0.072), "triviaqa_acc": (0.193, 0.010)},
    "full": {"medmcqa_acc": (0.398, 0.006), "wikitext_ppl": (18.907, 0.215), "triviaqa_acc": (0.163, 0.003)},
}
