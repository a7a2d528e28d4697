"""The ``torch`` backend, plain PyTorch on any device and the baseline of every "vs torch" figure, as
:class:`Backend`: the base class of every backend, whose methods are the ops' torch implementations, so that a
backend without a kernel for an op runs this one.

Each op is computed the way the authors' pure-PyTorch layer computes it, so that
the baseline is fair: the lookup is einsum + torch.topk (made to follow the
reference's ranking exactly, see :func:`ranked_topk`), the gather is
``F.embedding_bag`` with per-sample weights in the input dtype, and its dense
backward is embedding_bag's own. The row-sparse value gradient (which the
authors' code does not have) is one CSR product that never builds the (M, D)
dense gradient. Same semantics as :mod:`smf_kernels.reference`, without autograd.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from smf_kernels._precision import accumulation_dtype
from smf_kernels._rows import read_targets
from smf_kernels.reference import product_key_topk_reference
from smf_kernels.reference import ranked_topk as _stable_ranked_topk

# Upper bound on elements of a temporary (chunk, L, D) tensor: 16M fp32 = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


def _token_chunks(num_tokens: int, per_token: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, per_token))
    for start in range(0, num_tokens, step):
        yield slice(start, min(num_tokens, start + step))


def ranked_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`smf_kernels.reference.ranked_topk` (NaN first, ties to the lower column) at torch.topk's speed.

    torch.topk's answer is the reference's whenever its k + 1 best scores are
    distinct and not NaN (a tie, inside the k or at the k-th place, is the only
    place torch.topk may order differently); rows with a tie or a NaN go through
    the reference's stable sort. scores (..., C) -> values, int64 columns (..., k).
    """
    width = min(k + 1, scores.shape[-1])
    values, columns = scores.topk(width, dim=-1)
    ambiguous = (values[..., 1:] == values[..., :-1]).any(-1) | values[..., 0].isnan()
    values, columns = values[..., :k].contiguous(), columns[..., :k].contiguous()
    if ambiguous.any():
        rows = ambiguous.nonzero(as_tuple=True)
        values[rows], columns[rows] = _stable_ranked_topk(scores[rows], k)
    return values, columns


