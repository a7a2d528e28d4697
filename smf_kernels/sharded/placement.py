"""Where a parameter lives over the data-parallel processes, as one object the sparse step and the optimizer call
without asking what it is (docs/sharding.md): :func:`placement_of` gives a parameter's.

- :class:`Replicated`: the whole tensor on every process (one process, DDP, a memory left out of FSDP2); its
  gradient is one copy per process, averaged over them.
- :class:`ColumnSharded`: a value table split by columns over a process group (:mod:`smf_kernels.sharded`,
  ``--shard-memories``): the sharded read sums every process's tokens into each shard, so its gradient needs no
  reduction, only the division by the group's size; its norm is the whole table's (the shards' squared norms
  summed over the group); its columns and their optimizer state are saved one file per process
  (:mod:`smf_kernels.sharded.checkpoint`).
- :class:`MeshSharded`: a DTensor (FSDP2's ``fully_shard``): this process holds a part of it (``to_local()``),
  its norm summed over the mesh's group when it is sharded; FSDP reduces its gradient itself.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from smf_kernels.sharded.layout import ColumnShard, shard_of

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the data-parallel processes, in place


class NormPart(NamedTuple):
    """A gradient that is this process's part of a parameter's: its squared norm is summed over ``group``."""

    group: Any


class Placement:
    """The interface every placement has (see the module docstring).

    ``whole_rows``: this process holds whole rows of the table (a row optimizer may keep its compact state);
    ``norm_part``: a :class:`NormPart` when the local gradient is a part of the parameter's, else None;
    ``saved_apart``: its columns are saved in per-process shard files, not in the replicated checkpoint."""

    whole_rows = True
    norm_part: NormPart | None = None
    saved_apart = False

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This process's part of ``tensor`` (the parameter, or its gradient)."""
        return tensor

    def average_rows(self, grad: torch.Tensor, world: int, all_reduce: AllReduce) -> torch.Tensor:
        """``grad``, this process's compact gradient of rows of the table (the step's read of this process's
        tokens), averaged over the ``world`` data-parallel processes, in place."""
        return self.average_copies(grad, world, all_reduce)

    def average_copies(self, grad: torch.Tensor, world: int, all_reduce: AllReduce) -> torch.Tensor:
        """``grad``, this process's dense gradient of the table, averaged over the processes holding copies of
        it (:meth:`copies`), in place."""
        copies = self.copies(world)
        if copies > 1:
            all_reduce(grad)
            grad.div_(copies)
        return grad

    def copies(self, world: int) -> int:
        """Over how many of ``world`` data-parallel processes the gradient must still be averaged."""
        return world


class Replicated(Placement):
    """The whole tensor on every process."""


@dataclass(frozen=True)
class ColumnSharded(Placement):
    """A value table's columns ``shard`` of a table split over ``shard.group`` (one shard of a group of one
    holds the whole table and averages as :class:`Replicated`; it is still saved apart)."""

    shard: ColumnShard
    whole_rows = False
    saved_apart = True

    @property
    def norm_part(self) -> NormPart | None:
        return NormPart(self.shard.group) if self.shard.size > 1 else None

    def average_rows(self, grad: torch.Tensor, world: int, all_reduce: AllReduce) -> torch.Tensor:
        """A column shard's read sums every process's tokens, so its gradient is divided by its group's size
        (as :mod:`smf_kernels.sharded` averages the autograd gradient) and needs no reduction."""
        if self.shard.size > 1:
            grad.div_(self.shard.size)
        return self.average_copies(grad, world, all_reduce)

    def copies(self, world: int) -> int:
        """1 for a split table, whose gradient the sharded read already averages over its group; ``world`` for a
        group of one. ValueError for a group smaller than ``world`` (copies of shards across groups are not
        supported yet, docs/sharding.md#beyond-one-group)."""
        if self.shard.size == 1:
            return world
        if self.shard.size != world:
            raise ValueError(f"a value table is split over {self.shard.size} ranks but gradients are averaged over "
                             f"{world}; split it over the same ranks as the data (the default process group)")
        return 1


@dataclass(frozen=True)
class MeshSharded(Placement):
    """A DTensor laid out by ``placements`` over ``mesh`` (FSDP2)."""

    mesh: Any
    placements: tuple
    whole_rows = False

    @property
    def norm_part(self) -> NormPart | None:
        sharded = any(placement.is_shard() for placement in self.placements)
        return NormPart(self.mesh.get_group()) if sharded else None

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local()

    def average_rows(self, grad: torch.Tensor, world: int, all_reduce: AllReduce) -> torch.Tensor:
        raise ValueError("a value table under FSDP2 cannot step by rows: keep the memories out of fully_shard "
                         "(ignored_params), as smf train --fsdp and SparseMemoryTrainer do")

    def copies(self, world: int) -> int:
        return 1  # FSDP reduces its gradients itself


def placement_of(param: torch.Tensor) -> Placement:
    """``param``'s :class:`Placement`: a DTensor's, a column shard's (:func:`~smf_kernels.sharded.layout.shard_of`),
    or :class:`Replicated`."""
    if isinstance(param, DTensor):
        return MeshSharded(param.device_mesh, tuple(param.placements))
    shard = shard_of(param)
    return Replicated() if shard is None else ColumnSharded(shard)

