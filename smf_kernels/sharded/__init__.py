"""Memories larger than one device: value tables split by columns over the ranks of a torch.distributed
process group, with SMF (read counts, selection, row-sparse AdamW) unchanged (docs/sharding.md).

Usage, in every process of the group (e.g. under torchrun)::

    from smf_kernels.sharded import ShardedProductKeyMemory, ddp_ignored_names, shard_memories

    memory = ShardedProductKeyMemory(896, n_keys=1024, heads=4, topk=16, key_dim=256)   # a fresh one, or
    shard_memories(model)                      # every ProductKeyMemory of a built model, in place
    controller = SparseMemoryController(model, ...)     # unchanged: counts summed over ranks, same rows
    optimizer = RowSparseAdamW(...)                      # each rank updates its columns of the T rows

Checkpoints: :mod:`smf_kernels.sharded.checkpoint` writes one file per rank and loads onto any number of ranks.
"""
from smf_kernels.sharded.exchange import LEDGER, CommLedger
from smf_kernels.sharded.layout import ColumnShard, column_bounds, is_split, shard_of
from smf_kernels.sharded.memory import (ShardedProductKeyMemory, ddp_ignored_names, shard_memories,
                                        sharded_memories, unsharded_memories)

__all__ = [
    "LEDGER",
    "ColumnShard",
    "CommLedger",
    "ShardedProductKeyMemory",
    "column_bounds",
    "ddp_ignored_names",
    "is_split",
    "shard_memories",
    "shard_of",
    "sharded_memories",
    "unsharded_memories",
]
