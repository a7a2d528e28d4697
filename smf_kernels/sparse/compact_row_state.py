"""The compact form of :class:`~smf_kernels.sparse.RowSparseAdamW`'s state: moments only for the rows it has updated.

A table of M rows trained T rows a step touches few of its rows, so its state is held by *slot*, not by row::

    held_rows    (K,) int64   the rows that have state (updated at least once), ascending
    held_slots   (K,) int64   their slots: row held_rows[i]'s state is slot held_slots[i] (a permutation of 0..K-1)
    slot_step    (C,) int64   per-slot step counts
    exp_avg      (C, D)       per-slot first moments, the table's dtype
    exp_avg_sq   (C, D)       per-slot second moments

A row gets the next free slot (K) the first step that updates it, and keeps it. The capacity C grows in chunks,
never by doubling: C = min(M, K + max(ceil(K / 16), 32)) when K outgrows it, so the slack is at most 6.25% of
the slots in use or 32 slots. Slots from K on are zero. A growth copies the K used slots into the new storage
(both are held for that moment; each row is copied at most ~17 times over a run, amortized).

Why a sorted index and not an (M,) row -> slot map: the state then grows with the rows updated only (16 bytes a
held row), where a map costs 4 bytes for every row of the table from the first step: 4 MiB at M = 1M, more than
the 3.5 MiB of moments a 512-row step of an fp32 896-wide table needs. Finding a step's T slots is a binary
search (``searchsorted``, no host sync); adding n new rows re-sorts the index (K + n entries of 16 bytes, only
in a step that adds rows).

Rows ``valid`` leaves alone get no slot: in a step they borrow a spare slot past the used ones (zero moments and
step, which the update leaves untouched), so the op's slots stay distinct and in range.
"""
from __future__ import annotations

import math

import torch

MIN_SPARE_SLOTS = 32


def slot_capacity(needed: int, num_rows: int) -> int:
    """Slots to allocate when ``needed`` (<= ``num_rows``) outgrow the storage (see module docstring)."""
    return min(num_rows, needed + max(math.ceil(needed / 16), MIN_SPARE_SLOTS))


def new_compact_state(param: torch.Tensor) -> dict:
    """The compact state of an (M, D) table no row of which has been updated (no slot allocated)."""
    return {"held_rows": torch.zeros(0, dtype=torch.int64, device=param.device),
            "held_slots": torch.zeros(0, dtype=torch.int64, device=param.device),
            "slot_step": torch.zeros(0, dtype=torch.int64, device=param.device),
            "exp_avg": param.new_zeros(0, param.shape[1]),
            "exp_avg_sq": param.new_zeros(0, param.shape[1])}


def is_compact(state: dict) -> bool:
    return "held_rows" in state


def _reserve(state: dict, needed: int, num_rows: int) -> None:
    """Grow the storage to hold ``needed`` slots (zeros past the used ones); nothing when it already does."""
    capacity = state["slot_step"].shape[0]
    if needed <= capacity:
        return
    used, size = state["held_rows"].shape[0], slot_capacity(needed, num_rows)
    for key in ("slot_step", "exp_avg", "exp_avg_sq"):
        old = state[key]
        grown = old.new_empty((size, *old.shape[1:]))  # one pass over the new storage: copy, then zeros
        grown[:used] = old[:used]
        grown[used:] = 0
        state[key] = grown


def _lookup(state: dict, rows: torch.Tensor) -> torch.Tensor:
    """(R,) int64: the slot of each of ``rows``, -1 for a row without state (a binary search of the index)."""
    held_rows = state["held_rows"]
    if held_rows.numel() == 0:
        return torch.full_like(rows, -1)
    at = torch.searchsorted(held_rows, rows).clamp_(max=held_rows.numel() - 1)
    found = held_rows.index_select(0, at) == rows
    return torch.where(found, state["held_slots"].index_select(0, at), -1)


def assign_slots(state: dict, rows: torch.Tensor, valid: torch.Tensor | None,
                 num_rows: int) -> tuple[torch.Tensor, tuple[torch.Tensor, int] | None]:
    """(slots (T,) int64, claim) for the ascending rows of a step of an (``num_rows``, D) table: a row with state
    keeps its slot, a row without gets the next free one (``valid`` rows) or a spare one past them (the others,
    which keep no state). The storage grows to hold them; the index is not changed: :func:`commit_slots` records
    ``claim`` (which rows are new, how many) after the update. Reads the number of new rows on the host: the one
    host sync of a compact step."""
    slots = _lookup(state, rows)
    new = slots < 0
    fresh = new if valid is None else new & valid
    counts = torch.stack([fresh.sum(), new.sum()]).tolist()  # the sync: the storage grows on the host
    if counts[1] == 0:
        return slots, None
    used = state["held_rows"].shape[0]
    _reserve(state, used + counts[1], num_rows)
    slots = torch.where(fresh, used - 1 + fresh.cumsum(0), slots)
    if counts[1] > counts[0]:
        spare = new & ~fresh
        slots = torch.where(spare, used + counts[0] - 1 + spare.cumsum(0), slots)
    return slots, (fresh, counts[0])


