"""The data and evaluation protocol of an experiment: every choice that differs between the authors'
code and this project's cleaner variant, written down once, here.

Two protocols (``--protocol`` of the training commands, ``protocol:`` of a suite config):

- ``authors`` (default): what the authors' public code (github.com/prakharg55/SMF-ICML, paths
  below are in that repository, lines as of its published HEAD) does, so that Table 1 numbers
  are comparable with the paper's.
- ``clean``: this project's earlier choices (docs/method.md#two-stage-training, #evaluation): loss-masked
  prompts, held-out
  background set, whole WikiText-103 raw test split, greedy decoding without repetition penalty.

The loaders (:mod:`smf.data`), the training data (:mod:`smf.train.data`) and the evaluations
(:mod:`smf.eval`) read the fields of :func:`get_protocol` and implement them; docs/method.md
explains each choice in prose.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROTOCOLS = ("authors", "clean")
DEFAULT_PROTOCOL = "authors"


@dataclass(frozen=True)
class Protocol:
    """One protocol's data and evaluation choices (the authors' file:line after each field)."""

    name: str
    # Training text. True: one plain text per example, loss on every token, no eos appended
    # (smf_rebuild/datasets.py:102-121, collated by DataCollatorForLanguageModeling in
    # train_retrofit.py / train_sparse.py:142). False: chat/prompt + target, prompt loss-masked, eos appended.
    plain_text_training: bool
    # oasst1 text. True: the assistant message alone, lang "en", rank 0 or 1, >= 50 characters
    # (datasets.py:30-42; min_text_chars 50 at datasets.py:18). False: prompter turn in the chat
    # template + reply, every rank, deleted messages dropped (smf.data.oasst.assistant_pairs).
    oasst_response_only: bool
    # MedMCQA training rows and text. True: only choice_type == "single"; the text is the header line,
    # question, options, answer line and explanation (datasets.py:55-85). False: every row,
    # target " X. option" after the loss-masked prompt (smf.data.medmcqa.format_example).
    medmcqa_exam_text: bool
    # How n training examples are drawn. "first-n-of-shuffle": the whole set in dataset order when
    # n >= its size, else datasets' shuffle(seed).select(range(n)) (datasets.py:22-25, 103).
    # "random": n rows drawn with random.Random(seed) (smf.data.sources.subset).
    subset_rule: str
    # Background statistics examples. An int P: the first n_background of the size-P draw (same rule
    # and seed) from the retrofit's own pool, so they overlap the retrofit examples
    # (slurm/train_med_*_sparse*.sh: --background-sample-size 20000 --background-max-batches 2000;
    # sparse_memory.py:91-92). None: held out, after the retrofit examples (smf.data.oasst).
    background_pool: int | None
    # Strip question and option text. The authors format them as stored (datasets.py:74-78,
    # eval_tasks.py:98-106, 171).
    strip_fields: bool
    # MedMCQA evaluation prompt header (eval_tasks.py:98-99): "Medical exam question:\n" or "".
    medmcqa_header: str
    # MedMCQA scoring: True: context and continuation tokenised together without special tokens, the
    # first len(tokenize(context)) positions masked (eval_tasks.py:53-58). False: tokenised apart.
    medmcqa_joint_tokenization: bool
    # WikiText-103 config (eval_tasks.py:123): "wikitext-103-v1" (non-raw) or "wikitext-103-raw-v1".
    wikitext_config: str
    # WikiText line selection. An int N: rows stripped, empty ones dropped, the first N kept
    # (eval_tasks.py:124-126 with --limit 1000 of slurm/eval_med_*.sh). None: every row as stored.
    wikitext_lines: int | None
    # WikiText text tokenised with the tokenizer's special tokens (clean) or without (eval_tasks.py:127).
    wikitext_special_tokens: bool
    # WikiText: True weights the first window's mean loss by its length, the way the authors'
    # window loss x (end - prev_end) does (eval_tasks.py:136-148); False: every scored token once.
    wikitext_length_weighted_first_window: bool
    # TriviaQA decoding. True: greedy under the model's own generation config (Qwen-2.5-Instruct's has
    # repetition_penalty 1.1), eos = the tokenizer's (eval_tasks.py:152-162). False: plain greedy,
    # repetition_penalty 1.0, the model's eos ids.
    triviaqa_model_generation_config: bool
    # TriviaQA normaliser: "authors": lower-case, a/an/the -> space, every char outside [a-z0-9 .-] ->
    # space, whitespace collapsed (eval_tasks.py:23-27). "squad": punctuation removed (smf.eval.triviaqa).
    triviaqa_normalizer: str
    # TriviaQA answer fields matched (eval_tasks.py:172: aliases only).
    triviaqa_alias_fields: tuple[str, ...]
    # Sparse-stage loss under gradient accumulation. True: each micro-batch's token mean, summed over the
    # micro-batches of a step (trainer_utils.py:14-19: compute_loss ignores num_items_in_batch, and the Trainer
    # then does not divide by the accumulation steps), so the gradient is (micro-batches)x the mean's; under DDP
    # the ranks' sums are averaged (smf.train.loop). False:
    # the token mean of the whole step, as every other recipe (and the Trainer's default compute_loss) has.
    sparse_loss_sums_micro_batch_means: bool
    # bf16 weights. True: where bf16 is on (training: --bf16; smf background, evaluation: a CUDA device with
    # bf16, the authors' dtype "auto"), the model's weights are bf16, memories included; the parameters that train are
    # cast back to fp32 (memory_model.py: cast_trainable_params; train_sparse.py / train_retrofit.py:
    # --trainable-param-dtype fp32), except in full finetuning, which steps bf16 weights with no fp32 master
    # copy (train_full_finetune.py:55, 104); evaluation runs wholly in bf16 (eval_tasks.py:30-50, --dtype auto).
    # False: fp32 weights under bf16 autocast (smf.model.precision).
    bf16_weights: bool


AUTHORS = Protocol(
    name="authors", plain_text_training=True, oasst_response_only=True, medmcqa_exam_text=True,
    subset_rule="first-n-of-shuffle", background_pool=20_000, strip_fields=False,
    medmcqa_header="Medical exam question:\n", medmcqa_joint_tokenization=True,
    wikitext_config="wikitext-103-v1", wikitext_lines=1000, wikitext_special_tokens=False,
    wikitext_length_weighted_first_window=True,
    triviaqa_model_generation_config=True, triviaqa_normalizer="authors", triviaqa_alias_fields=("aliases",),
    sparse_loss_sums_micro_batch_means=True, bf16_weights=True,
)
CLEAN = Protocol(
    name="clean", plain_text_training=False, oasst_response_only=False, medmcqa_exam_text=False,
    subset_rule="random", background_pool=None, strip_fields=True,
    medmcqa_header="", medmcqa_joint_tokenization=False,
    wikitext_config="wikitext-103-raw-v1", wikitext_lines=None, wikitext_special_tokens=True,
    wikitext_length_weighted_first_window=False,
    triviaqa_model_generation_config=False, triviaqa_normalizer="squad",
    triviaqa_alias_fields=("aliases", "normalized_aliases"),
    sparse_loss_sums_micro_batch_means=False, bf16_weights=False,
)
_BY_NAME = {protocol.name: protocol for protocol in (AUTHORS, CLEAN)}

# The authors' oasst1 filter (datasets.py:18, 33-40).
AUTHORS_OASST_MIN_CHARS = 50
AUTHORS_OASST_RANKS = (0, 1)


def get_protocol(protocol: str | Protocol) -> Protocol:
    """The :class:`Protocol` named ``protocol`` (one of :data:`PROTOCOLS`), or ``protocol`` itself."""
    if isinstance(protocol, Protocol):
        return protocol
    if protocol not in _BY_NAME:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}; got {protocol!r}")
    return _BY_NAME[protocol]


def first_n_of_shuffle(items, n: int | None, seed: int):
    """The authors' sampling helper (datasets.py:22-25): all of ``items`` in order when ``n`` is None,
    <= 0 or >= len(items); else the first ``n`` of the permutation that ``datasets.Dataset.shuffle(seed=seed)``
    draws (numpy ``default_rng(seed).permutation``). ``items``: a list or a ``datasets.Dataset``."""
    size = len(items)
    if n is None or n <= 0 or n >= size:
        return items
    order = np.random.default_rng(seed).permutation(size)[:n].tolist()
    return items.select(order) if hasattr(items, "select") else [items[i] for i in order]
