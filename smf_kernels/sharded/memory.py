"""ShardedProductKeyMemory: a product-key memory whose value table is split by columns over the ranks of a
process group (docs/sharding.md); everything else (query projection, keys, gate and output projections,
read counts) is replicated."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from smf_kernels.memory import ProductKeyMemory, draw_normal_rows
from smf_kernels.ops import silu_mul, weighted_gather
from smf_kernels.sharded.exchange import (INDEX_LIMIT, AverageGradOverGroup, ExchangeColumns, GatherReads,
                                          OPERATIONS, READ_FIELDS, dtype_code, token_counts, token_offset)
from smf_kernels.sharded.layout import SHARD_ATTRIBUTE, ColumnShard

class ShardedProductKeyMemory(ProductKeyMemory):
    """:class:`~smf_kernels.ProductKeyMemory` whose ``values`` hold only this rank's columns of the table.

    Args: those of ProductKeyMemory, and ``group``: the torch.distributed process group the value columns are
    split over (None: the default group; without torch.distributed, one rank holds every column).

    ``values`` is (num_slots, D_r), columns ``[shard.start, shard.stop)`` of the (num_slots, value_dim) table
    (:attr:`shard`, a :class:`ColumnShard`); ``config()`` is the unsharded layer's. Every rank of the group must
    run each forward (and backward) together, each on its own tokens: a forward gathers every rank's slot ids
    and weights, reads this rank's columns for all of them with the chosen backend and trades columns back
    (three all_to_all collectives; the backward one more, two when the lookup trains). The output, read
    counts and update rows are those
    of the unsharded layer on this rank's tokens: counts stay per rank (sum them over ranks as for data
    parallelism).

    Gradients follow data parallelism: the replicated parameters get this rank's gradient (average them
    over ranks, e.g. with DDP), and ``values`` gets the average over ranks of every rank's gradient for these
    columns (as DDP would give a replicated table), so it needs no reduction. Keep ``values`` (and
    ``read_counts``) out of DDP: see :func:`ddp_ignored_names`.

    A fresh module draws the whole table's random stream and keeps its columns, so on CPU its values equal
    those columns of a ``ProductKeyMemory`` built from the same seed (and the RNG ends in the same state).
    """

    def __init__(self, d_model: int, n_keys: int = 128, heads: int = 4, topk: int = 16, key_dim: int = 256,
                 value_dim: int | None = None, *, backend: str | None = None, group=None) -> None:
        # _empty_values() runs inside the base constructor and needs the group: a plain attribute may be set
        # before nn.Module.__init__, and is dropped there.
        self._pending_group = group
        super().__init__(d_model, n_keys, heads, topk, key_dim, value_dim, backend=backend)

    def _empty_values(self) -> torch.Tensor:
        if self.num_slots > INDEX_LIMIT:
            raise ValueError(f"a sharded memory sends slot ids as int32: n_keys**2 must be <= 2**31, got "
                             f"{self.num_slots}")
        group = self.__dict__.pop("_pending_group", None)
        self.shard = ColumnShard.of_group(self.value_dim, group)
        return torch.empty(self.num_slots, self.shard.columns)

    @torch.no_grad()
    def _init_values(self) -> None:
        """The whole table's normal draws, a block of rows at a time (:func:`~smf_kernels.memory.draw_normal_rows`:
        on CPU exactly what one call over the table would draw), keeping this rank's columns."""
        self._tag_values()
        if self.values.device.type == "meta":
            return
        shard = self.shard
        draw_normal_rows(self.num_slots, self.value_dim, self.value_dim ** -0.5, self.values.device,
                         lambda start, stop, block: self.values[start:stop].copy_(block[:, shard.start:shard.stop]),
                         dtype=self.values.dtype)

    def _tag_values(self) -> None:
        setattr(self.values, SHARD_ATTRIBUTE, self.shard)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._tag_values()  # a device move may have put a new Parameter in place
        return self

    def _read_values(self, indices: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None,
                     gate: torch.Tensor, backend: str) -> torch.Tensor:
        shard = self.shard
        if shard.size == 1:
            return super()._read_values(indices, weights, valid, gate, backend)
        num_tokens = indices.shape[0]
        reads_grad = torch.is_grad_enabled() and (self.values.requires_grad or weights.requires_grad)
        counts = token_counts(num_tokens, shard, indices.device,
                              self._agreed(weights.dtype, weights.requires_grad, reads_grad))
        all_indices, all_weights = GatherReads.apply(indices, weights, counts, shard)
        counting = self.count_reads
        all_valid = None
        if counting:  # count this rank's tokens only, in the same pass as the gather
            all_valid = torch.zeros(all_indices.shape[0], dtype=torch.bool, device=indices.device)
            start = token_offset(counts, shard.rank)
            all_valid[start:start + num_tokens] = True if valid is None else valid
        part = weighted_gather(
            AverageGradOverGroup.apply(self.values, shard.size), all_indices, all_weights,
            counts=self.read_counts if counting else None, valid=all_valid, grad_sink=self.grad_sink,
            backend=backend,
        )
        read = ExchangeColumns.apply(part, counts, shard)
        return silu_mul(gate, read.to(gate.dtype), backend=backend)  # the gate acts on whole rows

    def _agreed(self, weights_dtype: torch.dtype, weights_need_grad: bool, read_needs_grad: bool) -> dict[str, int]:
        """This rank's values of :data:`~smf_kernels.sharded.exchange.READ_FIELDS` for a read (sent with the token
        counts, so that ranks that disagree raise before the collectives whose sizes depend on them)."""
        return dict(zip(READ_FIELDS, (self.d_model, self.n_keys, self.heads, self.topk, self.key_dim, self.value_dim,
                                      dtype_code(self.values.dtype), dtype_code(weights_dtype),
                                      int(weights_need_grad), int(read_needs_grad)), strict=True))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Also accepts the unsharded layer's (num_slots, value_dim) ``values`` and keeps this rank's columns."""
        key = prefix + "values"
        full = state_dict.get(key)
        if (isinstance(full, torch.Tensor) and full.dim() == 2 and full.shape[1] == self.value_dim
                and self.shard.columns != self.value_dim):
            state_dict[key] = full[:, self.shard.start:self.shard.stop]  # in place, as the base class renames
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @classmethod
    def from_memory(cls, memory: ProductKeyMemory, group=None) -> "ShardedProductKeyMemory":
        """A sharded copy of ``memory`` (same device, dtypes, backend, requires_grad flags and state), holding
        this rank's columns of its values; draws no random numbers. ``memory`` is left as it was."""
        if isinstance(memory, ShardedProductKeyMemory):
            raise ValueError("memory is sharded already")
        with torch.device("meta"):
            sharded = cls(**memory.config(), backend=memory.backend, group=group)
        sharded.to_empty(device=memory.values.device)
        columns = slice(sharded.shard.start, sharded.shard.stop)
        _copy_state(sharded, {name: param[:, columns] if name == "values" else param
                              for name, param in memory.named_parameters()}, memory.named_buffers())
        for name, param in memory.named_parameters():
            sharded.get_parameter(name).requires_grad_(param.requires_grad)
        sharded.count_reads, sharded.grad_sink = memory.count_reads, memory.grad_sink
        sharded.train(memory.training)
        return sharded

    @torch.no_grad()
    def gather_values(self, dst: int = 0) -> torch.Tensor | None:
        """The whole (num_slots, value_dim) table on CPU at rank ``dst`` of the group (None on the other ranks).
        Collective: every rank of the group calls it. Point-to-point sends, so ``dst`` holds the table and one
        shard at a time."""
        shard = self.shard
        if shard.size == 1:
            return self.values.detach().cpu().clone() if shard.rank == dst else None
        # every rank checks (one small collective) that all hold the same table and name the same dst, so that
        # the sends below match; a bad dst is refused alike on every rank, after the check
        chosen = dst if isinstance(dst, int) and not isinstance(dst, bool) and -2 ** 63 <= dst < 2 ** 63 else -1
        config = self.config()
        token_counts(0, shard, self.values.device, {"n_keys": config["n_keys"], "value_dim": config["value_dim"],
                                                    "values dtype": dtype_code(self.values.dtype), "dst": chosen},
                     operation=OPERATIONS.index("gather_values"))
        if chosen != dst or not 0 <= dst < shard.size:
            raise ValueError(f"dst must be a rank of the group, an int in [0, {shard.size}), got {dst!r}")
        global_dst = dist.get_global_rank(shard.group, dst) if shard.group is not None else dst
        if shard.rank != dst:
            dist.send(self.values.detach().contiguous(), global_dst, group=shard.group)
            return None
        full = torch.empty(self.num_slots, self.value_dim, dtype=self.values.dtype)
        for source in range(shard.size):
            start, stop = shard.bounds[source], shard.bounds[source + 1]
            if source == dst:
                full[:, start:stop].copy_(self.values.detach())
                continue
            buffer = self.values.new_empty(self.num_slots, stop - start)
            global_source = dist.get_global_rank(shard.group, source) if shard.group is not None else source
            dist.recv(buffer, global_source, group=shard.group)
            full[:, start:stop].copy_(buffer)
        return full

    def unsharded_copy(self, values: torch.Tensor) -> ProductKeyMemory:
        """A plain ProductKeyMemory on CPU with this module's replicated state and ``values`` (e.g. from
        :meth:`gather_values`)."""
        with torch.device("meta"):
            memory = ProductKeyMemory(**self.config(), backend=self.backend)
        memory.to_empty(device="cpu")
        params = {name: values if name == "values" else param.cpu() for name, param in self.named_parameters()}
        _copy_state(memory, params, ((name, buffer.cpu()) for name, buffer in self.named_buffers()))
        return memory

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, columns [{self.shard.start}, {self.shard.stop}) of {self.value_dim} on "
                f"rank {self.shard.rank} of {self.shard.size}")


