"""Slot scoring and top-T row selection (docs/method.md#slot-selection), pure functions on tensors.

All functions run on the tensors' device. Scores are computed in float64 so that
slots with equal statistics get exactly equal scores; ties are broken by the
lower slot id (a stable sort), which makes the selection identical on every
device and every rank. :func:`select_top_rows` returns a tensor whose length
depends on the data, so it reads one scalar back to the host; the only host sync here.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from smf_kernels._checks import check_tensor

logger = logging.getLogger(__name__)
RULES = ("tfidf", "kl")
KL_EPS = 1e-8


# The paper's T as a share of a memory's slots: 512 of 16,384 (1/32, 3.1%), the default rows_per_step.
PAPER_ROWS_PER_STEP, PAPER_SLOTS = 512, 16_384


def default_rows_per_step(num_slots: int) -> int:
    """T for a memory of ``num_slots`` slots when none is given: the paper's share, ``num_slots * 512 // 16384``
    (rounded down), at least 1; 512 at the paper's 16,384 slots, 8 at 256, 13 at 441."""
    return max(1, num_slots * PAPER_ROWS_PER_STEP // PAPER_SLOTS)


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
    if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
        raise ValueError(f"num_batches must be a non-negative int, got {num_batches!r}")
    counts64 = counts.to(torch.float64)
    term_freq = counts64 / counts64.sum().clamp_min(1.0)  # C = 0 only when every slot is masked anyway
    inverse_doc_freq = torch.log((num_batches + 1.0) / (doc_freq.to(torch.float64) + 1.0))
    return _mask_unread(term_freq * inverse_doc_freq, counts)


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
    counts64 = counts.to(torch.float64)
    batch_dist = counts64 / counts64.sum().clamp_min(1.0)
    smoothed = reads.to(torch.float64) + 1.0
    background_dist = smoothed / smoothed.sum()
    return _mask_unread(batch_dist * torch.log((batch_dist + eps) / (background_dist + eps)), counts)


def select_rows_padded(scores: torch.Tensor, counts: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_rows`` highest-scoring slots at a fixed size, with no host sync (a shape torch.compile can keep).

    Args:
        scores: (M,) float scores.
        counts: (M,) int64 reads in the batch; only slots with ``counts > 0`` are eligible.
        num_rows: T, the most rows to select (>= 0).

    Returns:
        rows: (min(T, M),) int64 ascending. Equal scores: lower slot id first.
        valid: (min(T, M),) bool: True for the selected rows, the ``min(T, #read slots)`` best read ones; the
            others are unread slots that fill the size and must not be updated.
    """
    _check_counts(counts)
    if not isinstance(scores, torch.Tensor) or scores.shape != counts.shape:
        raise ValueError(f"scores must be a tensor of the shape of counts (M,) = {tuple(counts.shape)}")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
    order = torch.sort(_mask_unread(scores, counts), descending=True, stable=True).indices
    rows, position = order[: min(num_rows, counts.numel())].sort()
    return rows, (counts[rows] > 0)


def select_top_rows(scores: torch.Tensor, counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The rows :func:`select_rows_padded` selects: (min(T, #read),) int64, ascending (one host sync)."""
    rows, valid = select_rows_padded(scores, counts, num_rows)
    return rows[valid]


def score_slots(rule: str, counts: torch.Tensor, doc_freq: torch.Tensor, reads: torch.Tensor,
                num_batches: int) -> torch.Tensor:
    """Scores of ``rule`` ("tfidf" or "kl") from a batch's counts and background statistics (all (M,) int64)."""
    if rule == "tfidf":
        return tfidf_scores(counts, doc_freq, num_batches)
    if rule == "kl":
        return kl_scores(counts, reads)
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
