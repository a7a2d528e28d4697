"""The compact form of :class:`~smf_kernels.sparse.RowSparseAdamW`'s state: moments only for the rows it has updated.

A table of M rows trained T rows a step touches few of its rows, so its state is held by *slot*, not by row::

    slot_of_row  (M,) int32   row -> its slot, -1 for a row that has no state (never updated)
    slots_used   int          K: slots 0..K-1 belong to rows; every row with state has one
    slot_step    (C,) int64   per-slot step counts (slot_step[slot_of_row[r]] is row r's count)
    exp_avg      (C, D)       per-slot first moments, the table's dtype
    exp_avg_sq   (C, D)       per-slot second moments

A row gets the next free slot the first step that updates it, and keeps it. The capacity C grows in chunks,
never by doubling: C = min(M, K + max(ceil(K / 16), 32)) when K outgrows it, so the slack is at most 6.25% of
the slots in use or 32 slots. Slots beyond K are zero. A growth copies the K used slots into the new storage
(both are held for that moment).

Why a (M,) map and not a sorted index of the K rows: finding T rows' slots is one gather (no search, no host
sync), and adding rows one scatter, where a sorted index needs a search per row and a merge that moves the
index every step; the map costs 4 bytes a row, 1/896 of an fp32 896-wide row and half the (M,) int64 step
counts the dense form held. (M must stay below 2**31.)

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
    return {"slot_of_row": torch.full((param.shape[0],), -1, dtype=torch.int32, device=param.device),
            "slots_used": 0,
            "slot_step": torch.zeros(0, dtype=torch.int64, device=param.device),
            "exp_avg": param.new_zeros(0, param.shape[1]),
            "exp_avg_sq": param.new_zeros(0, param.shape[1])}


def is_compact(state: dict) -> bool:
    return "slot_of_row" in state


def _reserve(state: dict, needed: int) -> None:
    """Grow the storage to hold ``needed`` slots (zeros past the used ones); nothing when it already does."""
    capacity = state["slot_step"].shape[0]
    if needed <= capacity:
        return
    used, size = state["slots_used"], slot_capacity(needed, state["slot_of_row"].shape[0])
    for key in ("slot_step", "exp_avg", "exp_avg_sq"):
        old = state[key]
        grown = old.new_empty((size, *old.shape[1:]))  # one pass over the new storage: copy, then zeros
        grown[:used] = old[:used]
        grown[used:] = 0
        state[key] = grown


def assign_slots(state: dict, rows: torch.Tensor,
                 valid: torch.Tensor | None) -> tuple[torch.Tensor, tuple[torch.Tensor, int]]:
    """(slots (T,) int64, claim) for the rows of a step: a row with state keeps its slot, a row without gets the
    next free one (``valid`` rows) or a spare one past them (the others, which keep no state). The storage grows
    to hold them; the map is not changed: :func:`commit_slots` records ``claim`` (the new map entries of ``rows``
    and the number of new slots) after the update. Reads the number of new rows on the host: the one host sync
    of a compact step."""
    old = state["slot_of_row"].index_select(0, rows)
    slots = old.long()
    new = slots < 0
    fresh = new if valid is None else new & valid
    counts = torch.stack([fresh.sum(), new.sum()]).tolist()  # the sync: the storage grows on the host
    if counts[1] == 0:
        return slots, (old, 0)
    used = state["slots_used"]
    _reserve(state, used + counts[1])
    slots = torch.where(fresh, used - 1 + fresh.cumsum(0), slots)
    if counts[1] > counts[0]:
        spare = new & ~fresh
        slots = torch.where(spare, used + counts[0] - 1 + spare.cumsum(0), slots)
    return slots, (torch.where(fresh, slots.to(torch.int32), old), counts[0])


def commit_slots(state: dict, rows: torch.Tensor, claim: tuple[torch.Tensor, int]) -> None:
    """Record the slots :func:`assign_slots` gave the step's updated rows (after the update succeeded)."""
    entries, fresh = claim
    if fresh:
        state["slot_of_row"].index_copy_(0, rows, entries)
        state["slots_used"] += fresh


