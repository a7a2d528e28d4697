"""The collectives of a column-sharded memory read (docs/sharding.md#one-read-step-by-step), as autograd Functions.

Every rank holds some tokens (``N_r`` of them) and some columns of the value table (``D_r``). A read
then goes:

1. :func:`token_counts`: every rank learns every ``N_s`` and checks that every rank reads with the same
   configuration (an all_to_all of :data:`AGREEMENT_WIDTH` int64 per pair of ranks, of that fixed size
   whatever the configuration or operation, so that ranks that disagree all raise the same error before any
   collective whose sizes depend on it);
2. :class:`GatherReads`: every rank receives every token's slot ids and weights (an all_to_all that
   sends this rank's ``(N_r, L)`` ids, as int32, and weights to every other rank); its backward
   returns to each rank the sum over ranks of the partial weight gradients of its tokens;
3. the local gather over this rank's columns for all ``N`` tokens (any backend);
4. :class:`ExchangeColumns`: each rank sends every other rank its columns of that rank's tokens and
   assembles its own tokens' full rows (an all_to_all); the backward sends the columns of the
   output gradient the other way.

Only torch.distributed collectives are used (gloo on CPU, NCCL on CUDA). :data:`LEDGER` adds up the
bytes this process hands to them for other ranks (what leaves the process; a rank's own chunk is
copied locally) until reset, for the byte model's check.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

from smf_kernels.sharded.layout import ColumnShard

INDEX_LIMIT = 2 ** 31  # slot ids travel as int32: a sharded memory has at most this many slots


class CommLedger:
    """Bytes this process sent to other ranks through the sharded memories' collectives, by collective kind."""

    def __init__(self) -> None:
        self.sent: Counter[str] = Counter()

    def add(self, kind: str, num_bytes: int) -> None:
        self.sent[kind] += int(num_bytes)

    def reset(self) -> None:
        self.sent.clear()


LEDGER = CommLedger()


# What every rank of a group must hold alike for a read's collectives to match (sizes, dtypes, which backward
# collectives run); each rank sends its values with its token count.
READ_FIELDS = ("d_model", "n_keys", "heads", "topk", "key_dim", "value_dim", "values dtype", "weights dtype",
               "weights need grad", "read needs grad")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as an int to send (-1 for one outside float16, bfloat16, float32, float64)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _shown(field: str, value: int) -> str:
    if field.endswith("dtype"):
        return str(_DTYPES[value]).replace("torch.", "") if 0 <= value < len(_DTYPES) else "another dtype"
    if field.endswith("need grad") or field.endswith("needs grad"):
        return "yes" if value else "no"
    return str(value)


# What a rank is doing when it exchanges token counts: every rank must be doing the same.
OPERATIONS = ("a read (forward)", "gather_values")
AGREEMENT_WIDTH = 2 + len(READ_FIELDS)  # int64 per pair of ranks: the count, the operation, the fields (padded)


def token_counts(num_tokens: int, shard: ColumnShard, device: torch.device, agreed: dict[str, int],
                 operation: int = 0) -> list[int]:
    """``N_s`` of every rank of ``shard.group``, in rank order, with a check that the ranks agree: an all_to_all of
    :data:`AGREEMENT_WIDTH` int64 per pair of ranks (the same size for every operation and configuration): the
    token count, ``operation`` (an index into :data:`OPERATIONS`) and this rank's ``agreed`` values (for a read,
    :data:`READ_FIELDS` of the memory; at most that many), padded with -1.

    Raises ValueError, the same on every rank (each receives every rank's values), if the ranks run different
    operations or their ``agreed`` values differ: then no collective whose sizes depend on them is entered.
    """
    if len(agreed) > len(READ_FIELDS):
        raise ValueError(f"agreed holds {len(agreed)} fields, at most {len(READ_FIELDS)} travel with the counts")
    padding = [-1] * (len(READ_FIELDS) - len(agreed))
    mine = torch.tensor([num_tokens, operation, *agreed.values(), *padding], dtype=torch.int64, device=device)
    gathered = _all_to_all(mine.repeat(shard.size), [AGREEMENT_WIDTH] * shard.size, [AGREEMENT_WIDTH] * shard.size,
                           shard, "token_counts").view(shard.size, AGREEMENT_WIDTH).tolist()
    operations = [rank_row[1] for rank_row in gathered]
    if len(set(operations)) > 1:
        doing = ", ".join(f"rank {rank} {OPERATIONS[op] if 0 <= op < len(OPERATIONS) else 'another operation'}"
                          for rank, op in enumerate(operations))
        raise ValueError(f"the ranks of a sharded memory's group run different collectives ({doing}); every rank "
                         "must run each forward and gather_values of the memory together (every rank raises this)")
    differing = []
    for column, field in enumerate(agreed, start=2):
        values = [rank_row[column] for rank_row in gathered]
        if len(set(values)) > 1:
            differing.append(f"{field}: " + ", ".join(f"rank {rank} {_shown(field, value)}"
                                                       for rank, value in enumerate(values)))
    if differing:
        raise ValueError(f"the ranks of a sharded memory's group disagree ({'; '.join(differing)}); every rank "
                         "must build the same memory and run it with the same dtypes, gradients and arguments "
                         "(every rank raises this)")
    return [rank_row[0] for rank_row in gathered]


