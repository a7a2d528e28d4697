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
