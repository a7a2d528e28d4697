"""Row bookkeeping shared by the backends and the sparse controller."""
from __future__ import annotations

import torch


def row_to_slot_map(update_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(num_rows,) int64 map: slot t for row update_rows[t], -1 for every other row.

    update_rows: (T,) int64 distinct row ids in [0, num_rows).
    """
    slots = torch.full((num_rows,), -1, dtype=torch.int64, device=update_rows.device)
    slots[update_rows] = torch.arange(update_rows.numel(), device=update_rows.device)
    return slots


def read_targets(flat_indices: torch.Tensor, update_rows: torch.Tensor | None,
                 num_rows: int) -> tuple[torch.Tensor, int]:
    """(targets, out_rows): the output row of each read (flat_indices, (R,) int64 row ids).

    Dense (update_rows None): the row itself, out of num_rows. Sparse: the read's slot in
    update_rows, with every read of an unselected row sent to one scratch row T past the end
    (out_rows = T + 1; the caller drops it), since a mask would need a host sync on accelerators.
    """
    if update_rows is None:
        return flat_indices, num_rows
    selected = update_rows.numel()
    slots = row_to_slot_map(update_rows, num_rows)[flat_indices]
    return torch.where(slots >= 0, slots, selected), selected + 1
