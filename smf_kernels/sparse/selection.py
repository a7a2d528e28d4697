"""Slot scoring and top-T row selection (docs/method.md#slot-selection), pure functions on tensors.

All functions run on the tensors' device. Scores are computed in float64 so that
slots with equal statistics get exactly equal scores; ties are broken by the
lower slot id, which makes the selection identical on every device and every rank.
The top T are found by a partial selection (``torch.topk`` for the T-th score, then
the lowest-id slots of that score), not a sort of every slot. What a score takes from
the background alone (:func:`background_weights`) is computed once per background.
:func:`select_rows_padded` makes no host sync (a fixed size); :func:`select_top_rows`
and :func:`select_read_rows_padded` read one scalar back to the host.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from smf_kernels._checks import check_non_negative, check_tensor
from smf_kernels.names import RULES
from smf_kernels.sparse.background import check_counts as check_background_counts

logger = logging.getLogger(__name__)
KL_EPS = 1e-8


# The paper's T as a share of a memory's slots: 512 of 16,384 (1/32, 3.1%), the default rows_per_step, which never
# exceeds the paper's T = 512 (a larger memory updates as many rows per step as the paper's, not more).
PAPER_ROWS_PER_STEP, PAPER_SLOTS = 512, 16_384


def default_rows_per_step(num_slots: int) -> int:
    """T for a memory of ``num_slots`` slots when none is given: the paper's share, ``num_slots * 512 // 16384``
    (rounded down), at least 1 and at most the paper's T = 512: 8 at 256 slots, 13 at 441, 512 at the paper's
    16,384 and at any larger memory (1,048,576 slots: 512, not 32,768). An explicit ``rows_per_step`` is not
    capped. ValueError for a ``num_slots`` that is not a positive int."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be a positive int (n_keys ** 2), got {num_slots!r}")
    return min(PAPER_ROWS_PER_STEP, max(1, num_slots * PAPER_ROWS_PER_STEP // PAPER_SLOTS))


def check_rows_per_step(rows_per_step: object) -> None:
    """ValueError unless ``rows_per_step`` (T) is a positive int or None (each memory's
    :func:`default_rows_per_step`)."""
    if rows_per_step is not None and (isinstance(rows_per_step, bool) or not isinstance(rows_per_step, int)
                                      or rows_per_step < 1):
        raise ValueError(f"rows_per_step must be a positive int or None, got {rows_per_step!r}")


def warn_if_not_sparse(num_slots: Mapping[str, int], rows_per_step: int) -> None:
    """Log a warning when T = ``rows_per_step`` reaches the slot count of a memory (``num_slots``: layer
    name -> n_keys ** 2): every row a step reads is then updated, so nothing is sparse."""
    full = {name or "<the model>": slots for name, slots in num_slots.items() if rows_per_step >= slots}
    if full:
        logger.warning("rows_per_step=%d is not below the number of slots of %s: every row a step reads is updated, "
                       "so the update is not sparse. Pass a rows_per_step below the slot count (the paper: 512 of "
                       "16,384 slots per layer; the tiny preset: 32 of 256; `smf train --rows-per-step`)",
                       rows_per_step, full)


def _check_counts(counts: torch.Tensor) -> None:
    check_tensor("counts", counts, ndim=1, dtypes=(torch.int64,), shape_doc="(M,)")


def _check_like_counts(name: str, stat: torch.Tensor, counts: torch.Tensor) -> None:
    check_tensor(name, stat, ndim=1, dtypes=(torch.int64,), shape_doc="(M,)")
    if stat.shape != counts.shape:
        raise ValueError(f"{name} must have the shape of counts (M,) = {tuple(counts.shape)}, got {tuple(stat.shape)}")
    if stat.device != counts.device:
        raise ValueError(f"{name} is on {stat.device} but counts is on {counts.device}")


def _mask_unread(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(counts == 0, float("-inf"))


def background_weights(rule: str, doc_freq: torch.Tensor, reads: torch.Tensor, num_batches: int,
                       eps: float = KL_EPS) -> torch.Tensor:
    """What ``rule``'s score takes from the background alone, made once per background (:func:`weighted_scores`
    and :func:`select_read_rows_padded` use it as is).

    Args:
        rule: "tfidf" or "kl".
        doc_freq: (M,) int64 background batches in which each slot was read.
        reads: (M,) int64 total background reads b(i) of each slot.
        num_batches: N, the number of background batches (>= 0).
        eps: the KL epsilon of docs/method.md#slot-selection (1e-8).

    Returns:
        (M,) float64: "tfidf": the IDF ``log((N + 1) / (df(i) + 1))``; "kl": ``q(i) + eps``, with
        ``q(i) = (b(i) + 1) / sum_j (b(j) + 1)`` the add-one-smoothed background distribution.

    ValueError (one host sync) for statistics that counting ``num_batches`` batches cannot produce (a negative
    count, ``doc_freq`` above N, fewer reads than ``doc_freq``): they would make scores NaN or negative.
    """
    check_tensor("doc_freq", doc_freq, ndim=1, dtypes=(torch.int64,), shape_doc="(M,)")
    _check_like_counts("reads", reads, doc_freq)
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches must be a non-negative int, got {num_batches!r}")
    check_background_counts("background_weights", doc_freq, reads, num_batches)
    if rule == "tfidf":
        return _inverse_doc_freq(doc_freq, num_batches)
    if rule == "kl":
        return _smoothed_background(reads, eps)
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def _inverse_doc_freq(doc_freq: torch.Tensor, num_batches: int) -> torch.Tensor:
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches must be a non-negative int, got {num_batches!r}")
    return torch.log((num_batches + 1.0) / (doc_freq.to(torch.float64) + 1.0))


def _smoothed_background(reads: torch.Tensor, eps: float) -> torch.Tensor:
    smoothed = reads.to(torch.float64) + 1.0
    return smoothed / smoothed.sum() + eps


def _rule_scores(rule: str, counts: torch.Tensor, weights: torch.Tensor, eps: float = KL_EPS) -> torch.Tensor:
    """Scores of ``counts`` ((K,) int64: a batch's reads of K slots, every read slot among them) given the
    slots' ``weights`` ((K,) float64, :func:`background_weights`); (K,) float64, unmasked."""
    counts64 = counts.to(torch.float64)
    batch_dist = counts64 / counts64.sum().clamp_min(1.0)  # C = 0 only when every slot is masked anyway
    if rule == "tfidf":
        return batch_dist * weights
    return batch_dist * torch.log((batch_dist + eps) / weights)


def tfidf_scores(counts: torch.Tensor, doc_freq: torch.Tensor, num_batches: int) -> torch.Tensor:
    """TF-IDF score per slot: ``c(i)/C * log((N + 1) / (df(i) + 1))``, ``-inf`` where ``c(i) = 0``.

    Args:
        counts: (M,) int64 reads of each slot in the optimizer step's batch.
        doc_freq: (M,) int64 background batches in which each slot was read.
        num_batches: N, the number of background batches (>= 0).

    Returns:
        (M,) float64 scores.
    """
    _check_counts(counts)
    _check_like_counts("doc_freq", doc_freq, counts)
    return weighted_scores("tfidf", counts, _inverse_doc_freq(doc_freq, num_batches))


def kl_scores(counts: torch.Tensor, reads: torch.Tensor, eps: float = KL_EPS) -> torch.Tensor:
    """KL score per slot: ``p(i) * log((p(i) + eps) / (q(i) + eps))``, ``-inf`` where ``c(i) = 0``.

    ``p(i) = c(i) / C`` is the batch's read distribution and
    ``q(i) = (b(i) + 1) / sum_j (b(j) + 1)`` the add-one-smoothed background one.

    Args:
        counts: (M,) int64 reads of each slot in the optimizer step's batch.
        reads: (M,) int64 total background reads b(i) of each slot.
        eps: the epsilon of docs/method.md#slot-selection (1e-8).

    Returns:
        (M,) float64 scores.
    """
    _check_counts(counts)
    _check_like_counts("reads", reads, counts)
    return weighted_scores("kl", counts, _smoothed_background(reads, eps), eps)


def weighted_scores(rule: str, counts: torch.Tensor, weights: torch.Tensor, eps: float = KL_EPS) -> torch.Tensor:
    """(M,) float64 scores of ``rule`` for a batch's (M,) int64 ``counts`` and the background's (M,) float64
    ``weights`` (:func:`background_weights`), ``-inf`` where ``c(i) = 0``: bit for bit :func:`tfidf_scores` /
    :func:`kl_scores` of the statistics the weights were made from. Every slot is scored (a fixed size, no host
    sync); :func:`select_read_rows_padded` scores only the read ones."""
    return _mask_unread(_rule_scores(rule, counts, weights, eps), counts)


def select_rows_padded(scores: torch.Tensor, counts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_rows`` highest-scoring slots at a fixed size, with no host sync (a shape torch.compile can keep).

    Args:
        scores: (M,) float scores (NaN ranks above every number, as in ``torch.sort``).
        counts: (M,) int64 reads in the batch; only slots with ``counts > 0`` are eligible.
        num_rows: T, the most rows to select (>= 0).

    Returns:
        rows: (min(T, M),) int64 ascending: the best slots, unread ones scoring ``-inf``. Equal scores: lower
            slot id first (so the unread slots that fill the size are the lowest-id ones).
        valid: (min(T, M),) bool: True for the selected rows, the ``min(T, #read slots)`` best read ones; the
            others are unread slots that fill the size and must not be updated.
    """
    _check_counts(counts)
    if not isinstance(scores, torch.Tensor) or scores.shape != counts.shape:
        raise ValueError(f"scores must be a tensor of the shape of counts (M,) = {tuple(counts.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating tensor (unread slots score -inf), got {scores.dtype}")
    _check_num_rows(num_rows)
    rows = _top_positions(_mask_unread(scores, counts), min(num_rows, counts.numel()))
    return rows, (counts[rows] > 0)


def select_top_rows(scores: torch.Tensor, counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The rows :func:`select_rows_padded` selects: (min(T, #read),) int64, ascending (one host sync)."""
    rows, valid = select_rows_padded(scores, counts, num_rows)
    return rows[valid]


def select_read_rows_padded(rule: str, counts: torch.Tensor, weights: torch.Tensor, num_rows: int,
                            eps: float = KL_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_rows_padded(weighted_scores(rule, counts, weights), counts, num_rows)``, bit for bit, scoring only
    the read slots: no (M,) float temporaries, one host sync (the number of read slots), so not for a compiled
    graph. The rows that fill the size are the lowest-id unread slots, as there (a read slot's score is never
    ``-inf``).

    Args:
        rule: "tfidf" or "kl".
        counts: (M,) int64 reads in the batch.
        weights: (M,) float64 :func:`background_weights` of ``rule`` (and ``eps``).
        num_rows: T, the most rows to select (>= 0).

    Returns:
        rows, valid: as :func:`select_rows_padded`, (min(T, M),) each.
    """
    _check_counts(counts)
    check_tensor("weights", weights, ndim=1, dtypes=(torch.float64,), shape_doc="(M,)")
    if weights.shape != counts.shape or weights.device != counts.device:
        raise ValueError(f"weights must be (M,) = {tuple(counts.shape)} on {counts.device} like counts, got "
                         f"{tuple(weights.shape)} on {weights.device}")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    _check_num_rows(num_rows)
    size = min(num_rows, counts.numel())
    read = counts.nonzero().squeeze(1)  # (K,) ascending: the host sync
    read_counts = counts.index_select(0, read)  # index_select: half the time of counts[read] at K = 122k of 1M
    check_non_negative("counts", read_counts)
    scores = _rule_scores(rule, read_counts, weights.index_select(0, read), eps)
    rows = read[_top_positions(scores, min(size, read.numel()))]  # equal scores: lower position = lower slot id
    if rows.numel() < size:  # the lowest-id unread slots fill the size: all below size + K
        first = torch.arange(min(counts.numel(), size + read.numel()), device=counts.device)
        fill = first[counts[first] == 0][: size - rows.numel()]
        rows = torch.cat([rows, fill]).sort().values
    return rows, (counts[rows] > 0)


def _check_num_rows(num_rows: object) -> None:
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")


def _top_positions(keys: torch.Tensor, k: int) -> torch.Tensor:
    """(k,) int64 ascending: the positions of the ``k`` greatest of ``keys`` ((n,) float, k <= n; NaN the
    greatest, as in ``torch.sort``), equal keys taken lowest position first: what a stable descending sort's first
    k are, without sorting all n. ``torch.topk`` finds the k-th key; every greater key is in its k; the rest are
    the lowest positions holding the k-th key (a second topk, over positions). No host sync."""
    n = keys.numel()
    if k == n:
        return torch.arange(n, device=keys.device)
    values, positions = torch.topk(keys, k)  # descending
    if k == 0:
        return positions
    kth = values[-1]
    above = (values > kth) | (values.isnan() & ~kth.isnan())
    ties = torch.where(kth.isnan(), keys.isnan(), keys == kth)
    lowest_ties = torch.where(ties, torch.arange(n, device=keys.device), n).topk(k, largest=False).values
    needed = torch.arange(k, device=keys.device) < k - above.sum()
    chosen = torch.cat([positions.masked_fill(~above, n), lowest_ties.masked_fill(~needed, n)])
    return chosen.sort().values[:k]  # exactly k positions below n


def score_slots(rule: str, counts: torch.Tensor, doc_freq: torch.Tensor, reads: torch.Tensor,
                num_batches: int) -> torch.Tensor:
    """Scores of ``rule`` ("tfidf" or "kl") from a batch's counts and background statistics (all (M,) int64)."""
    if rule == "tfidf":
        return tfidf_scores(counts, doc_freq, num_batches)
    if rule == "kl":
        return kl_scores(counts, reads)
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
