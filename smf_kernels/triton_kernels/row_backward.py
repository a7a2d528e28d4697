"""Triton kernels: the row-owned backward of the weighted gather, without float atomics or host syncs.

Four launches, one path whatever torch.use_deterministic_algorithms says:

* read_keys_kernel: each read's row as its sort key (int16 while M < 32,768) and each row's read
  count (integer atomics: exact, order-free).
* torch.sort (stable, the one sort): the reads by row, within a row by read id, so every sum runs
  in one fixed order.
* plan_items_kernel (one program): the row bookkeeping that took 2-7 ATen launches (a cumsum, an
  argsort of the counts, the T-row slot map; benchmarks/backward_launches.py counts them). From the counts it writes each row's
  segment start, splits each owned row's reads into chunks of at most SPLIT reads, and lists the
  chunks ("items") in row order; in T-row mode it builds the row -> slot map from update_rows.
* row_backward_kernel: one program (one warp) per item walks its chunk of the row's reads in
  sorted order, adds w * grad_out[token] to the row's gradient in registers and writes each
  read's dW = V[row] . grad_out[token]. A row of one chunk (SPLIT reads or fewer: all but the
  hottest) leaves through _finish_row_tile, written once. A row of n > 1 chunks ("hot") is
  reduced deterministically: every chunk stores its partial row, takes a ticket (an integer
  atomic per row, acquire-release) and the one that draws the last ticket sums the n partials in
  chunk order 0..n-1 and finishes the row. The partition (SPLIT) and the order of every sum are
  fixed, so every run gives the same bits; which program adds them does not matter.
  T-row mode: every row with reads is walked (dW is owed for every read); a row without an
  output slot skips the w * grad_out sums and writes dW only. Without dW only the T selected rows
  have items.

Load balance: no item walks more than SPLIT reads, so a hot row no longer sets the pass's length
(one program walks ~one read per L2 round trip, ~0.4 us: a row of 1,640 reads took ~0.65 ms in
one program, its 7 chunks of <= 256 take ~0.1 ms side by side). That replaced the heaviest-first
row order (an argsort of the counts), which only moved a hot row's walk to the start of the pass.

Index guards: every access through a loaded index (indices, read ids, update_rows, the slot map)
is masked with :func:`guards.in_range`, and a row listed twice in update_rows is caught where the slot
map is built; the launcher raises "indices must lie in [0, M) [and update_rows must hold distinct rows
there]", so on CUDA the op needs no host-side or ATen check of update_rows (its ~10 launches). Row
segments (from the counts of in-range reads) and the items (written by plan_items_kernel from
in-range rows) are in range by construction and go unchecked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from smf_kernels.triton_kernels.guards import in_range, raise_if_flagged
from smf_kernels.triton_kernels.launch import LaunchPlan, cdiv, next_pow2

MAX_BLOCK_D = 1024  # the widest column tile the row-owned backward holds in registers
SPLIT_READS = 256  # reads per chunk on a GPU: a row read more often is split over programs


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
def plan_items_kernel(counts_ptr, rows_ptr, slot_ptr, starts_ptr, first_item_ptr, first_part_ptr, items_ptr,
                      total_ptr, err_ptr, num_rows, num_selected,
                      SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """One program: row r's reads are order[starts[r] : starts[r] + counts[r]]; its n_r chunks are items
    first_item[r] .. first_item[r] + n_r - 1 (items[k] = r), its partial rows (n_r > 1 only) partial rows
    first_part[r] .. first_part[r] + n_r - 1; total[0] = the number of items. n_r = cdiv(counts[r], SPLIT),
    at least 1 for a row with an output slot (a row never read still gets its zero gradient), 0 for a row
    without one unless NEED_WEIGHTS. HAS_SLOTS: slots[r] = t for r = update_rows[t], else -1, written here;
    an update_rows entry outside [0, num_rows) or a row listed twice raises the error flag.
    """
    if HAS_SLOTS:
        for r0 in range(0, num_rows, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            tl.store(slot_ptr + r, tl.full((BLOCK,), -1, tl.int32), mask=r < num_rows)
        tl.debug_barrier()
        for t0 in range(0, num_selected, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            live = t < num_selected
            row = tl.load(rows_ptr + t, mask=live, other=0)
            tl.store(slot_ptr + row, t, mask=in_range(err_ptr, row, num_rows, live))
        tl.debug_barrier()
        for t0 in range(0, num_selected, BLOCK):  # a row listed twice: one of its entries lost the slot
            t = t0 + tl.arange(0, BLOCK)
            live = t < num_selected
            row = tl.load(rows_ptr + t, mask=live, other=0)
            ok = (row >= 0) & (row < num_rows) & live
            lost = ok & (tl.load(slot_ptr + row, mask=ok, other=0) != t)
            tl.store(err_ptr + tl.zeros_like(t), tl.full(t.shape, 1, tl.int32), mask=lost)
        tl.debug_barrier()
    read_base = 0
    item_base = 0
    part_base = 0
    for r0 in range(0, num_rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        live = r < num_rows
        count = tl.load(counts_ptr + r, mask=live, other=0)
        if HAS_SLOTS:
            owned = tl.load(slot_ptr + r, mask=live, other=-1) >= 0
        else:
            owned = live
        chunks = (count + SPLIT - 1) // SPLIT
        if not NEED_WEIGHTS:
            chunks = tl.where(owned, chunks, 0)
        chunks = tl.where(owned, tl.maximum(chunks, 1), chunks)
        parts = tl.where(chunks > 1, chunks, 0)
        first_item = item_base + tl.cumsum(chunks, 0) - chunks
        tl.store(starts_ptr + r, read_base + tl.cumsum(count, 0) - count, mask=live)
        tl.store(first_item_ptr + r, first_item, mask=live)
        tl.store(first_part_ptr + r, part_base + tl.cumsum(parts, 0) - parts, mask=live)
        for j in range(0, tl.max(chunks, 0)):
            tl.store(items_ptr + first_item + j, r, mask=j < chunks)
        read_base += tl.sum(count, 0)
        item_base += tl.sum(chunks, 0)
        part_base += tl.sum(parts, 0)
    tl.store(total_ptr, item_base)


@triton.jit
def _finish_row_tile(dv_ptr, slot, cols, grad, mask, D, ADD_TO_OUT: tl.constexpr):
    """The per-row epilogue, the one place the finished value gradient of a row leaves the program.

    grad: (BLOCK_D,) fp32, columns ``cols`` of the row's gradient, complete (every read of the
    row summed); slot: its output row (the row itself, or its slot in update_rows; called only
    for a row that has one); mask: the columns that exist (cols < D). With D <= 1024 this tile is
    the whole row. ADD_TO_OUT: added to what the output row holds (a gradient sink), one fp32 add,
    the bits of ``sink += grad``. A fused optimizer step would read and write the parameter row and
    its moments here instead of storing the gradient.
    """
    if ADD_TO_OUT:
        grad += tl.load(dv_ptr + slot * D + cols, mask=mask, other=0.0)
    tl.store(dv_ptr + slot * D + cols, grad, mask=mask)


@triton.jit
def _walk_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, first_tile, cols, col_mask,
                num_reads, stride_g, L: tl.constexpr, ACCUMULATE: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """One column tile of one chunk: the reads order[start:end], BLOCK_P per step, in that order.

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
def _sum_partials(part_ptr, first_part, chunks, cols, col_mask, D, BLOCK_D: tl.constexpr):
    """sum over c = 0 .. chunks-1, in that order, of partial row first_part + c (fp32, columns cols); read
    through L2 (.cg): other programs wrote them."""
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for c in range(0, chunks):
        acc += tl.load(part_ptr + (first_part + c).to(tl.int64) * D + cols, mask=col_mask, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def row_backward_kernel(
    v_ptr, w_ptr, g_ptr, order_ptr, starts_ptr, counts_ptr, items_ptr, first_item_ptr, first_part_ptr, total_ptr,
    slot_ptr, ticket_ptr, part_ptr, dv_ptr, gw_ptr, err_ptr,
    num_reads, D, out_rows, stride_v, stride_g, items_per_program,
    L: tl.constexpr, SPLIT: tl.constexpr, HAS_SLOTS: tl.constexpr, NEED_VALUES: tl.constexpr,
    NEED_WEIGHTS: tl.constexpr, ADD_TO_OUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program p takes items p, p + programs, ... below total[0] (see plan_items_kernel): chunk c of row r,
    the reads order[starts[r] + c * SPLIT :][: SPLIT] of the row's segment. Per column tile (one tile up to
    D = 1024) it loads the value row once and walks the chunk (_walk_reads). A row of one chunk hands its
    finished tile to _finish_row_tile; a hot row's chunks store partial rows and the last ticket holder sums
    them in chunk order. A row without an output slot (T-row mode, not selected) only writes its reads' dW.
    """
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    total = tl.load(total_ptr)
    for i in range(items_per_program):
        item = pid + i * programs
        if item < total:
            row = tl.load(items_ptr + item).to(tl.int64)
            chunk = item - tl.load(first_item_ptr + row)
            count = tl.load(counts_ptr + row)
            chunks = tl.maximum((count + SPLIT - 1) // SPLIT, 1)
            start = tl.load(starts_ptr + row).to(tl.int64) + chunk * SPLIT
            end = tl.minimum(start + SPLIT, tl.load(starts_ptr + row).to(tl.int64) + count)
            if HAS_SLOTS:
                slot = tl.load(slot_ptr + row).to(tl.int64)
                keep = slot >= 0
            else:
                slot = row
                keep = row >= 0
            hot = chunks > 1
            first_part = tl.load(first_part_ptr + row)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                col_mask = cols < D
                v = tl.zeros((BLOCK_D,), dtype=tl.float32)
                if NEED_WEIGHTS:
                    v = tl.load(v_ptr + row * stride_v + cols, mask=col_mask, other=0.0).to(tl.float32)
                # (a row never read skips the walk: its gradient is zeros, it owes no dW)
                if NEED_VALUES:
                    if keep:
                        grad = tl.zeros((BLOCK_D,), dtype=tl.float32)
                        if end > start:
                            grad = _walk_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, d0 == 0,
                                               cols, col_mask, num_reads, stride_g, L, True, NEED_WEIGHTS, BLOCK_P,
                                               BLOCK_D)
                        if hot:
                            tl.store(part_ptr + (first_part + chunk).to(tl.int64) * D + cols, grad, mask=col_mask)
                        else:
                            _finish_row_tile(dv_ptr, slot, cols, grad, col_mask, D, ADD_TO_OUT)
                    elif HAS_SLOTS and NEED_WEIGHTS:  # T-row mode: an unselected row still owes dW
                        if end > start:
                            _walk_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, d0 == 0, cols,
                                        col_mask, num_reads, stride_g, L, False, True, BLOCK_P, BLOCK_D)
                elif end > start:
                    _walk_reads(v, w_ptr, g_ptr, order_ptr, gw_ptr, err_ptr, start, end, d0 == 0, cols,
                                col_mask, num_reads, stride_g, L, False, True, BLOCK_P, BLOCK_D)
                tl.debug_barrier()  # the next tile adds to this tile's grad_weights partials
            if NEED_VALUES:
                if keep & hot:
                    # Every lane's partial stores come before the ticket (barrier, then a release); the
                    # last holder's loads come after it (acquire, then a barrier).
                    ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel")
                    tl.debug_barrier()
                    if ticket == chunks - 1:
                        for d0 in range(0, D, BLOCK_D):
                            cols = d0 + tl.arange(0, BLOCK_D)
                            col_mask = cols < D
                            _finish_row_tile(dv_ptr, slot, cols,
                                             _sum_partials(part_ptr, first_part, chunks, cols, col_mask, D, BLOCK_D),
                                             col_mask, D, ADD_TO_OUT)


def _key_dtype(num_rows: int) -> torch.dtype:
    """The narrowest integer holding every row id and the out-of-range key num_rows: a radix sort
    makes one pass per byte of key, so int16 keys (M < 32,768, the paper's 16,384) take two."""
    for dtype in (torch.int16, torch.int32):
        if num_rows <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def row_tile_config_backward(dim: int, device: torch.device) -> dict:
    """Column tile, reads per step, reads per chunk, warps and register cap of the row-owned backward (the
    H100 time model is in benchmarks/RESULTS.md, "Row-owned value backward").

    One warp per program holds the whole row (up to D = 1024: 32 fp32 columns a lane) and walks its
    reads one at a time: a read's dW is a warp-shuffle reduction (no shared memory, no barrier),
    and the per-read bookkeeping runs on 32 lanes, not 128. Compiled for sm_90 the loop is ~200
    instructions per read in bf16, half of 4 warps x 4 reads per step (404 per read: cross-warp
    reductions, replicated read ids), which the model makes issue-bound at ~0.45 ms. 128 registers
    at most (ptxas's choice without the cap: 128-135 for bf16; capped at 96 / 80 / 64 it spills 120 /
    276 / 588 B): 16 warps, so 16 reads in flight, per SM, 25% occupancy, no spills (AOT report; 2 warps
    or 512-column tiles trade registers for fewer reads in flight or more instructions: RESULTS.md,
    "Issue 49").

    The interpreter (CPU) takes 16 reads per step (its cost is per step, not per lane) and splits rows
    into chunks of 16 reads, so tests at tiny shapes run the hot-row reduction."""
    cpu = device.type == "cpu"
    return {"BLOCK_D": min(MAX_BLOCK_D, next_pow2(dim)), "BLOCK_P": 16 if cpu else 1,
            "SPLIT": 16 if cpu else SPLIT_READS, "num_warps": 1, "maxnreg": 128}


def _items_per_program(max_items: int, device: torch.device) -> int:
    """One item per program on a GPU (the hardware hands the next item to whichever program slot frees
    first); a few programs in the interpreter, where each program costs ~70 ms."""
    return max(1, cdiv(max_items, 4)) if device.type == "cpu" else 1


def new_work_buffer(num_rows: int, device: torch.device) -> torch.Tensor:
    """(2M + 1,) int32 zeros, one fill for the backward's read counts, hot-row tickets and error flag."""
    return torch.zeros(2 * num_rows + 1, dtype=torch.int32, device=device)


def plan_read_keys(indices, num_rows, work, block: int = 1024):
    """(plan, keys (N*L,)): each read's sort key; the plan counts every row's reads into work[:M] (int32) and
    raises the flag work[2M:] for an index outside [0, num_rows).

    1,024 reads over 8 warps per program: 4 ids per thread, 32 registers (over 4 warps sm_80's ptxas spilled
    16 bytes). One pass over indices: 8 bytes a read in, 2 (int16 keys) out, plus one integer atomic.
    """
    flat = indices.contiguous().reshape(-1)
    keys = torch.empty(flat.numel(), dtype=_key_dtype(num_rows), device=indices.device)
    plan = LaunchPlan(read_keys_kernel, (cdiv(flat.numel(), block),),
                      (flat, keys, work[:num_rows], work[2 * num_rows:], flat.numel(), num_rows),
                      dict(BLOCK=block, num_warps=8))
    return plan, keys


def plan_row_backward(grad_out, values, weights, order, update_rows, need_values, need_weights, work,
                      tile: dict | None = None, into: torch.Tensor | None = None):
    """(items plan, row plan, (grad_values fp32 (out_rows or 0, D), grad_weights fp32 (N or 0, L))): the two
    launches after the sort, every buffer allocated.

    order: (N*L,) int64, the reads sorted by row (stable); update_rows: None (dense: output row = row) or
    (T,) int64 distinct rows; work: the (2M + 1,) int32 buffer of :func:`new_work_buffer` after the
    read_keys launch (counts, tickets, error flag). tile: entries replacing the launch configuration's
    (tests use a narrow BLOCK_D, one read per step, other SPLITs, and ``items_per_program``, which changes
    which program ends each hot row). into: None, or a contiguous (T, D) fp32 tensor (T-row mode) that the
    value gradient is added into in place, returned as grad_values.
    """
    values, weights, grad_out = values.contiguous(), weights.contiguous(), grad_out.contiguous()
    num_tokens, per_token = weights.shape
    num_rows, dim = values.shape
    num_reads = num_tokens * per_token
    device = values.device
    counts, tickets, flag = work[:num_rows], work[num_rows:2 * num_rows], work[2 * num_rows:]
    sparse = update_rows is not None and need_values
    out_rows = (update_rows.numel() if sparse else num_rows) if need_values else 0
    config = row_tile_config_backward(dim, device)
    config.update(tile or {})
    split = config.pop("SPLIT")
    # A row of c reads has at most 1 + c / SPLIT chunks, so the items fit M + P / SPLIT; the chunks of rows
    # with more than one (c > SPLIT, so at most 2c / SPLIT each) fit 2P / SPLIT partial rows.
    max_items = num_rows + cdiv(num_reads, split)
    per_program = config.pop("items_per_program", _items_per_program(max_items, device))

    index = torch.empty(4 * num_rows + max_items + 1, dtype=torch.int32, device=device)
    starts, first_item, first_part, slots = (index[k * num_rows:(k + 1) * num_rows] for k in range(4))
    items, total = index[4 * num_rows:-1], index[-1:]
    # One program of 1,024 threads scans the rows 4,096 at a time (4 steps at M = 16,384; 64 registers,
    # no spill: 8,192 a step spilled 180 B, 16 warps took 123 registers).
    items_plan = LaunchPlan(plan_items_kernel, (1,),
                            (counts, update_rows.contiguous() if sparse else counts, slots, starts, first_item,
                             first_part, items, total, flag, num_rows, update_rows.numel() if sparse else 0),
                            dict(SPLIT=split, HAS_SLOTS=sparse, NEED_WEIGHTS=need_weights, BLOCK=4096, num_warps=32))

    if into is not None and not (sparse and into.is_contiguous() and into.dtype == torch.float32
                                 and into.shape == (out_rows, dim)):
        raise ValueError(f"into must be a contiguous ({out_rows}, {dim}) float32 tensor of the T rows")
    grad_values = torch.empty(out_rows, dim, dtype=torch.float32, device=device) if into is None else into
    grad_weights = torch.empty(num_tokens if need_weights else 0, per_token, dtype=torch.float32, device=device)
    partials = torch.empty(cdiv(2 * num_reads, split) if need_values else 0, dim, dtype=torch.float32,
                           device=device)
    row_plan = LaunchPlan(
        row_backward_kernel, (cdiv(max_items, per_program),),
        (values, weights, grad_out, order, starts, counts, items, first_item, first_part, total, slots, tickets,
         partials, grad_values, grad_weights, flag, num_reads, dim, out_rows, values.stride(0), grad_out.stride(0),
         per_program),
        # L constexpr: read // L, the token of a read, compiles to a shift (L = 64) or a multiply.
        dict(L=per_token, SPLIT=split, HAS_SLOTS=sparse, NEED_VALUES=need_values, NEED_WEIGHTS=need_weights,
             ADD_TO_OUT=into is not None, **config),
    )
    return items_plan, row_plan, (grad_values, grad_weights)


def gather_backward(grad_out, values, indices, weights, update_rows, need_values, need_weights, *,
                    tile: dict | None = None, into: torch.Tensor | None = None):
    """(grad_values fp32 (M or T or 0, D), grad_weights fp32 (N or 0, L)): the row-owned backward.

    update_rows: None (dense value gradient) or (T,) int64 distinct rows (row t of grad_values
    for update_rows[t]); into: a contiguous (T, D) fp32 sink the T rows' gradient is added into
    (returned as grad_values), without a (T, D) buffer and an add launch of its own. Reads sorted by row once, then one pass in which each program owns a
    chunk of a row: no float atomics, so every run gives the same bits. Raises RuntimeError (on
    CUDA at the next synchronising call) if an index lies outside [0, M). No host sync.
    """
    num_rows, dim = values.shape
    num_tokens, per_token = indices.shape
    if indices.numel() >= 2**31:  # read ids and row segments are int32 in the kernels
        raise ValueError(f"the triton backward takes fewer than 2**31 reads (N * L), got {indices.numel()}")
    device = values.device
    if not (need_values or need_weights):
        return (torch.empty(0, dim, dtype=torch.float32, device=device),
                torch.empty(0, per_token, dtype=torch.float32, device=device))
    work = new_work_buffer(num_rows, device)
    keys_plan, keys = plan_read_keys(indices, num_rows, work)
    if keys.numel() > 0:
        keys_plan.launch()
    order = torch.sort(keys, stable=True)[1]  # the one sort: the reads by row, within a row by read id
    items_plan, row_plan, grads = plan_row_backward(grad_out, values, weights, order, update_rows, need_values,
                                                    need_weights, work, tile, into)
    if num_rows > 0:
        items_plan.launch()
        row_plan.launch()
    rows_rule = " and update_rows must hold distinct rows there" if update_rows is not None and need_values else ""
    raise_if_flagged(work[2 * num_rows:], f"indices must lie in [0, {num_rows}){rows_rule}")
    return grads