def rows_with_state(state: dict) -> torch.Tensor:
    """(K,) int64 ascending: the rows that have a slot."""
    return (state["slot_of_row"] >= 0).nonzero().squeeze(1)


def dense_rows(state: dict, rows: torch.Tensor) -> dict:
    """The dense-equivalent state of ``rows`` (R,): exp_avg and exp_avg_sq (R, D), row_step (R,); zero for a
    row without a slot."""
    slots = state["slot_of_row"].index_select(0, rows).long()
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
    state = {"slot_of_row": torch.full(row_step.shape, -1, dtype=torch.int32, device=row_step.device),
             "slots_used": used}
    state["slot_of_row"][rows] = torch.arange(used, dtype=torch.int32, device=rows.device)
    size = slot_capacity(used, row_step.shape[0]) if used else 0
    for key, dense in (("slot_step", row_step), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        compact = dense.new_zeros((size, *dense.shape[1:]))
        compact[:used] = dense.index_select(0, rows)
        state[key] = compact
    return state


def dense_from_compact(state: dict, num_rows: int) -> dict:
    """The dense (row-indexed) form of a compact state: row_step (M,), exp_avg and exp_avg_sq (M, D)."""
    return dense_rows(state, torch.arange(num_rows, device=state["slot_of_row"].device))


def check_compact_state(state: dict, shape: tuple[int, int], where: str) -> None:
    """ValueError naming ``where`` and the entry unless ``state`` is a compact state of an (M, D) table (see the
    module docstring): shapes, integer maps, slots 0..K-1 each held by one row, counts and second moments >= 0,
    zeros past the used slots."""
    num_rows, dim = shape
    for key in ("slot_of_row", "slots_used", "slot_step", "exp_avg", "exp_avg_sq"):
        if key not in state:
            raise ValueError(f"RowSparseAdamW state of {where} lacks {key}")
    used = state["slots_used"]
    if not isinstance(used, int) or isinstance(used, bool) or used < 0:
        raise ValueError(f"RowSparseAdamW state of {where}: slots_used must be an int >= 0, got {used!r}")
    slot_step = state["slot_step"]
    capacity = slot_step.shape[0] if isinstance(slot_step, torch.Tensor) and slot_step.dim() == 1 else None
    if capacity is None or slot_step.dtype != torch.int64:
        raise ValueError(f"RowSparseAdamW state of {where}: slot_step must be a 1-D int64 tensor (C,), got "
                         f"{_describe(slot_step)}")
    expected = {"slot_of_row": ((num_rows,), (torch.int32,)), "exp_avg": ((capacity, dim), None),
                "exp_avg_sq": ((capacity, dim), None)}
    for key, (want, dtypes) in expected.items():
        value = state[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want or (
                dtypes is not None and value.dtype not in dtypes) or (dtypes is None and not value.is_floating_point()):
            kind = "int32" if dtypes else "floating"
            raise ValueError(f"RowSparseAdamW state of {where}: {key} must be a {kind} tensor of shape {want} for "
                             f"this parameter (C = {capacity} slots), got {_describe(value)} (state saved for "
                             "another model?)")
    if used > capacity:
        raise ValueError(f"RowSparseAdamW state of {where}: slots_used = {used} exceeds the {capacity} slots held")
    slot_of_row = state["slot_of_row"]
    assigned = slot_of_row[slot_of_row >= 0].long()
    if bool((slot_of_row < -1).any()) or bool((assigned >= used).any()) or assigned.numel() != used or (
            used and int(torch.bincount(assigned, minlength=used).max()) != 1):
        raise ValueError(f"RowSparseAdamW state of {where}: slot_of_row must give slots 0..{used - 1} (slots_used) "
                         "to one row each and -1 to the others")
    for key in ("slot_step", "exp_avg_sq"):
        if bool((state[key] < 0).any()):
            raise ValueError(f"RowSparseAdamW state of {where}: {key} holds negative values")
    for key in ("slot_step", "exp_avg", "exp_avg_sq"):
        if bool(state[key][used:].any()):
            raise ValueError(f"RowSparseAdamW state of {where}: {key} is not zero past the {used} used slots")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__
