"""Which columns of a value table each rank of a process group holds (docs/sharding.md#the-layout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# The attribute a sharded value table's Parameter carries, so code that sees only parameters (gradient
# clipping, the sparse controller, checkpoints) can tell its columns live on several ranks.
SHARD_ATTRIBUTE = "_smf_column_shard"


def column_bounds(width: int, parts: int) -> list[int]:
    """Start of each of ``parts`` near-equal column ranges of ``width`` columns, then ``width``: the first
    ``width % parts`` ranges hold one column more. ``column_bounds(10, 4) == [0, 3, 6, 8, 10]``."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive int, got {width!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= width:
        raise ValueError(f"parts must be an int in [1, width={width}] (every rank needs a column), got {parts!r}")
    base, extra = divmod(width, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (part < extra))
    return bounds


@dataclass(frozen=True)
class ColumnShard:
    """This rank's columns ``[start, stop)`` of a table ``width`` columns wide, split over ``group``.

    ``group`` is a torch.distributed process group (None: the default group); ``rank`` and ``size`` are this
    process's rank in it and its size; ``bounds`` (size + 1 ints) the column ranges of every rank.
    """

    width: int
    rank: int
    size: int
    bounds: tuple[int, ...]
    group: Any = None

    @classmethod
    def of_group(cls, width: int, group: Any = None) -> "ColumnShard":
        """The shard of this process in ``group`` (one shard holding everything when torch.distributed is not
        initialised)."""
        if dist.is_available() and dist.is_initialized():
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            if rank < 0:
                raise ValueError("this process is not a member of the given process group")
        elif group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        else:
            rank, size = 0, 1
        return cls(width, rank, size, tuple(column_bounds(width, size)), group)

    @property
    def start(self) -> int:
        return self.bounds[self.rank]

    @property
    def stop(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def columns(self) -> int:
        """Columns held here: ``stop - start``."""
        return self.stop - self.start

    def widths(self) -> list[int]:
        """Columns held by each rank, in rank order."""
        return [b - a for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    def __deepcopy__(self, memo) -> "ColumnShard":
        return self  # immutable, and process groups cannot be copied

    def __reduce__(self):
        raise TypeError("a ColumnShard refers to a live process group and cannot be pickled; save the tensors "
                        "with smf_kernels.sharded.checkpoint instead")


def shard_of(tensor: torch.Tensor) -> ColumnShard | None:
    """The :class:`ColumnShard` of a sharded value table's Parameter, None for any other tensor."""
    return getattr(tensor, SHARD_ATTRIBUTE, None)


def is_split(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a value-table shard whose other columns live on other ranks (group size > 1)."""
    shard = shard_of(tensor)
    return shard is not None and shard.size > 1

