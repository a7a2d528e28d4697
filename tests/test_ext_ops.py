"""The compiled ``ext`` backend (csrc/) through the public ops, against the reference.

The module fixture builds the CPU extension (~30 s the first time, then
cached; see smf_kernels.build_ext), so this file always tests real kernels.
"""
import pytest
import torch

from helpers import TOL, gather_inputs, gather_into_rows, rel_err
from smf_kernels import backends, build_ext
from smf_kernels.memory import ProductKeyMemory
from smf_kernels.ops import product_key_topk, weighted_gather
from smf_kernels.reference import product_key_topk_reference, weighted_gather_reference

CPU = torch.device("cpu")
# (M, D, N, L): D = 96 and 130 are not powers of two and not multiples of the
# 256-wide register tile; N is not a multiple of anything.
GATHER_SHAPES = [(50, 96, 37, 8), (300, 130, 21, 12)]
# (N, H, key_dim, n_keys, topk): n_keys not a power of two; topk from 1 to n_keys. n_keys = 20
# with topk = 16: the float32 vector selection over sub-key rows padded to 32 columns.
TOPK_SHAPES = [(37, 3, 24, 24, 5), (19, 2, 16, 10, 10), (23, 1, 8, 7, 1), (29, 2, 40, 20, 16),
               (64, 4, 256, 128, 16)]


@pytest.fixture(scope="module", autouse=True)
def ext():
    module = build_ext.build()
    backends.refresh()  # backends caches the ImportError of an import before the build
    return module


def test_ext_is_the_cpu_default_once_built():
    assert backends.unavailable_reason("ext", CPU) is None
    assert backends.available_backends(CPU)[0] == "ext"
    reason = backends.unavailable_reason("ext", torch.device("cuda"))
    assert reason is None or "without CUDA" in reason