@torch.no_grad()
def _copy_state(module: nn.Module, params: dict[str, torch.Tensor], buffers) -> None:
    """Give ``module``'s parameters the dtypes and contents of ``params`` (name -> tensor of the parameter's
    shape) and its buffers the contents of ``buffers`` ((name, tensor) pairs)."""
    for name, source in params.items():
        target = module.get_parameter(name)
        if target.dtype != source.dtype:
            target.data = torch.empty_like(target, dtype=source.dtype)
        target.copy_(source)
    for name, buffer in buffers:
        module.get_buffer(name).copy_(buffer)


def shard_memories(model: nn.Module, group=None) -> list[str]:
    """Replace every (unsharded) ProductKeyMemory in ``model`` by a :class:`ShardedProductKeyMemory` copy
    (:meth:`~ShardedProductKeyMemory.from_memory`) split over ``group``, in place; returns their names.

    Do this before building optimizers, DDP or a SparseMemoryController (they hold the old parameters).
    """
    names = [name for name, module in model.named_modules() if type(module) is ProductKeyMemory]
    if not names:
        raise ValueError("model holds no unsharded ProductKeyMemory module")
    if names == [""]:
        raise ValueError("model is itself a ProductKeyMemory; use ShardedProductKeyMemory.from_memory")
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, ShardedProductKeyMemory.from_memory(getattr(parent, attr), group))
    return names