def commit_slots(state: dict, rows: torch.Tensor, slots: torch.Tensor,
                 claim: tuple[torch.Tensor, int] | None) -> None:
    """Add the rows :func:`assign_slots` gave new slots to the index (after the update succeeded)."""
    if claim is None or claim[1] == 0:
        return
    fresh, count = claim
    first = torch.argsort((~fresh).to(torch.int8), stable=True)[:count]  # the new rows' positions, no sync
    merged_rows, order = torch.sort(torch.cat([state["held_rows"], rows.index_select(0, first)]))
    state["held_slots"] = torch.cat([state["held_slots"], slots.index_select(0, first)]).index_select(0, order)
    state["held_rows"] = merged_rows


def rows_with_state(state: dict) -> torch.Tensor:
    """(K,) int64 ascending: the rows that have a slot."""
    return state["held_rows"].clone()


def dense_rows(state: dict, rows: torch.Tensor) -> dict:
    """The dense-equivalent state of ``rows`` (R,): exp_avg and exp_avg_sq (R, D), row_step (R,); zero for a
    row without a slot."""
    slots = _lookup(state, rows)
    has = slots >= 0
    taken = slots.clamp(min=0)
    out = {}
    for key, dense_key in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("slot_step", "row_step")):
        source = state[key]
        if source.shape[0] == 0:
            out[dense_key] = source.new_zeros((rows.numel(), *source.shape[1:]))
            continue
        picked = source.index_select(0, taken)
        mask = has if picked.dim() == 1 else has.unsqueeze(1)
        out[dense_key] = torch.where(mask, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    return out


def compact_from_dense(row_step: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict:
    """The compact form of a dense (row-indexed) state: a slot for each row with a step count or a moment other
    than zero, in ascending row order (bit-identical moments and counts)."""
    held = (row_step != 0) | (exp_avg != 0).any(1) | (exp_avg_sq != 0).any(1)
    rows = held.nonzero().squeeze(1)
    used = rows.numel()
    state = {"held_rows": rows, "held_slots": torch.arange(used, device=rows.device)}
    size = slot_capacity(used, row_step.shape[0]) if used else 0
    for key, dense in (("slot_step", row_step), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        compact = dense.new_zeros((size, *dense.shape[1:]))
        compact[:used] = dense.index_select(0, rows)
        state[key] = compact
    return state


def dense_from_compact(state: dict, num_rows: int) -> dict:
    """The dense (row-indexed) form of a compact state: row_step (M,), exp_avg and exp_avg_sq (M, D)."""
    return dense_rows(state, torch.arange(num_rows, device=state["held_rows"].device))


def check_compact_state(state: dict, shape: tuple[int, int], where: str) -> None:
    """ValueError naming ``where`` and the entry unless ``state`` is a compact state of an (M, D) table (see the
    module docstring): shapes and dtypes, rows ascending in [0, M), slots 0..K-1 each held once, counts and second
    moments >= 0, zeros past the used slots."""
    num_rows, dim = shape
    for key in ("held_rows", "held_slots", "slot_step", "exp_avg", "exp_avg_sq"):
        if key not in state:
            raise ValueError(f"RowSparseAdamW state of {where} lacks {key}")
        if not isinstance(state[key], torch.Tensor):
            raise ValueError(f"RowSparseAdamW state of {where}: {key} must be a tensor, got "
                             f"{type(state[key]).__name__}")
    for key in ("held_rows", "held_slots", "slot_step"):
        if state[key].dim() != 1 or state[key].dtype != torch.int64:
            raise ValueError(f"RowSparseAdamW state of {where}: {key} must be a 1-D int64 tensor, got "
                             f"{state[key].dtype} {tuple(state[key].shape)}")
    held_rows, held_slots = state["held_rows"], state["held_slots"]
    used, capacity = held_rows.shape[0], state["slot_step"].shape[0]
    if held_slots.shape[0] != used or used > capacity:
        raise ValueError(f"RowSparseAdamW state of {where}: held_rows and held_slots must have one entry per row "
                         f"with state (K <= C = {capacity} slots), got {used} and {held_slots.shape[0]}")
    for key in ("exp_avg", "exp_avg_sq"):
        value = state[key]
        if tuple(value.shape) != (capacity, dim) or not value.is_floating_point():
            raise ValueError(f"RowSparseAdamW state of {where}: {key} must be a floating tensor of shape "
                             f"{(capacity, dim)} (C slots, D) for this parameter, got {value.dtype} "
                             f"{tuple(value.shape)} (state saved for another model?)")
    if used and (int(held_rows[0]) < 0 or int(held_rows[-1]) >= num_rows or bool((held_rows[1:] <= held_rows[:-1]).any())):
        raise ValueError(f"RowSparseAdamW state of {where}: held_rows must be strictly ascending rows in "
                         f"[0, {num_rows})")
    if used and (int(held_slots.min()) < 0 or int(held_slots.max()) >= used
                 or int(torch.bincount(held_slots, minlength=used).max()) != 1):
        raise ValueError(f"RowSparseAdamW state of {where}: held_slots must give slots 0..{used - 1} to one row "
                         "each")
    for key in ("slot_step", "exp_avg_sq"):
        if bool((state[key] < 0).any()):
            raise ValueError(f"RowSparseAdamW state of {where}: {key} holds negative values")
    for key in ("slot_step", "exp_avg", "exp_avg_sq"):
        if bool(state[key][used:].any()):
            raise ValueError(f"RowSparseAdamW state of {where}: {key} is not zero past the {used} used slots")
