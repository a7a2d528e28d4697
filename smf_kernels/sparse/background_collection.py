"""Collecting background statistics: one batch per document (:func:`collect_background`, what
:meth:`SparseMemoryController.collect_background` runs), or many documents per forward with the counts of one
document per forward (:func:`collect_background_batched`).

Batched: the memories' read counts sum over a forward, and the document frequency ``df`` needs each document's own
reads, so each memory's lookup keeps the slots it chose and the reads of each document's real tokens are counted
apart (one ``bincount`` over ``document * M + slot``: a batch of B documents holds a (B, M) int64 count table per
layer for a moment). Padding is never counted, and a causal model's real tokens see no padding, so the statistics
equal those of one document per forward whenever the batched forward picks the same slots (a padded batch may round
differently in the last bit, which can flip a near-tie of the top-k; benchmarks/RESULTS.md measures it). Documents
are run longest first, which keeps padding small; the order does not change the sums.

Under torch.distributed (``process_group``, default the world when initialised) each rank counts its own batches
and the totals are summed over ranks.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from smf_kernels.memory import ProductKeyMemory, memories_of
from smf_kernels.sparse.background import BackgroundStats

logger = logging.getLogger(__name__)


def _call_model(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _sum_over_ranks(stats: BackgroundStats, memories: Mapping[str, ProductKeyMemory], process_group) -> None:
    """Every rank's statistics summed over ``process_group`` in place (one all_reduce per layer)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1):
        return
    for name, memory in memories.items():
        packed = torch.cat([stats.doc_freq[name], stats.reads[name], torch.tensor([stats.num_batches[name]])])
        packed = packed.to(memory.read_counts.device)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=process_group)
        doc_freq, reads, num_batches = packed.cpu().split([memory.num_slots, memory.num_slots, 1])
        stats.doc_freq[name], stats.reads[name] = doc_freq.clone(), reads.clone()  # own storage: safetensors saves them
        stats.num_batches[name] = int(num_batches)


@torch.no_grad()
def collect_background(model: nn.Module, batches: Iterable, *, forward: Callable[[nn.Module, Any], Any] | None = None,
                       max_batches: int | None = None, process_group=None, progress: bool = True) -> BackgroundStats:
    """Background statistics of every :class:`ProductKeyMemory` in ``model`` over ``batches`` (at most
    ``max_batches``), one batch = one document (the paper's batch size 1, so that ``df`` counts documents), in
    eval mode. ``forward(model, batch)`` runs the model (default ``model(**batch)`` for mappings, else
    ``model(batch)``); ``progress=False`` hides the progress bar."""
    memories = memories_of(model)
    forward = forward or _call_model
    stats = BackgroundStats.for_memories(memories)
    total = max_batches if max_batches is not None else (len(batches) if hasattr(batches, "__len__") else None)
    for memory in memories.values():
        memory.set_grad_sink(None)
        memory.set_read_counting(True)
    try:
        with _eval_mode(model):
            for index, batch in enumerate(tqdm(batches, total=total, desc="background statistics",
                                               disable=not progress)):
                if max_batches is not None and index >= max_batches:
                    break
                for memory in memories.values():
                    memory.reset_read_counts()
                forward(model, batch)
                for name, memory in memories.items():
                    stats.add_batch(name, memory.read_counts)
    finally:
        for memory in memories.values():
            memory.set_read_counting(False)
            memory.reset_read_counts()
    _sum_over_ranks(stats, memories, process_group)
    logger.info("background statistics from %d batches", next(iter(stats.num_batches.values())))
    return stats


@contextlib.contextmanager
def _kept_lookups(memories: Mapping[str, ProductKeyMemory]) -> Iterator[dict[str, list[torch.Tensor]]]:
    """While active, each memory's :meth:`~ProductKeyMemory.lookup` also appends its (N, heads, topk) slot ids to
    the yielded lists (by layer name)."""
    kept: dict[str, list[torch.Tensor]] = {name: [] for name in memories}

    def keeping(name: str, lookup: Callable):
        def lookup_and_keep(x: torch.Tensor, backend: str | None = None):  # ProductKeyMemory.lookup's signature
            scores, indices = lookup(x, backend)
            kept[name].append(indices)
            return scores, indices
        return lookup_and_keep

    for name, memory in memories.items():
        memory.lookup = keeping(name, memory.lookup)  # an instance attribute, shadowing the method
    try:
        yield kept
    finally:
        for memory in memories.values():
            del memory.lookup


def per_document_counts(indices: torch.Tensor, valid: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(B, M) int64 reads of each document: ``indices`` (B * S, heads, topk) slot ids of a (B, S) batch flattened
    batch-major, ``valid`` (B, S) bool real tokens."""
    batch, seq = valid.shape
    if indices.shape[0] != batch * seq:
        raise ValueError(f"indices hold {indices.shape[0]} tokens, the batch {batch} x {seq}")
    per_token = indices.reshape(batch, seq, -1)
    documents = torch.arange(batch, device=indices.device).view(batch, 1, 1).expand_as(per_token)
    flat = (documents * num_slots + per_token)[valid.to(indices.device)].reshape(-1)
    return torch.bincount(flat, minlength=batch * num_slots).view(batch, num_slots)


@torch.no_grad()
def collect_background_batched(model: nn.Module, documents: Sequence[Sequence[int]], *, batch_size: int,
                               pad_id: int, device: torch.device | str | None = None,
                               forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], None] | None = None,
                               process_group=None, progress: bool = True) -> BackgroundStats:
    """Background statistics of every :class:`ProductKeyMemory` in ``model`` (named by module path) over
    ``documents`` (token-id lists, one document each), ``batch_size`` documents per forward, in eval mode.

    ``forward(model, input_ids, attention_mask)`` runs the model (default: keyword call); ``pad_id`` fills the
    padding; ``device``: where the batches go (default: the model's first parameter's); ``progress=False`` hides
    the progress bar. Returns the statistics (one "batch" per document, as the paper's batch size 1).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    memories = memories_of(model)
    if any(len(document) == 0 for document in documents):
        raise ValueError("every document must hold at least one token")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    stats = BackgroundStats.for_memories(memories)
    order = sorted(range(len(documents)), key=lambda i: -len(documents[i]))
    with _eval_mode(model), _kept_lookups(memories) as kept:
        for start in tqdm(range(0, len(order), batch_size), desc="background statistics", unit="batch",
                          disable=not progress):
            chunk = [list(documents[i]) for i in order[start:start + batch_size]]
            longest = max(map(len, chunk))
            input_ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), longest), dtype=torch.long)
            for row, document in enumerate(chunk):
                input_ids[row, :len(document)] = torch.tensor(document)
                attention_mask[row, :len(document)] = 1
            if forward is None:
                model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            else:
                forward(model, input_ids.to(device), attention_mask.to(device))
            for name, memory in memories.items():
                if len(kept[name]) != 1:
                    raise RuntimeError(f"memory {name!r} looked up {len(kept[name])} times in one forward; "
                                       "expected once")
                counts = per_document_counts(kept[name].pop(), attention_mask.bool(), memory.num_slots).cpu()
                stats.num_batches[name] += len(chunk)
                stats.doc_freq[name] += (counts > 0).sum(dim=0)
                stats.reads[name] += counts.sum(dim=0)
    _sum_over_ranks(stats, memories, process_group)
    logger.info("background statistics from %d documents, %d per forward", next(iter(stats.num_batches.values())),
                batch_size)
    return stats