def sharded_memories(model: nn.Module) -> dict[str, ShardedProductKeyMemory]:
    """The ShardedProductKeyMemory modules of ``model`` by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, ShardedProductKeyMemory)}


def ddp_ignored_names(model: nn.Module) -> list[str]:
    """Names DDP must leave alone in ``model``: each sharded memory's ``values`` (different on every rank;
    DDP's start-up broadcast would overwrite them) and ``read_counts`` (per-rank counts)."""
    return [f"{name}.{field}" for name in sharded_memories(model) for field in ("values", "read_counts")]


@contextmanager
def unsharded_memories(model: nn.Module, dst: int = 0) -> Iterator[None]:
    """Within the block, rank ``dst`` of each memory's group holds plain ProductKeyMemory copies with the whole
    tables on CPU in place of the sharded memories (e.g. to save an adapter with
    ``smf.model.save_memory_adapter``); the other ranks keep theirs. Collective: every rank enters it. The
    sharded modules are put back afterwards."""
    swapped = []
    try:
        for name, memory in sharded_memories(model).items():
            values = memory.gather_values(dst)
            if values is None:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, memory.unsharded_copy(values))
            swapped.append((parent, attr, memory))
        yield
    finally:
        for parent, attr, memory in swapped:
            setattr(parent, attr, memory)
