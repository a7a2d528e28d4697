"""Triton kernels: weighted gather + read histogram, and its backward, without host syncs.

Each launcher is split into a ``plan_*`` function returning the :class:`LaunchPlan` it launches,
which benchmarks/triton_aot.py compiles for sm_90 / sm_80. Every kernel accumulates in fp32 and
tiles the value row in BLOCK_D columns, so any width D works (896 is not a power of two).

Every access through an id loaded from ``indices`` is masked by :func:`guards.in_range`: an
out-of-range id reads and writes nothing and raises the launch's error flag, which the launcher
turns into a Python error (the host-side checks do not run while torch.compile traces).

* gather_forward_kernel: out[n] = sum_l w[n,l] * V[idx[n,l]]; the first column
  tile of each token block also bumps counts[idx] for valid tokens (relaxed
  integer atomics: exact and order-independent). Up to D = 1024 one tile holds
  the whole row, so a token loads its ids and weights once.

The backward is row-owned, one path whatever torch.use_deterministic_algorithms says:

* read_keys_kernel: each read's row as its sort key (int16 while M < 32,768) and each row's read
  count (integer atomics). torch.sort (stable) then orders the reads by row, a cumsum of the
  counts gives each row's segment, an argsort lists the rows heaviest first.
* row_backward_kernel: one program (one warp) owns a row: it loads the value row once, walks the
  row's reads in sorted order, adds w * grad_out[token] to the row's gradient in registers and
  writes each read's dW = V[row] . grad_out[token]; the finished row leaves through
  _finish_row_tile, written once. No float atomics, so every run gives the same bits.
  T-row mode: programs cover every row, since dW is owed for every read; a row without an
  output slot skips the w * grad_out sums and writes dW only. Without dW, only the T selected
  rows are owned.

Load balance: the rows run heaviest first (longest-processing-time-first, as Meta's memory-layer
kernel orders rows by count), so a popular row starts at once instead of finishing last. One
program walks a row at ~one read per L2 round trip (~0.3-0.5 us), so a row read R times takes
~R x 0.4 us: hidden behind the rest while that stays under the whole pass (R below ~700, 11x the
paper size's mean of 64); a row read more often sets the pass's length (splitting such rows over
several programs, with their partial rows summed in a fixed order, is the lever if that shows).

The token-major atomic backward (dense 1.36 ms bf16 / 1.45 ms fp32, T rows 0.63 / 0.70 ms on an
H100) and its sorted-segment deterministic twin (2.5-2.7 ms) are gone: the bytes and time model
in benchmarks/RESULTS.md ("Row-owned value backward") puts this pass at ~0.3 ms (bf16) / ~0.7 ms
(fp32) in both modes, and both modes' GPU figures are for the next GPU session to confirm
(gpu_check.py times them).

Index guards: every access through a loaded index (indices, read ids, the slot map, update_rows
as the row list) is masked with :func:`guards.in_range`; the launcher raises "indices must lie
in [0, M)". Row segments (from the counts of in-range reads) and the heaviest-first row list (a
permutation of every row) are in range by construction and go unchecked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from smf_kernels._rows import row_to_slot_map
from smf_kernels.triton_kernels.guards import in_range, new_error_flag, raise_if_flagged
from smf_kernels.triton_kernels.launch import LaunchPlan, cdiv, next_pow2

MAX_BLOCK_D = 1024  # the widest column tile the row-owned backward holds in registers


@triton.jit
def gather_forward_kernel(
    v_ptr, idx_ptr, w_ptr, out_ptr, counts_ptr, valid_ptr, err_ptr,
    N, L, M, D, stride_v, stride_idx, stride_w, stride_out,
    HAS_COUNTS: tl.constexpr, HAS_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # int64: rows * stride can pass 2**31
    row_mask = rows < N
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols[None, :] < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for l in range(0, L):
        idx = tl.load(idx_ptr + rows * stride_idx + l, mask=row_mask, other=0)
        w = tl.load(w_ptr + rows * stride_w + l, mask=row_mask, other=0.0).to(tl.float32)
        read = in_range(err_ptr, idx, M, row_mask)  # an out-of-range id reads nothing and raises the flag
        v = tl.load(v_ptr + idx[:, None] * stride_v + cols[None, :], mask=read[:, None] & col_mask, other=0.0)
        acc += w[:, None] * v.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask)
    if HAS_COUNTS:
        if pid_d == 0:
            ls = tl.arange(0, BLOCK_L)
            read_mask = row_mask[:, None] & (ls[None, :] < L)
            if HAS_VALID:
                valid = tl.load(valid_ptr + rows, mask=row_mask, other=0) != 0
                read_mask = read_mask & valid[:, None]
            idx2 = tl.load(idx_ptr + rows[:, None] * stride_idx + ls[None, :], mask=read_mask, other=0)
            ones = tl.full((BLOCK_N, BLOCK_L), 1, tl.int64)
            tl.atomic_add(counts_ptr + idx2, ones, mask=in_range(err_ptr, idx2, M, read_mask), sem="relaxed")


@triton.jit
def read_keys_kernel(idx_ptr, keys_ptr, counts_ptr, err_ptr, num_reads, num_rows, BLOCK: tl.constexpr):
    """keys[p] = indices.flat[p] (num_rows where out of range, flagged); counts[row] += 1 per in-range read.

    The sort key of each read is its row; an out-of-range one sorts past every row, so the row
    programs never see it, and the error flag reports it. Integer atomics: exact, order-free.
    """
    reads = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = reads < num_reads
    idx = tl.load(idx_ptr + reads, mask=live, other=0)
    ok = in_range(err_ptr, idx, num_rows, live)
    tl.store(keys_ptr + reads, tl.where(ok, idx, num_rows).to(keys_ptr.dtype.element_ty), mask=live)
    tl.atomic_add(counts_ptr + idx, tl.full((BLOCK,), 1, tl.int32), mask=ok, sem="relaxed")


@triton.jit
def _finish_row_tile(dv_ptr, slot, cols, grad, mask, D):
    """The per-row epilogue, the one place the finished value gradient of a row leaves the program.

    grad: (BLOCK_D,) fp32, columns ``cols`` of the row's gradient, complete (every read of the
    row summed); slot: its output row (the row itself, or its slot in update_rows; called only
    for a row that has one); mask: the columns that exist (cols < D). The program owns the row,
    and with D <= 1024 this tile is the whole row. A fused optimizer step would read and write
    the parameter row and its moments here instead of storing the gradient.
    """
    tl.store(dv_ptr + slot * D + cols, grad, mask=mask)


@triton.jit
def _walk_row_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, first_tile, cols, col_mask,
                    num_reads, stride_g, L: tl.constexpr, ACCUMULATE: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """One column tile of one row: the reads order[start:end], BLOCK_P per step, in that order.

    Returns sum_p w[p] * grad_out[token(p)][cols] (fp32, zeros unless ACCUMULATE) and, with
    NEED_WEIGHTS, writes each read's partial dot v . grad_out[token(p)][cols] to grad_weights
    (added to what is there unless first_tile). v: (BLOCK_D,) fp32, the row's values in cols.
    """
    grad = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # The first step's read ids; each step then fetches the next step's ids before it gathers,
    # so a step waits on one round trip to L2, not two.
    at = start + tl.arange(0, BLOCK_P)
    next_read = tl.load(order_ptr + at, mask=at < end, other=0).to(tl.int32)
    for p0 in range(start, end, BLOCK_P):
        live = in_range(err_ptr, next_read, num_reads, p0 + tl.arange(0, BLOCK_P) < end)
        read = next_read
        at = p0 + BLOCK_P + tl.arange(0, BLOCK_P)
        next_read = tl.load(order_ptr + at, mask=at < end, other=0).to(tl.int32)
        g = tl.load(g_ptr + (read // L).to(tl.int64)[:, None] * stride_g + cols[None, :],
                    mask=live[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if ACCUMULATE:
            w = tl.load(w_ptr + read, mask=live, other=0.0).to(tl.float32)
            grad += tl.sum(w[:, None] * g, axis=0)
        if NEED_WEIGHTS:
            dot = tl.sum(v[None, :] * g, axis=1)
            if not first_tile:
                dot += tl.load(gw_ptr + read, mask=live, other=0.0)
            tl.store(gw_ptr + read, dot, mask=live)
    return grad


@triton.jit
def row_backward_kernel(
    v_ptr, w_ptr, g_ptr, order_ptr, ends_ptr, counts_ptr, rows_ptr, slot_ptr, dv_ptr, gw_ptr, err_ptr,
    num_rows, listed_rows, num_reads, D, out_rows, stride_v, stride_g, rows_per_program,
    L: tl.constexpr, HAS_ROW_LIST: tl.constexpr, CHECK_ROWS: tl.constexpr, HAS_SLOTS: tl.constexpr,
    NEED_VALUES: tl.constexpr, NEED_WEIGHTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Each program owns whole rows: row r's reads are order[ends[r] - counts[r] : ends[r]].

    Program p takes positions p, p + programs, ... of the row list (rows_ptr, e.g. rows by
    descending read count; else every row in order). Per column tile (one tile up to D = 1024)
    it loads its value row once and walks the row's reads (_walk_row_reads): the row's gradient
    accumulates in registers, each read's dW is written (tile partials summed through
    grad_weights in tile order). A row with an output slot hands its finished tile to
    _finish_row_tile; a row without one (T-row mode, not selected) skips the w * grad_out sums
    and only writes its reads' dW.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for i in range(rows_per_program):
        pos = pid + i * programs
        if pos < listed_rows:
            if HAS_ROW_LIST:
                row = tl.load(rows_ptr + pos).to(tl.int64)
                if CHECK_ROWS:
                    row_ok = in_range(err_ptr, row, num_rows, pos < listed_rows)
                else:  # a permutation of every row, built by the launcher
                    row_ok = pos < listed_rows
            else:
                row = pos.to(tl.int64)
                row_ok = pos < listed_rows
            end = tl.load(ends_ptr + row, mask=row_ok, other=0).to(tl.int64)
            start = end - tl.load(counts_ptr + row, mask=row_ok, other=0)
            if HAS_SLOTS:
                slot = tl.load(slot_ptr + row, mask=row_ok, other=-1)
                keep = in_range(err_ptr, slot, out_rows, row_ok & (slot >= 0))
            else:
                slot = row
                keep = row_ok
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                col_mask = cols < D
                v = tl.zeros((BLOCK_D,), dtype=tl.float32)
                if NEED_WEIGHTS:
                    v = tl.load(v_ptr + row * stride_v + cols, mask=col_mask & row_ok, other=0.0).to(tl.float32)
                # (a row never read skips the walk: its gradient is zeros, it owes no dW)
                if NEED_VALUES:
                    if keep:
                        grad = tl.zeros((BLOCK_D,), dtype=tl.float32)
                        if end > start:
                            grad = _walk_row_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, d0 == 0,
                                                   cols, col_mask, num_reads, stride_g, L, True, NEED_WEIGHTS, BLOCK_P,
                                                   BLOCK_D)
                        _finish_row_tile(dv_ptr, slot, cols, grad, col_mask, D)
                    elif HAS_SLOTS and NEED_WEIGHTS:  # T-row mode: an unselected row still owes dW
                        if end > start:
                            _walk_row_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, d0 == 0, cols,
                                            col_mask, num_reads, stride_g, L, False, True, BLOCK_P, BLOCK_D)
                elif end > start:
                    _walk_row_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, d0 == 0, cols,
                                    col_mask, num_reads, stride_g, L, False, True, BLOCK_P, BLOCK_D)
                tl.debug_barrier()  # the next tile adds to this tile's grad_weights partials


def row_tile_config(dim: int) -> dict:
    """Column tile, tokens per program and warps of the forward: one token's whole row (up to D = 1024) per
    program over 4 warps, so each token loads its ids and weights once. On an H100 at the paper size
    (N = 16,384, D = 896; benchmarks/RESULTS.md, "Launch configurations") that took bf16 from 0.31 to
    0.25 ms and fp32 from 0.68 to 0.65 ms against 8 tokens over 8 warps."""
    return {"BLOCK_D": min(1024, next_pow2(dim)), "BLOCK_N": 1, "num_warps": 4}


def _block_l(per_token: int) -> int:
    # tl.arange needs a power of two. At least 2: a width-1 read axis (heads = topk = 1) is a shape
    # neither the tests nor the AOT report cover, and padding it costs one masked lane.
    return max(2, next_pow2(per_token))


def _dummy(t: torch.Tensor) -> torch.Tensor:
    return t  # any tensor of the right device stands in for an absent optional pointer


def plan_gather_forward(values, indices, weights, counts, valid):
    """(plan, out, error_flag): the forward launch, its (N, D) output (values' dtype) and the (1,) int32
    flag its index guards raise."""
    values, indices, weights = values.contiguous(), indices.contiguous(), weights.contiguous()
    num_tokens, per_token = indices.shape
    num_rows, dim = values.shape
    out = torch.empty(num_tokens, dim, dtype=values.dtype, device=values.device)
    flag = new_error_flag(values.device)
    config = row_tile_config(dim)
    block_n, block_d = config["BLOCK_N"], config["BLOCK_D"]
    plan = LaunchPlan(
        gather_forward_kernel, (cdiv(num_tokens, block_n), cdiv(dim, block_d)),
        (values, indices, weights, out,
         counts if counts is not None else _dummy(indices), valid if valid is not None else _dummy(indices), flag,
         num_tokens, per_token, num_rows, dim, values.stride(0), indices.stride(0), weights.stride(0),
         out.stride(0)),
        dict(HAS_COUNTS=counts is not None, HAS_VALID=valid is not None,
             BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_L=_block_l(per_token), num_warps=config["num_warps"]),
    )
    return plan, out, flag


def gather_forward(values, indices, weights, counts, valid):
    plan, out, flag = plan_gather_forward(values, indices, weights, counts, valid)
    if indices.shape[0] > 0:
        plan.launch()
        raise_if_flagged(flag, f"indices must lie in [0, {values.shape[0]})")
    return out


def _key_dtype(num_rows: int) -> torch.dtype:
    """The narrowest integer holding every row id and the out-of-range key num_rows: a radix sort
    makes one pass per byte of key, so int16 keys (M < 32,768, the paper's 16,384) take two."""
    for dtype in (torch.int16, torch.int32):
        if num_rows <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def plan_read_keys(indices, num_rows, flag, block: int = 1024):
    """(plan, keys (N*L,), counts int32 (M,)): each read's sort key and every row's read count.

    ``flag`` is raised for an index outside [0, num_rows). 1,024 reads over 8 warps per program:
    4 ids per thread, 32 registers (over 4 warps sm_80's ptxas spilled 16 bytes). One pass over
    indices: 8 bytes a read in, 2 (int16 keys) out, plus one integer atomic.
    """
    flat = indices.contiguous().reshape(-1)
    keys = torch.empty(flat.numel(), dtype=_key_dtype(num_rows), device=indices.device)
    counts = torch.zeros(num_rows, dtype=torch.int32, device=indices.device)
    plan = LaunchPlan(read_keys_kernel, (cdiv(flat.numel(), block),),
                      (flat, keys, counts, flag, flat.numel(), num_rows), dict(BLOCK=block, num_warps=8))
    return plan, keys, counts


def sort_reads(keys, counts, rows=None, heavy_rows_first: bool = True):
    """(order int64 (N*L,), ends int32 (M,), row list int64 or None), by device-side torch ops only.

    order: the reads by row (a stable sort: within a row, by read id, so the sums run in one fixed
    order); row r's reads are order[ends[r] - counts[r] : ends[r]]. The row list is the rows the
    programs take, in order: ``rows`` (None: every row) sorted by descending read count when
    ``heavy_rows_first``, so the longest rows start first (longest-processing-time-first
    scheduling: a row read far more often than the rest does not start last and finish alone).
    """
    order = torch.sort(keys, stable=True)[1]
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    if not heavy_rows_first:
        return order, ends, rows
    if rows is None:
        return order, ends, torch.argsort(counts, descending=True, stable=True)
    return order, ends, rows[torch.argsort(counts[rows], descending=True, stable=True)]


def row_tile_config_backward(dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Column tile, reads per step, warps and register cap of the row-owned backward (the H100 time
    model is in benchmarks/RESULTS.md, "Row-owned value backward").

    One warp per program holds the whole row (up to D = 1024: 32 fp32 columns a lane) and walks its
    reads one at a time: a read's dW is a warp-shuffle reduction (no shared memory, no barrier),
    and the per-read bookkeeping runs on 32 lanes, not 128. Compiled for sm_90 the loop is ~200
    instructions per read in bf16, half of 4 warps x 4 reads per step (404 per read: cross-warp
    reductions, replicated read ids), which the model makes issue-bound at ~0.45 ms. 128 registers
    at most (ptxas's choice without the cap was 135 for bf16): 16 warps, so 16 reads in flight,
    per SM, 25% occupancy, no spills (AOT report).

    The interpreter (CPU) takes 16 reads per step: its cost is per step, not per lane."""
    reads_per_step = 16 if device.type == "cpu" else 1
    return {"BLOCK_D": min(MAX_BLOCK_D, next_pow2(dim)), "BLOCK_P": reads_per_step, "num_warps": 1, "maxnreg": 128}


def _rows_per_program(listed_rows: int, device: torch.device) -> int:
    """One row per program on a GPU (the hardware hands the next listed row to whichever program
    slot frees first); a few programs in the interpreter, where each program costs ~70 ms."""
    return max(1, cdiv(listed_rows, 4)) if device.type == "cpu" else 1


def plan_row_backward(grad_out, values, weights, order, ends, counts, row_list, slots, out_rows, flag,
                      need_values, need_weights, tile: dict | None = None, trusted_rows: bool = False):
    """(plan, (grad_values fp32 (out_rows or 0, D), grad_weights fp32 (N or 0, L))): the row-owned pass.

    slots: None (dense: output row = row) or (M,) int64 row -> output row, -1 = none. row_list:
    the rows to own (see :func:`sort_reads`); None = every row in order. tile: entries replacing
    the launch configuration's (tests use a narrow BLOCK_D to cover the multi-tile path).
    trusted_rows: row_list is a permutation of every row made by :func:`sort_reads` (in range by
    construction, so the kernel skips its guard); otherwise (update_rows) each row is checked.
    """
    values, weights, grad_out = values.contiguous(), weights.contiguous(), grad_out.contiguous()
    num_tokens, per_token = weights.shape
    num_rows, dim = values.shape
    grad_values = torch.empty(out_rows if need_values else 0, dim, dtype=torch.float32, device=values.device)
    grad_weights = torch.empty(num_tokens if need_weights else 0, per_token, dtype=torch.float32,
                               device=values.device)
    config = row_tile_config_backward(dim, values.dtype, values.device)
    config.update(tile or {})
    listed_rows = num_rows if row_list is None else row_list.numel()
    rows_per_program = _rows_per_program(listed_rows, values.device)
    plan = LaunchPlan(
        row_backward_kernel, (cdiv(listed_rows, rows_per_program),),
        (values, weights, grad_out, order, ends, counts, _dummy(counts) if row_list is None else row_list,
         _dummy(counts) if slots is None else slots, grad_values, grad_weights, flag,
         num_rows, listed_rows, num_tokens * per_token, dim, out_rows, values.stride(0), grad_out.stride(0),
         rows_per_program),
        # L constexpr: read // L, the token of a read, compiles to a shift (L = 64) or a multiply.
        dict(L=per_token, HAS_ROW_LIST=row_list is not None, CHECK_ROWS=not trusted_rows,
             HAS_SLOTS=slots is not None, NEED_VALUES=need_values, NEED_WEIGHTS=need_weights, **config),
    )
    return plan, (grad_values, grad_weights)


def gather_backward(grad_out, values, indices, weights, update_rows, need_values, need_weights, *,
                    heavy_rows_first: bool = True, tile: dict | None = None):
    """(grad_values fp32 (M or T or 0, D), grad_weights fp32 (N or 0, L)): the row-owned backward.

    update_rows: None (dense value gradient) or (T,) int64 distinct rows (row t of grad_values
    for update_rows[t]). Reads sorted by row once, then one pass in which each program owns
    whole rows: no float atomics, so every run gives the same bits. Raises RuntimeError (on
    CUDA at the next synchronising call) if an index lies outside [0, M). No host sync.
    """
    num_rows, dim = values.shape
    num_tokens, per_token = indices.shape
    if indices.numel() >= 2**31:  # read ids and row segments are int32 in the kernels
        raise ValueError(f"the triton backward takes fewer than 2**31 reads (N * L), got {indices.numel()}")
    device = values.device
    sparse = update_rows is not None and need_values
    out_rows = (update_rows.numel() if sparse else num_rows) if need_values else 0
    if not (need_values or need_weights):
        return (torch.empty(0, dim, dtype=torch.float32, device=device),
                torch.empty(0, per_token, dtype=torch.float32, device=device))
    flag = new_error_flag(device)
    keys_plan, keys, counts = plan_read_keys(indices, num_rows, flag)
    if keys.numel() > 0:
        keys_plan.launch()
    # Without dW only the selected rows have work: own those alone.
    own = update_rows if sparse and not need_weights else None
    order, ends, row_list = sort_reads(keys, counts, own, heavy_rows_first)
    slots = row_to_slot_map(update_rows, num_rows) if sparse else None
    plan, grads = plan_row_backward(grad_out, values, weights, order, ends, counts, row_list, slots, out_rows,
                                    flag, need_values, need_weights, tile, trusted_rows=own is None)
    if plan.grid[0] > 0:
        plan.launch()
    raise_if_flagged(flag, f"indices must lie in [0, {num_rows})")
    return grads