def _undominated_pairs(topk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks (ia, ib) with (ia + 1) * (ib + 1) <= topk, in candidate-id order (ia * topk + ib).

    With both halves' scores sorted, pair (ia, ib) is outranked by the (ia + 1) * (ib + 1) - 1
    pairs (i <= ia, j <= ib): at least topk when (ia + 1) * (ib + 1) > topk, so only these
    ~topk * ln(topk) pairs can be among the best topk (for finite scores).
    """
    pairs = [(i, j) for i in range(topk) for j in range(topk) if (i + 1) * (j + 1) <= topk]
    return torch.tensor(pairs, dtype=torch.int64, device=device).unbind(1)


def _sub_key_grad(grad_scores: torch.Tensor, sub_index: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Scatter grad_scores (N, H, k) onto the sub-keys they came from: (N, H, n_keys).

    A sub-key can be shared by several of the k pairs, so this accumulates;
    index_put_(accumulate=True) is deterministic under use_deterministic_algorithms.
    """
    num_tokens, heads, _ = grad_scores.shape
    rows = torch.arange(num_tokens * heads, device=grad_scores.device).view(num_tokens, heads, 1) * n_keys
    dense = grad_scores.new_zeros(num_tokens * heads * n_keys)
    dense.index_put_(((rows + sub_index).flatten(),), grad_scores.flatten(), accumulate=True)
    return dense.view(num_tokens, heads, n_keys)


def _backward_by_dense_sub_key_grads(grad_scores, query, keys, indices, need_query, need_keys):
    """The sub-key gradients scattered into dense (N, H, n_keys) tensors, then einsums."""
    n_keys, half = keys.shape[2], keys.shape[3]
    dtype = grad_scores.dtype
    g1 = _sub_key_grad(grad_scores, torch.div(indices, n_keys, rounding_mode="floor"), n_keys)
    g2 = _sub_key_grad(grad_scores, indices % n_keys, n_keys)
    grad_query = grad_keys = query.new_empty(0, dtype=dtype)
    if need_query:
        k = keys.to(dtype)
        grad_query = torch.cat(
            [torch.einsum("nhk,hkd->nhd", g1, k[:, 0]), torch.einsum("nhk,hkd->nhd", g2, k[:, 1])], dim=-1)
    if need_keys:
        q = query.to(dtype)
        grad_keys = torch.stack(
            [torch.einsum("nhk,nhd->hkd", g1, q[..., :half]), torch.einsum("nhk,nhd->hkd", g2, q[..., half:])], dim=1)
    return grad_query, grad_keys


def _reads_a_row_twice(indices: torch.Tensor) -> bool:
    """Whether some token (row of indices (N, L)) holds one row id more than once."""
    if indices.shape[1] < 2:
        return False
    ordered = indices.sort(dim=1).values
    return bool((ordered[:, 1:] == ordered[:, :-1]).any())


def gather_backward_weights(grad_out, values, indices):
    """grad_w[n, l] = values[indices[n, l]] . grad_out[n].

    CPU: one sampled dense-dense product (SDDMM) over the (N, M) read pattern:
    each entry is its own dot product (deterministic), and the (N, L, D) gathered
    rows are never materialised. The CSR pattern cannot hold one (token, row) pair
    twice, so where a token reads a row more than once (heads share the value table),
    and elsewhere than on CPU: gathered rows times grad_out, a chunk of tokens at a time.
    """
    num_tokens, per_token = indices.shape
    dtype = accumulation_dtype(values.dtype)
    if values.device.type == "cpu" and not _reads_a_row_twice(indices):
        crow = torch.arange(0, num_tokens * per_token + 1, per_token)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            pattern = torch.sparse_csr_tensor(crow, indices.reshape(-1), torch.zeros(indices.numel(), dtype=dtype),
                                              (num_tokens, values.shape[0]), check_invariants=False)
            sampled = torch.sparse.sampled_addmm(pattern, grad_out.to(dtype), values.to(dtype).t())
        return sampled.values().view(num_tokens, per_token)
    grad_weights = torch.empty(indices.shape, dtype=dtype, device=values.device)
    for part in _token_chunks(num_tokens, per_token * values.shape[1]):
        rows = values[indices[part]].to(dtype)  # (chunk, L, D)
        grad_weights[part] = torch.bmm(rows, grad_out[part].to(dtype).unsqueeze(-1)).squeeze(-1)
    return grad_weights


def _sum_reads_by_target(grad_out, weights, targets, out_rows):
    """fp32 (out_rows, D): row t = sum of w[n, l] * grad_out[n] over reads with targets[n * L + l] == t.

    CPU: one CSR (out_rows, N) x (N, D) product, computed row by row, hence
    deterministic. Elsewhere: index_put_(accumulate=True), deterministic under
    torch.use_deterministic_algorithms(True).
    """
    num_tokens, per_token = weights.shape
    dim = grad_out.shape[1]
    grad_out = grad_out.to(accumulation_dtype(grad_out.dtype))
    flat_weights = weights.reshape(-1).to(grad_out.dtype)
    if grad_out.device.type == "cpu":
        order = targets.argsort(stable=True)
        crow = torch.zeros(out_rows + 1, dtype=torch.int64)
        crow[1:] = torch.bincount(targets, minlength=out_rows).cumsum(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            reads = torch.sparse_csr_tensor(crow, torch.div(order, per_token, rounding_mode="floor"),
                                            flat_weights[order], (out_rows, num_tokens), check_invariants=False)
        return reads @ grad_out
    grad = torch.zeros(out_rows, dim, dtype=grad_out.dtype, device=grad_out.device)
    targets = targets.view(num_tokens, per_token)
    for part in _token_chunks(num_tokens, per_token * dim):
        contrib = flat_weights.view(num_tokens, per_token)[part].unsqueeze(-1) * grad_out[part].unsqueeze(1)
        grad.index_put_((targets[part].flatten(),), contrib.reshape(-1, dim), accumulate=True)
    return grad


def gather_backward_values(grad_out, indices, weights, num_rows, update_rows, deterministic):
    targets, out_rows = read_targets(indices.reshape(-1), update_rows, num_rows)
    grad = _sum_reads_by_target(grad_out, weights, targets, out_rows)
    return grad if update_rows is None else grad[:-1]


def _embedding_bag_backward(grad_out, values, indices, weights, need_values, need_weights, update_rows=None):
    """Both gradients in values' dtype, by the ATen functions F.embedding_bag's autograd calls
    (called directly: a custom op's body runs below autograd). Either may be None. With
    ``update_rows`` (T,) the value gradient is (T, D): rows update_rows only."""
    num_tokens, per_token = indices.shape
    flat = indices.reshape(-1)
    grad_out = grad_out.to(values.dtype)
    bag_of_read = torch.arange(num_tokens, device=indices.device).repeat_interleave(per_token)
    grad_values = grad_weights = None
    if need_values:
        targets, out_rows = read_targets(flat, update_rows, values.shape[0])
        bag_size = torch.full((num_tokens,), per_token, dtype=torch.int64, device=indices.device)
        grad_values = torch.ops.aten._embedding_bag_dense_backward(
            grad_out, targets, bag_of_read, bag_size, flat.new_empty(0), out_rows, False, 0,
            weights.reshape(-1).to(values.dtype), -1)
        if update_rows is not None:
            grad_values = grad_values[:-1]
    if need_weights:
        offsets = torch.arange(0, num_tokens * per_token, per_token, device=indices.device)
        grad_weights = torch.ops.aten._embedding_bag_per_sample_weights_backward(
            grad_out, values, flat, offsets, bag_of_read, 0, -1).view(num_tokens, per_token)
    return grad_values, grad_weights


class Backend:
    """A backend: the implementation the ops dispatch to. This class is the ``torch`` one; a subclass
    (:class:`~smf_kernels.backends.ext_impl.ExtBackend`, :class:`~smf_kernels.backends.triton_impl.TritonBackend`)
    overrides the methods it has kernels for and calls ``super()`` where its kernel does not apply (a device, a
    dtype, a layout), so every op runs on every backend: the torch implementation where a backend lacks one.

    The ops (:mod:`smf_kernels.ops`) validate arguments and hand the methods ``indices``, ``weights``, ``valid``,
    ``update_rows``, ``grad_out`` and ``grad_scores`` contiguous; ``values``, ``counts`` (written in place),
    ``query`` and ``keys`` may be strided views. Gradients come back in the accumulation dtype
    (:func:`~smf_kernels._precision.accumulation_dtype`: fp32, fp64 for fp64); a gradient not needed has 0 rows.
    """

    name = "torch"
    #: dtypes the backend's kernels take (None: any); the automatic choice skips a backend for other dtypes
    supported_dtypes: tuple[torch.dtype, ...] | None = None
    #: whether the kernels check every id and row they read through on CUDA (the ops then skip the host check)
    kernels_guard_indices = False

    def unavailable_reason(self, device: torch.device) -> str | None:
        """None if the backend runs on ``device``, else why not."""
        return None

    def __repr__(self) -> str:
        return f"<smf_kernels backend {self.name!r}>"

    def prepare_topk_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The layout of keys (H, 2, n_keys, key_dim // 2) that :meth:`topk_forward` reads, for a caller to make
        once and hand back as ``key_layout`` while the keys are unchanged
        (:class:`~smf_kernels.ops.KeyLayoutCache`); None where the keys are read as they are. Here: float32 keys
        for 16-bit ones."""
        return keys.float() if keys.dtype in (torch.bfloat16, torch.float16) else None

    def topk_forward(self, query: torch.Tensor, keys: torch.Tensor, topk: int,
                     key_layout: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The authors' lookup: two einsums and top-k of each half, then the top-k of their sums, in fp32
        (fp64 stays fp64: the reference's sort). The sums are taken only over the pairs that can win
        (:func:`_undominated_pairs`) unless a half has a non-finite score; the result is the same.
        query (N, H, key_dim), keys (H, 2, n_keys, key_dim // 2) -> scores (N, H, topk), int64 slots (N, H, topk);
        key_layout: :meth:`prepare_topk_keys` of these keys, or None to lay them out here."""
        if query.dtype == torch.float64:
            with torch.no_grad():
                return product_key_topk_reference(query, keys, topk)
        n_keys, half = keys.shape[2], keys.shape[3]
        q, k = query.float(), keys.float() if key_layout is None else key_layout
        a, i = ranked_topk(torch.einsum("nhd,hkd->nhk", q[..., :half], k[:, 0]), topk)
        b, j = ranked_topk(torch.einsum("nhd,hkd->nhk", q[..., half:], k[:, 1]), topk)
        if bool(a.isfinite().all() and b.isfinite().all()):
            first, second = _undominated_pairs(topk, query.device)
            scores, best = ranked_topk(a[..., first] + b[..., second], topk)
            ia, ib = first[best], second[best]
        else:  # every candidate c = ia * topk + ib
            scores, best = ranked_topk((a.unsqueeze(-1) + b.unsqueeze(-2)).flatten(-2), topk)
            ia, ib = torch.div(best, topk, rounding_mode="floor"), best % topk
        return scores, i.gather(-1, ia) * n_keys + j.gather(-1, ib)

    def topk_backward(self, grad_scores, query, keys, indices, need_query, need_keys):
        """(grad_query (N, H, key_dim), grad_keys (H, 2, n_keys, key_dim // 2)) in grad_scores' dtype, from the
        sub-key gradients scattered into dense (N, H, n_keys) tensors."""
        return _backward_by_dense_sub_key_grads(grad_scores, query, keys, indices, need_query, need_keys)

    def gather_forward(self, values, indices, weights, counts, valid):
        """out (N, D) in values' dtype, by the authors' gather: F.embedding_bag; the reads added to ``counts``
        (M,) in place (reads of tokens with ``valid`` (N,) False left out), with no (M,) histogram per call."""
        out = F.embedding_bag(indices, values, per_sample_weights=weights.to(values.dtype), mode="sum")
        if counts is not None:
            read = (indices if valid is None else indices[valid]).flatten()
            counts.index_put_((read,), torch.ones((), dtype=counts.dtype, device=counts.device).expand(read.numel()),
                              accumulate=True)
        return out

    def gather_backward(self, grad_out, values, indices, weights, update_rows, deterministic, need_values,
                        need_weights):
        """Gradients from embedding_bag's backward (on CPU always; elsewhere unless deterministic, its
        CUDA value gradient using atomics); on CPU the row-sparse value gradient from one CSR product."""
        dtype = accumulation_dtype(values.dtype)
        by_bag = values.device.type == "cpu" or not deterministic
        # The sparse value gradient too, off CPU (index_put_ took 0.7 s at the paper size on an H100);
        # on CPU the CSR product below is the faster one.
        bag_values = by_bag and need_values and (update_rows is None or values.device.type != "cpu")
        # ATen's CUDA per-sample-weights backward has no bfloat16 kernel (torch 2.11).
        bag_weights = by_bag and need_weights and (values.device.type == "cpu" or values.dtype != torch.bfloat16)
        grad_values = grad_out.new_empty(0, values.shape[1], dtype=dtype)
        grad_weights = grad_out.new_empty(0, indices.shape[1], dtype=dtype)
        if bag_values or bag_weights:
            from_values, from_weights = _embedding_bag_backward(grad_out, values, indices, weights, bag_values,
                                                                bag_weights, update_rows)
            grad_values = from_values.to(dtype) if bag_values else grad_values
            grad_weights = from_weights.to(dtype) if bag_weights else grad_weights
        if need_values and not bag_values:
            grad_values = gather_backward_values(grad_out, indices, weights, values.shape[0], update_rows,
                                                 deterministic)
        if need_weights and not bag_weights:
            grad_weights = gather_backward_weights(grad_out, values, indices)
        return grad_values, grad_weights

    def gather_backward_into(self, grad_out, values, indices, weights, update_rows, sink, deterministic,
                             need_weights):
        """:meth:`gather_backward`'s (T, D) value gradient of rows ``update_rows`` added into ``sink`` (T, D) in
        place; returns grad_weights (N, L), or (0, L) without need_weights."""
        compact, grad_weights = self.gather_backward(grad_out, values, indices, weights, update_rows, deterministic,
                                                     True, need_weights)
        sink += compact
        return grad_weights

    def silu_mul_forward(self, gate, read):
        """silu(gate) * read, the plain composition (same shape and dtype)."""
        return F.silu(gate) * read

    def silu_mul_backward(self, grad, gate, read):
        """(grad of gate, grad of read) in gate's dtype: silu'(x) = s (1 + x (1 - s)), s = sigmoid(x), in fp32
        (fp64 for fp64)."""
        g, x, r = (t.to(accumulation_dtype(gate.dtype)) for t in (grad, gate, read))
        s = torch.sigmoid(x)
        return (g * r * (s * (1 + x * (1 - s)))).to(gate.dtype), (g * (x * s)).to(gate.dtype)

    def row_adamw(self, param, exp_avg, exp_avg_sq, row_step, rows, grad, valid, lr, grad_scale, beta1, beta2,
                  eps, weight_decay, state_slots=None):
        """:class:`~smf_kernels.sparse.RowSparseAdamW`'s row update, op for op (index_select, the update in the
        parameter's dtype with fp32 / fp64 factors, index_copy_); a row with ``valid`` False gets its old bits back.
        The moments and step counts are read and written at ``state_slots`` (T,) when given, else at ``rows``."""
        slots = rows if state_slots is None else state_slots
        g = grad if grad_scale is None else grad * grad_scale
        g = g.to(param.dtype)
        old_steps = row_step.index_select(0, slots)
        steps = old_steps + 1
        exp_avg_rows = exp_avg.index_select(0, slots)
        exp_avg_sq_rows = exp_avg_sq.index_select(0, slots)
        new_exp_avg = exp_avg_rows.clone().lerp_(g, 1 - beta1)
        new_exp_avg_sq = exp_avg_sq_rows.clone().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        factor_dtype = accumulation_dtype(param.dtype)  # never round the factors to bf16
        steps64 = steps.to(torch.float64)
        step_size = (lr / (1 - torch.pow(beta1, steps64))).to(factor_dtype).unsqueeze(1)  # (T, 1)
        bias_correction2_sqrt = (1 - torch.pow(beta2, steps64)).sqrt().to(factor_dtype).unsqueeze(1)
        denom = (new_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param_rows = param.index_select(0, rows)
        updated = param_rows.clone()
        if weight_decay != 0:
            updated.mul_(1 - lr * weight_decay)
        updated.sub_(new_exp_avg / denom * step_size)
        if valid is not None:  # rows that were not selected keep their bits
            keep = valid.unsqueeze(1)
            steps = torch.where(valid, steps, old_steps)
            new_exp_avg = torch.where(keep, new_exp_avg, exp_avg_rows)
            new_exp_avg_sq = torch.where(keep, new_exp_avg_sq, exp_avg_sq_rows)
            updated = torch.where(keep, updated, param_rows)
        row_step.index_copy_(0, slots, steps)
        exp_avg.index_copy_(0, slots, new_exp_avg)
        exp_avg_sq.index_copy_(0, slots, new_exp_avg_sq)
        param.index_copy_(0, rows, updated)


BACKEND = Backend()