def _all_to_all(send: torch.Tensor, send_splits: list[int], receive_splits: list[int], shard: ColumnShard,
                kind: str) -> torch.Tensor:
    """all_to_all_single of the 1-D ``send`` (``send_splits[s]`` elements for rank s); returns the 1-D received
    tensor (``receive_splits[s]`` elements from rank s, in rank order)."""
    received = send.new_empty(sum(receive_splits))
    dist.all_to_all_single(received, send, receive_splits, send_splits, group=shard.group)
    LEDGER.add(kind, (sum(send_splits) - send_splits[shard.rank]) * send.element_size())
    return received


def _offsets(counts: list[int]) -> list[int]:
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


class GatherReads(torch.autograd.Function):
    """Every rank's slot ids and weights, on every rank.

    forward(indices (N_r, L) int64, weights (N_r, L) float, counts [N_s], shard)
        -> (indices (N, L) int64, weights (N, L)), rows in rank order (rank s's at ``sum(N_<s)``).
    backward: the weight gradient (N, L) of every rank's gather goes back to the owner of each token and is
    summed over ranks in rank order: (N_r, L). The ids get no gradient.
    """

    @staticmethod
    def forward(ctx, indices, weights, counts, shard):
        num_reads = indices.shape[1]
        ctx.counts, ctx.shard, ctx.num_reads = counts, shard, num_reads
        ids = indices.to(torch.int32).contiguous().view(torch.uint8)  # (N_r, 4L)
        packed = torch.cat([ids, weights.contiguous().view(torch.uint8)], dim=1)  # (N_r, (4 + s) L)
        row_bytes = packed.shape[1]
        send = packed.reshape(-1).repeat(shard.size)  # the same rows for every rank
        received = _all_to_all(send, [packed.numel()] * shard.size, [n * row_bytes for n in counts], shard,
                               "reads")
        received = received.view(-1, row_bytes)
        all_ids = received[:, :4 * num_reads].contiguous().view(torch.int32).to(torch.int64)
        all_weights = received[:, 4 * num_reads:].contiguous().view(weights.dtype)
        ctx.mark_non_differentiable(all_ids)
        return all_ids, all_weights

    @staticmethod
    def backward(ctx, _grad_ids, grad_weights):
        shard, counts = ctx.shard, ctx.counts
        mine = counts[shard.rank]
        if grad_weights is None:
            return None, None, None, None
        grad_weights = grad_weights.contiguous()
        received = _all_to_all(grad_weights.reshape(-1), [n * ctx.num_reads for n in counts],
                               [mine * ctx.num_reads] * shard.size, shard, "read_weight_grads")
        return None, received.view(shard.size, mine, ctx.num_reads).sum(0), None, None


class ExchangeColumns(torch.autograd.Function):
    """This rank's columns of every token's read, traded for every rank's columns of this rank's tokens.

    forward(part (N, D_r), counts [N_s], shard) -> (N_r, D): rank s's columns ``[bounds[s], bounds[s+1])``
    from rank s. backward: (N_r, D) -> (N, D_r), the columns back to the ranks that hold them.
    """

    @staticmethod
    def forward(ctx, part, counts, shard):
        ctx.counts, ctx.shard = counts, shard
        mine, widths = counts[shard.rank], shard.widths()
        received = _all_to_all(part.contiguous().reshape(-1), [n * shard.columns for n in counts],
                               [mine * width for width in widths], shard, "read_columns")
        chunks = received.split([mine * width for width in widths])
        return torch.cat([chunk.view(mine, width) for chunk, width in zip(chunks, widths)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        shard, counts = ctx.shard, ctx.counts
        mine, widths = counts[shard.rank], shard.widths()
        send = torch.cat([grad[:, a:b].reshape(-1) for a, b in zip(shard.bounds[:-1], shard.bounds[1:])])
        received = _all_to_all(send, [mine * width for width in widths], [n * shard.columns for n in counts],
                               shard, "read_column_grads")
        return received.view(sum(counts), shard.columns), None, None


class AverageGradOverGroup(torch.autograd.Function):
    """Identity whose backward divides the gradient by the group size: a shard's gradient, which sums every
    rank's tokens, becomes the average over ranks that data parallelism gives a replicated table. No gradient
    stays none (a fused or deferred step's backward gives the table no .grad), not a dense zero one."""

    @staticmethod
    def forward(ctx, tensor, size):
        ctx.size = size
        ctx.set_materialize_grads(False)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return None if grad is None else grad / ctx.size, None


def token_offset(counts: list[int], rank: int) -> int:
    """Row of rank ``rank``'s first token in the gathered (N, L) tensors."""
    return _offsets(counts)[rank]