@pytest.mark.parametrize("shape", TOPK_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_topk_matches_reference_and_its_own_indices(shape, dtype):
    n, h, key_dim, n_keys, topk = shape
    query = torch.randn(n, h, key_dim).to(dtype)
    keys = torch.randn(h, 2, n_keys, key_dim // 2).to(dtype)
    scores, indices = product_key_topk(query, keys, topk, backend="ext")
    ref_scores, ref_indices = product_key_topk_reference(query, keys, topk)
    assert scores.dtype == ref_scores.dtype and indices.dtype == torch.int64
    assert scores.shape == indices.shape == (n, h, topk)
    assert rel_err(scores, ref_scores) < (1e-12 if dtype == torch.float64 else 1e-5)
    # Scores summed in another order may swap near-ties: nearly all indices agree.
    assert (indices == ref_indices).double().mean() >= 0.99
    # Each returned slot's score, recomputed from its sub-keys, is the returned score.
    half = key_dim // 2
    q, k = query.double(), keys.double()
    first, second = indices // n_keys, indices % n_keys
    heads = torch.arange(h).view(1, h, 1)
    recomputed = (q[..., :half].unsqueeze(2) * k[heads, 0, first]).sum(-1) + (
        q[..., half:].unsqueeze(2) * k[heads, 1, second]).sum(-1)
    assert rel_err(scores, recomputed) < (1e-12 if dtype == torch.float64 else 1e-5)
    assert bool((scores[..., :-1] >= scores[..., 1:]).all())
    assert bool((indices.sort(-1).values.diff(dim=-1) > 0).all())  # distinct slots


def test_topk_accepts_non_contiguous_and_float16():
    query = torch.randn(40, 3, 12).transpose(0, 1).contiguous().transpose(0, 1)  # strided (N, H, key_dim)
    keys = torch.randn(3, 2, 9, 6)
    assert not query.is_contiguous()
    scores, indices = product_key_topk(query, keys, 4, backend="ext")
    ref_scores, ref_indices = product_key_topk_reference(query, keys, 4)
    assert rel_err(scores, ref_scores) < 1e-5 and torch.equal(indices, ref_indices)
    half_scores, _ = product_key_topk(query.half(), keys.half(), 4, backend="ext")
    assert half_scores.dtype == torch.float32
    assert rel_err(half_scores, product_key_topk_reference(query.half(), keys.half(), 4)[0]) < 1e-5


@pytest.mark.parametrize("shape", GATHER_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_gather_forward_matches_reference(shape, dtype):
    values, indices, weights = gather_inputs(shape, dtype)
    out = weighted_gather(values, indices, weights, backend="ext")
    ref = weighted_gather_reference(values.double(), indices, weights.double())
    assert out.dtype == dtype and out.shape == (shape[2], shape[1])
    assert rel_err(out, ref) < TOL.get(dtype, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_forward_over_a_table_larger_than_the_cache_budget(dtype):
    """A 32 MB table of 8,000 fp32 (16,000 bf16) rows of D = 1,000: the AVX2 forward sweeps the tokens once per
    group of four 112-column tiles (two groups and a scalar remainder of 104 columns), so its slice stays in L3."""
    rows = 8_000 if dtype == torch.float32 else 16_000
    values, indices, weights = gather_inputs((rows, 1000, 37, 8), dtype)
    counts = torch.zeros(rows, dtype=torch.int64)
    out = weighted_gather(values, indices, weights, counts=counts, backend="ext")
    assert rel_err(out, weighted_gather_reference(values.double(), indices, weights.double())) < TOL[dtype]
    assert torch.equal(counts, torch.bincount(indices.flatten(), minlength=rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_forward_over_a_large_table_reads_whole_rows_with_the_same_bits(dtype):
    """A table whose 112-column slice exceeds 4 MB (20,000 rows fp32, 40,000 bf16, D = 230: 9 MB): the forward
    reads whole rows in one pass. Its sums are the same chains of multiply-adds as the column groups' of a small
    table holding the same rows: bit for bit equal, and the reference's within the dtype's bound."""
    rows = 20_000 if dtype == torch.float32 else 40_000
    values, indices, weights = gather_inputs((rows, 230, 37, 8), dtype)
    counts = torch.zeros(rows, dtype=torch.int64)
    out = weighted_gather(values, indices, weights, counts=counts, backend="ext")
    used, small_indices = indices.unique(return_inverse=True)
    small = weighted_gather(values[used].contiguous(), small_indices, weights, backend="ext")
    assert torch.equal(out, small)
    assert rel_err(out, weighted_gather_reference(values.double(), indices, weights.double())) < TOL[dtype]
    assert torch.equal(counts, torch.bincount(indices.flatten(), minlength=rows))


def test_gather_accepts_non_contiguous_inputs():
    values = torch.randn(96, 50).t()  # (50, 96), strided
    indices = torch.randint(0, 50, (37, 16))[:, ::2]
    weights = torch.rand(37, 16)[:, 1::2]
    counts = torch.zeros(50, 2, dtype=torch.int64)[:, 0]  # strided counts: updated in place
    out = weighted_gather(values, indices, weights, counts=counts, backend="ext")
    assert rel_err(out, weighted_gather_reference(values, indices, weights)) < 1e-5
    assert torch.equal(counts, torch.bincount(indices.flatten(), minlength=50))


def test_histogram_is_exact_and_skips_padding():
    values, indices, weights = gather_inputs(GATHER_SHAPES[0], torch.float32)
    indices[0, :4] = 7  # a slot read several times by one token
    valid = torch.rand(indices.shape[0]) > 0.3
    valid[0] = True
    counts = torch.randint(0, 5, (values.shape[0],))  # counts accumulate onto what is there
    expected = counts + torch.bincount(indices[valid].flatten(), minlength=values.shape[0])
    weighted_gather(values, indices, weights, counts=counts, valid=valid, backend="ext")
    assert torch.equal(counts, expected)


@pytest.mark.parametrize("shape", GATHER_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_dense_and_weight_backward_match_reference(shape, dtype):
    values, indices, weights = gather_inputs(shape, dtype, requires_grad=True)
    grad = torch.randn(shape[2], shape[1], dtype=torch.float64)
    out = weighted_gather(values, indices, weights, backend="ext")
    got_values, got_weights = torch.autograd.grad(out, (values, weights), grad.to(dtype))
    ref = weighted_gather_reference(values.double(), indices, weights.double())
    want_values, want_weights = torch.autograd.grad(ref, (values, weights), grad)
    # Gradients accumulate in fp32 from the rounded grad_out: bound by its dtype.
    tol = 1e-12 if dtype == torch.float64 else (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert got_values.dtype == dtype and not got_values.is_sparse
    assert rel_err(got_values, want_values) < tol
    assert rel_err(got_weights, want_weights) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_backward_holds_only_the_rows(dtype):
    values, indices, weights = gather_inputs(GATHER_SHAPES[1], dtype, requires_grad=True)
    read = indices.flatten().unique()
    rows = torch.cat([read[torch.randperm(read.numel())[:20]], torch.tensor([299])]).unique()
    out, sink = gather_into_rows(values, indices, weights, rows, backend="ext")
    grad = torch.randn(out.shape)
    out.backward(grad.to(dtype))
    ref = weighted_gather_reference(values.float(), indices, weights.float())
    (dense,) = torch.autograd.grad(ref, values, grad)
    assert values.grad is None and sink.grad.shape == (rows.numel(), values.shape[1])
    assert rel_err(sink.grad, dense[rows]) < TOL[dtype]


@pytest.mark.parametrize("sparse", [False, True])
def test_backward_is_bit_reproducible_across_runs_and_threads(sparse):
    values, indices, weights = gather_inputs((64, 130, 200, 16), torch.float32, requires_grad=True)
    indices[:, :8] = indices[:, :8] % 4  # hot rows: many reads to sum into one row
    rows = torch.arange(0, 64, 3) if sparse else None
    grad = torch.randn(200, 130)
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    results = []
    try:
        for num_threads in (max(2, threads), max(2, threads), 1):  # the session runs one thread (conftest)
            torch.set_num_threads(num_threads)
            if rows is None:
                out = weighted_gather(values, indices, weights, backend="ext")
                results.append(torch.autograd.grad(out, (values, weights), grad))
            else:
                out, sink = gather_into_rows(values, indices, weights, rows, backend="ext")
                results.append((*torch.autograd.grad(out, (weights,), grad), sink.grad))
    finally:
        torch.set_num_threads(threads)
    for grads in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0]))


@pytest.mark.skipif(torch.get_default_device().type != "cpu",
                    reason="off CPU the range check is a device-side assertion, which ends the CUDA context")
def test_bad_input_raises_through_the_public_ops():
    values, indices, weights = gather_inputs(GATHER_SHAPES[0], torch.float32)
    with pytest.raises(IndexError, match="indices must lie in"):
        weighted_gather(values, indices + values.shape[0], weights, backend="ext")
    with pytest.raises(TypeError, match="indices must have dtype"):
        weighted_gather(values, indices.int(), weights, backend="ext")
    with pytest.raises(ValueError, match="weights must have the shape of indices"):
        weighted_gather(values, indices, weights[:, :-1], backend="ext")
    with pytest.raises(ValueError, match="topk must lie in"):
        product_key_topk(torch.randn(4, 2, 8), torch.randn(2, 2, 5, 4), 6, backend="ext")


def test_memory_layer_matches_torch_backend():
    torch.manual_seed(1)
    layer = ProductKeyMemory(48, n_keys=12, heads=2, topk=4, key_dim=16, backend="ext")
    twin = ProductKeyMemory(48, n_keys=12, heads=2, topk=4, key_dim=16, backend="torch")
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(3, 7, 48)
    out, ref = layer(x), twin(x)
    assert rel_err(out, ref) < 1e-5
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-4, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_fused_backward_gives_each_gradient_asked_for(dtype, sparse, need):
    from smf_kernels.backends import ext_impl  # imported once the fixture has built the extension

    values, indices, weights = gather_inputs((300, 130, 21, 12), dtype)
    indices[0, :3] = 7  # one token reading the same row three times
    update_rows = indices.flatten().unique()[::2].contiguous() if sparse else None
    grad_out = torch.randn(21, 130).to(dtype)
    got_values, got_weights = ext_impl.BACKEND.gather_backward(grad_out, values, indices, weights, update_rows, True,
                                                               *need)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    table, per_sample = values.double().requires_grad_(), weights.double().requires_grad_()
    want_values, want_weights = torch.autograd.grad(
        weighted_gather_reference(table, indices, per_sample), (table, per_sample), grad_out.double())
    if sparse:
        want_values = want_values[update_rows]
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float64: 1e-12}[dtype]  # exact inputs, acc sums
    assert got_values.dtype == got_weights.dtype == acc
    assert got_values.shape[0] == (want_values.shape[0] if need[0] else 0)
    assert got_weights.shape[0] == (21 if need[1] else 0)
    if need[0]:
        assert rel_err(got_values, want_values) < tol
    if need[1]:
        assert rel_err(got_weights, want_weights) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_fused_topk_backward_matches_reference(dtype, need):
    query = torch.randn(37, 3, 24).to(dtype).requires_grad_(need[0])
    keys = (torch.rand(3, 2, 10, 12) * 2 - 1).to(dtype).requires_grad_(need[1])
    scores, slots = product_key_topk(query, keys, 5, backend="ext")
    grad = torch.randn(scores.shape, dtype=torch.float64)
    wanted = [t for t, n in zip((query, keys), need) if n]
    got = torch.autograd.grad(scores, wanted, grad.to(scores.dtype))
    q, k = query.detach().double().requires_grad_(), keys.detach().double().requires_grad_()
    n_keys, half = 10, 12
    i, j = slots // n_keys, slots % n_keys
    heads = torch.arange(3).view(1, -1, 1).expand_as(i)
    # the chosen slots' scores as a function of query and keys, differentiated in float64
    ref_scores = ((q[..., :half].unsqueeze(2) * k[heads, 0, i]).sum(-1)
                  + (q[..., half:].unsqueeze(2) * k[heads, 1, j]).sum(-1))
    want = [w for w, n in zip(torch.autograd.grad(ref_scores, (q, k), grad), need) if n]
    tol = 1e-12 if dtype == torch.float64 else 1e-5  # exact inputs, sums in fp32
    for g, w, t in zip(got, want, wanted):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert rel_err(g, w) < (tol if dtype != torch.bfloat16 else 1e-2)


def test_topk_backward_op_passes_opcheck():
    query, keys = torch.randn(9, 2, 8), torch.rand(2, 2, 6, 4)
    _, slots = product_key_topk(query, keys, 3, backend="ext")
    grad = torch.randn(9, 2, 3)
    for need in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.smf_kernels.product_key_topk_backward,
                              (grad, query, keys, slots, "ext", *need))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_backward_weight_grad_does_not_depend_on_update_rows(dtype):
    """One dot product order everywhere (D = 130: four 32-lane chunks and a tail): the weight gradient
    is the same bits whichever rows get a value gradient, and from the weights-only op."""
    from smf_kernels.backends import ext_impl

    values, indices, weights = gather_inputs((300, 130, 21, 12), dtype)
    grad_out = torch.randn(21, 130).to(dtype)
    runs = [ext_impl.BACKEND.gather_backward(grad_out, values, indices, weights, rows, True, True, True)[1]
            for rows in (None, indices.flatten().unique(), torch.tensor([3, 50]))]
    runs.append(ext_impl.BACKEND.gather_backward(grad_out, values, indices, weights, None, True, False, True)[1])
    runs.append(ext_impl._ext.gather_backward_weights(grad_out, values, indices))
    assert all(torch.equal(run, runs[0]) for run in runs[1:])
    want = torch.einsum("nd,nld->nl", grad_out.double(), values.double()[indices])
    assert rel_err(runs[0], want) < 1e-6


def test_large_outputs_reuse_freed_blocks_without_stale_values():
    """Outputs of 4 MB and more come from a cache of freed blocks (csrc/cpu_output_pool.h): a block
    filled with NaN and freed is handed to the next output of its size, which must not show it."""
    from smf_kernels.backends import ext_impl

    with torch.device("cpu"):  # the pool is the CPU kernels' (also under SMF_TEST_DEVICE=cuda)
        values, indices, weights = gather_inputs((2500, 500, 2100, 6), torch.float32)  # out: 4.2 MB, grad: 5 MB
        grad_out = torch.randn(2100, 500)
    ext_impl.release_idle_outputs()
    first_out = weighted_gather(values, indices, weights, backend="ext")
    first_grad = ext_impl.BACKEND.gather_backward(grad_out, values, indices, weights, None, True, True, False)[0]
    blocks = {first_out.data_ptr(), first_grad.data_ptr()}
    first_out.fill_(float("nan"))
    first_grad.fill_(float("nan"))
    del first_out, first_grad
    out = weighted_gather(values, indices, weights, backend="ext")
    grad = ext_impl.BACKEND.gather_backward(grad_out, values, indices, weights, None, True, True, False)[0]
    assert {out.data_ptr(), grad.data_ptr()} == blocks  # the freed blocks were reused
    assert rel_err(out, weighted_gather_reference(values.double(), indices, weights.double())) < 1e-5
    table = values.double().requires_grad_()
    want = torch.autograd.grad(weighted_gather_reference(table, indices, weights.double()), table, grad_out.double())[0]
    assert rel_err(grad, want) < 1e-5
    del out, grad
    assert ext_impl.release_idle_outputs() >= 2 * 4 * 2100 * 500


def test_topk_key_gradient_over_several_token_chunks_is_exact_and_thread_independent():
    """N = 2500: the key gradient is summed in two chunks of 1250 tokens, then over the chunks."""
    query = torch.randn(2500, 2, 24, dtype=torch.float64)
    keys = torch.rand(2, 2, 10, 12, dtype=torch.float64) * 2 - 1
    _, slots = product_key_topk(query, keys, 4, backend="ext")
    grad = torch.randn(2500, 2, 4, dtype=torch.float64)
    q, k = query.clone().requires_grad_(), keys.clone().requires_grad_()
    i, j = slots // 10, slots % 10
    heads = torch.arange(2).view(1, -1, 1).expand_as(i)
    ref_scores = (q[..., :12].unsqueeze(2) * k[heads, 0, i]).sum(-1) + (q[..., 12:].unsqueeze(2) * k[heads, 1, j]).sum(-1)
    want = torch.autograd.grad(ref_scores, k, grad)[0]
    threads = torch.get_num_threads()
    got = []
    try:
        for num_threads in (max(2, threads), 1):
            torch.set_num_threads(num_threads)
            k = keys.clone().requires_grad_()
            scores, _ = product_key_topk(query, k, 4, backend="ext")
            got.append(torch.autograd.grad(scores, k, grad)[0])
    finally:
        torch.set_num_threads(threads)
    assert rel_err(got[0], want) < 1e-12
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_value_gradient_is_the_same_bits_by_slot_by_row_and_dense(dtype):
    """The value gradient of update rows (unsorted, one of them never read, one read many times) comes from three
    groupings of the reads: by slot (no weight gradient: nothing the size of the table), by table row (with the
    weight gradient) and dense; each row sums its reads in read order, so all three agree bit for bit."""
    from smf_kernels.backends import ext_impl

    values, indices, weights = gather_inputs((5000, 130, 61, 12), dtype)
    indices[:, :4] = 7  # a hot row
    unread = torch.tensor([i for i in range(5000) if i not in set(indices.flatten().tolist())][:1])
    rows = torch.cat([indices.flatten().unique()[::3], unread])
    rows = rows[torch.randperm(rows.numel())]
    grad_out = torch.randn(61, 130).to(dtype)
    backward = ext_impl.BACKEND.gather_backward
    by_slot, none = backward(grad_out, values, indices, weights, rows, True, True, False)
    by_row, grad_weights = backward(grad_out, values, indices, weights, rows, True, True, True)
    dense, _ = backward(grad_out, values, indices, weights, None, True, True, False)
    assert none.shape[0] == 0 and grad_weights.shape == (61, 12)
    assert torch.equal(by_slot, by_row) and torch.equal(by_slot, dense[rows])
    assert not by_slot[rows == unread[0]].any()
    table = values.double().requires_grad_()
    (want,) = torch.autograd.grad(weighted_gather_reference(table, indices, weights.double()), table,
                                  grad_out.double())
    assert rel_err(by_slot, want[rows]) < (1e-12 if dtype == torch.float64 else 1e-5)


def test_fused_backward_sorts_many_reads_in_parallel_in_the_serial_order():
    """140,800 reads: with two threads the reads are sorted by row in two parts (one per thread), which
    must give the one-thread (one-part) order, hence bit-identical gradients, and the reference's values."""
    from smf_kernels.backends import ext_impl

    values, indices, weights = gather_inputs((300, 40, 2200, 64), torch.float32)
    grad_out = torch.randn(2200, 40)
    threads = torch.get_num_threads()
    runs = []
    try:
        for num_threads in (max(2, threads), 1):
            torch.set_num_threads(num_threads)
            runs.append(ext_impl.BACKEND.gather_backward(grad_out, values, indices, weights, None, True, True, True))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    table, per_sample = values.double().requires_grad_(), weights.double().requires_grad_()
    want = torch.autograd.grad(weighted_gather_reference(table, indices, per_sample), (table, per_sample),
                               grad_out.double())
    assert all(rel_err(got, w) < 1e-5 for got, w in zip(runs[0], want))


@pytest.mark.parametrize("topk", [1, 5, 16, 17])
def test_topk_with_many_exact_ties_and_signed_zeros_matches_reference_exactly(topk):
    """Small-integer sub-scores tie often (and -0.0 ties +0.0): the ranking must give the lower slot id
    first, as the reference does. topk <= 16 takes the float32 vector insertion, 17 the general path."""
    gen = torch.Generator().manual_seed(topk)
    device = torch.get_default_device()  # drawn on CPU, where the generator is, then moved
    query = torch.randint(-1, 2, (300, 2, 8), generator=gen, device="cpu").float().to(device)
    keys = torch.randint(-1, 2, (2, 2, 128, 4), generator=gen, device="cpu").float().to(device)
    keys[0, 0, ::3] = -0.0
    scores, indices = product_key_topk(query, keys, topk, backend="ext")
    ref_scores, ref_indices = product_key_topk_reference(query, keys, topk)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(scores, ref_scores.to(scores.dtype))


_RAW_BACKWARD_CASES = '''
import torch
from smf_kernels.backends.ext_impl import _ext

def refused(name, call):
    try:
        call()
    except RuntimeError as err:
        assert name in str(err), (name, str(err))
        print("refused", name, flush=True)
    else:
        raise AssertionError(f"{name}: accepted")

v, g, w = torch.randn(6, 4), torch.randn(3, 4), torch.rand(3, 2)
i = torch.randint(0, 6, (3, 2))
bad = i.clone(); bad[1, 1] = 10 ** 9
refused("indices", lambda: _ext.gather_backward(g, v, bad, w, None, True, True))
refused("indices", lambda: _ext.gather_backward(g, v, -bad, w, None, True, True))
refused("weights", lambda: _ext.gather_backward(g, v, i, w[:, :1], None, True, True))
refused("grad_out", lambda: _ext.gather_backward(g[:2], v, i, w, None, True, True))
refused("update_rows", lambda: _ext.gather_backward(g, v, i, w, torch.tensor([1, 6]), True, True))
refused("update_rows", lambda: _ext.gather_backward(g, v, i, w, torch.tensor([2, 2]), True, True))
q, k, s = torch.randn(5, 2, 8), torch.randn(2, 2, 7, 4), torch.randn(5, 2, 3)
slots = torch.randint(0, 49, (5, 2, 3))
wrong = slots.clone(); wrong[4, 1, 2] = 49
refused("indices", lambda: _ext.topk_backward(s, q, k, wrong, True, True))
refused("indices", lambda: _ext.topk_backward(s, q, k, slots[:4], True, True))
refused("grad_scores", lambda: _ext.topk_backward(s[..., :2], q, k, slots, True, True))
refused("keys", lambda: _ext.topk_backward(s, q, k[:1], slots, True, True))
'''


def test_raw_backward_entry_points_refuse_bad_input_without_crashing():
    """The extension never trusts its inputs: the fused backward bindings, called directly (not through the
    ops, which check first), raise naming the argument; run in a child process, so a crash fails one test."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run([sys.executable, "-c", _RAW_BACKWARD_CASES], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, f"exit {child.returncode}: {child.stdout[-2000:]} {child.stderr[-3000:]}"
    assert child.stdout.count("refused") == 10
