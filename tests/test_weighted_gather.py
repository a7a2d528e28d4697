"""weighted_gather: every backend against the reference, forward, histogram, dense and sparse backward."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import TOL, backends_under_test, gather_inputs, gather_into_rows, rel_err
from smf_kernels.ops import weighted_gather
from smf_kernels.reference import weighted_gather_reference

BACKENDS = backends_under_test()
# (M, D, N, L): D not a power of two (96 = 896/ 9.33..., 130 spans two 128-wide tiles),
# N not a multiple of any block.
SHAPES = [(50, 96, 37, 8), (300, 130, 21, 12)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference(backend, shape, dtype):
    values, indices, weights = gather_inputs(shape, dtype)
    out = weighted_gather(values, indices, weights, backend=backend)
    ref = weighted_gather_reference(values.double(), indices, weights.double())
    assert out.dtype == dtype and out.shape == (shape[2], shape[1])
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_histogram_is_exact_and_skips_padding(backend):
    values, indices, weights = gather_inputs(SHAPES[0], torch.float32)
    indices[0, :4] = 7  # repeated slot within one token
    valid = torch.rand(indices.shape[0]) > 0.3
    valid[0] = True
    counts = torch.randint(0, 5, (values.shape[0],))  # counts accumulate onto what is there
    expected = counts + torch.bincount(indices[valid].flatten(), minlength=values.shape[0])
    out = weighted_gather(values, indices, weights, counts=counts, valid=valid, backend=backend)
    assert torch.equal(counts, expected)
    # padding is still computed
    assert rel_err(out, weighted_gather_reference(values, indices, weights)) < 1e-5
    all_counts = torch.zeros_like(counts)
    weighted_gather(values, indices, weights, counts=all_counts, backend=backend)
    assert torch.equal(all_counts, torch.bincount(indices.flatten(), minlength=values.shape[0]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_histogram_into_strided_counts_and_valid(backend):
    values, indices, weights = gather_inputs(SHAPES[0], torch.float32)
    storage = torch.zeros(2 * values.shape[0], dtype=torch.int64)
    counts = storage[::2]  # non-contiguous view; the elements in between must stay untouched
    valid = (torch.rand(2 * indices.shape[0]) > 0.3)[::2]
    weighted_gather(values, indices, weights, counts=counts, valid=valid, backend=backend)
    assert torch.equal(counts, torch.bincount(indices[valid].flatten(), minlength=values.shape[0]))
    assert storage[1::2].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_strided_indices_weights_and_rows_forward_and_backward(backend, sparse):
    """Every index-like input as a strided view (a slice of a wider tensor), the value and weight
    gradients both asked for: the backends see what the op hands them, whatever the caller's layout."""
    values, wide_indices, wide_weights = gather_inputs((50, 96, 37, 16), torch.float32)
    indices = wide_indices[:, ::2]  # (37, 8) with strides (16, 2): viewable as 1-D, but not contiguous
    weights = wide_weights[:, ::2].detach().requires_grad_()
    values.requires_grad_()
    rows = torch.arange(0, 50, 3).repeat_interleave(2)[::2] if sparse else None  # strided (T,)
    valid = (torch.rand(2 * indices.shape[0]) > 0.3)[::2]
    counts = torch.zeros(50, dtype=torch.int64)
    if sparse:
        out, sink = gather_into_rows(values, indices, weights, rows, counts=counts, valid=valid, backend=backend)
    else:
        out = weighted_gather(values, indices, weights, counts=counts, valid=valid, backend=backend)
    grad = torch.randn(out.shape[1], out.shape[0]).t()  # a strided incoming gradient too
    out.backward(grad)
    ref_values, ref_weights = values.detach().double().requires_grad_(), weights.detach().double().requires_grad_()
    weighted_gather_reference(ref_values, indices, ref_weights).backward(grad.double())
    assert rel_err(out, weighted_gather_reference(values.double(), indices, weights.double())) < TOL[torch.float32]
    assert torch.equal(counts, torch.bincount(indices[valid].flatten(), minlength=50))
    if sparse:
        assert values.grad is None
        assert rel_err(sink.grad, ref_values.grad[rows]) < TOL[torch.float32]
    else:
        assert rel_err(values.grad, ref_values.grad) < TOL[torch.float32]
    assert rel_err(weights.grad, ref_weights.grad) < TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_backward_matches_reference(backend, dtype):
    values, indices, weights = gather_inputs(SHAPES[1], dtype, requires_grad=True)
    out = weighted_gather(values, indices, weights, backend=backend)
    ref = weighted_gather_reference(values.double(), indices, weights.double())
    grad = torch.randn(out.shape, dtype=torch.float64)
    got = torch.autograd.grad(out, (values, weights), grad.to(dtype))
    want = torch.autograd.grad(ref, (values, weights), grad)
    assert got[0].dtype == dtype and got[0].layout == torch.strided
    assert rel_err(got[0], want[0]) < TOL[dtype]
    assert rel_err(got[1], want[1]) < TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_row_backward_is_the_dense_one_restricted_to_the_rows(backend, deterministic):
    torch.use_deterministic_algorithms(deterministic)
    values, indices, weights = gather_inputs(SHAPES[0], torch.float32, requires_grad=True)
    rows = torch.cat([indices[:3, 0], torch.tensor([49])]).unique()  # read rows + one maybe unread, ascending
    grad = torch.randn(indices.shape[0], values.shape[1])
    dense = torch.autograd.grad(weighted_gather(values, indices, weights, backend=backend), values, grad)[0]
    out, sink = gather_into_rows(values, indices, weights, rows, backend=backend)
    (grad_weights,) = torch.autograd.grad(out, (weights,), grad)
    assert sink.grad.shape == (rows.numel(), values.shape[1])
    assert rel_err(sink.grad, dense[rows]) < 1e-6
    expected_weights = torch.autograd.grad(weighted_gather_reference(values, indices, weights), weights, grad)[0]
    assert rel_err(grad_weights, expected_weights) < 1e-5


class _LargestAllocation(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_row_backward_never_allocates_dense_gradient(backend, deterministic):
    torch.use_deterministic_algorithms(deterministic)
    num_rows, dim = 20_000, 16
    values = torch.randn(num_rows, dim, requires_grad=True)
    indices = torch.randint(0, num_rows, (9, 6))
    weights = torch.rand(9, 6)
    rows = indices[:2].flatten().unique()
    out, sink = gather_into_rows(values, indices, weights, rows, backend=backend)
    recorder = _LargestAllocation()
    with recorder:
        out.backward(torch.randn_like(out))
    assert values.grad is None and sink.grad.shape == (rows.numel(), dim)
    assert recorder.largest < num_rows * dim // 4, f"a {recorder.largest}-element buffer was allocated"


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_backward_is_bit_reproducible(backend):
    torch.use_deterministic_algorithms(True)
    values, indices, weights = gather_inputs(SHAPES[1], torch.float32, requires_grad=True)
    indices[:, :4] = indices[0, 0]  # a hot row read by every token
    grad = torch.randn(indices.shape[0], values.shape[1])

    def run():
        out = weighted_gather(values, indices, weights, backend=backend)
        return torch.autograd.grad(out, (values, weights), grad)

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_reference_gradcheck_float64():
    values, indices, weights = gather_inputs((9, 5, 4, 3), torch.float64, requires_grad=True)
    weights = weights.detach().double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v, w: weighted_gather_reference(v, indices, w), (values, weights))


def test_custom_op_gradcheck_float64_and_opcheck():
    values, indices, weights = gather_inputs((9, 5, 4, 3), torch.float64, requires_grad=True)
    weights = weights.detach().double().requires_grad_(True)
    gate = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda v, w: weighted_gather(v, indices, w, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (values, weights))
    gated = lambda v, w, g: weighted_gather(v, indices, w, gate=g, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(gated, (values, weights, gate))
    counts = torch.zeros(9, dtype=torch.int64)
    ops = torch.ops.smf_kernels
    v, w, g = values.detach(), weights.detach(), gate.detach()
    for gate_arg in (None, g):
        torch.library.opcheck(ops.weighted_gather_forward.default, (v, indices, w, gate_arg, "torch"))
        torch.library.opcheck(ops.weighted_gather_forward_counted.default,
                              (v, indices, w, counts, None, gate_arg, "torch"))
    grad = torch.randn(4, 5, dtype=torch.float64)
    read = weighted_gather(v, indices, w, backend="torch")
    for gate_arg, read_arg in ((None, None), (g, read)):
        for update_rows in (None, torch.tensor([1, 4])):
            for need_values, need_weights in ((True, True), (True, False), (False, True)):
                torch.library.opcheck(ops.weighted_gather_backward.default,
                                      (grad, v, indices, w, update_rows, gate_arg, read_arg, "torch", False,
                                       need_values, need_weights, True))
        torch.library.opcheck(ops.weighted_gather_backward_into.default,
                              (grad, v, indices, w, torch.tensor([1, 4]), torch.zeros(2, 5, dtype=torch.float64),
                               gate_arg, read_arg, "torch", False, True))


@pytest.mark.skipif(torch.get_default_device().type != "cpu",
                    reason="off CPU the range check is a device-side assertion, which ends the CUDA context")
def test_out_of_range_indices_raise():
    values, indices, weights = gather_inputs(SHAPES[0], torch.float32)
    indices[3, 2] = values.shape[0]
    with pytest.raises(IndexError, match=r"indices must lie in \[0, 50\)"):
        weighted_gather(values, indices, weights)
    indices[3, 2] = -1
    with pytest.raises(IndexError, match="indices must lie in"):
        weighted_gather(values, indices, weights)
    indices[3, 2] = 0
    out, _ = gather_into_rows(values.requires_grad_(), indices, weights, torch.tensor([0, 50]))
    with pytest.raises(IndexError, match="update_rows must lie in"):
        out.sum().backward()


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(values=torch.randn(50)), ValueError, r"values must have shape \(M, D\)"),
        (dict(indices=torch.zeros(37, 8, dtype=torch.int32)), TypeError, "indices must have dtype in"),
        (dict(weights=torch.rand(37, 7)), ValueError, "weights must have the shape of indices"),
        (dict(weights=torch.rand(37, 8).long()), TypeError, "weights must have dtype"),
        (dict(counts=torch.zeros(49, dtype=torch.int64)), ValueError, r"counts must have shape \(M,\)"),
        (dict(counts=torch.zeros(50)), TypeError, "counts must have dtype"),
        (dict(counts=torch.zeros(50, dtype=torch.int64), valid=torch.ones(36, dtype=torch.bool)), ValueError,
         r"valid must have shape \(N,\)"),
        (dict(valid=torch.ones(37, dtype=torch.bool)), ValueError, "pass counts too"),
        (dict(grad_sink=torch.tensor([3, 5])), TypeError, "grad_sink must be a GradientSink or None, got Tensor"),
        (dict(weights=torch.rand(37, 8, device="meta")), ValueError, "same device"),
    ],
)
def test_bad_arguments_raise(change, error, match):
    values, indices, weights = gather_inputs(SHAPES[0], torch.float32)
    args = dict(values=values, indices=indices, weights=weights)
    args.update(change)
    with pytest.raises(error, match=match):
        weighted_gather(args.pop("values"), args.pop("indices"), args.pop("weights"), **args)


def test_unavailable_backend_raises_clearly():
    values, indices, weights = gather_inputs(SHAPES[0], torch.float32)
    with pytest.raises(RuntimeError, match="unknown backend 'cuda'"):
        weighted_gather(values, indices, weights, backend="cuda")


# ------------------------------------------------- the triton backend's row-owned backward, called directly
needs_triton = pytest.mark.skipif("triton" not in BACKENDS, reason="the triton backend cannot run here")
# M = 40 rows of which 30 are read (rows 30-39 never), D = 100 (not a power of two), N = 29 tokens,
# L = 6 reads a token; row 3 is read by every token, twice by some.
ROW_SHAPE = (40, 100, 29, 6)
# Selected rows: the hot row, rows read a few times, and unread ones; distinct, unsorted.
SELECTED = torch.tensor([35, 3, 17, 0, 38, 22])


def _row_inputs(dtype):
    m, d, n, l = ROW_SHAPE
    values = torch.randn(m, d).to(dtype)
    indices = torch.randint(0, 30, (n, l))
    indices[:, 0] = 3
    indices[::3, 4] = 3
    weights = torch.softmax(torch.randn(n, l), -1)
    grad_out = torch.randn(n, d).to(dtype)
    return grad_out, values, indices, weights


def _reference_grads(grad_out, values, indices, weights, update_rows):
    v, w = values.double().requires_grad_(), weights.double().requires_grad_()
    grad_values, grad_weights = torch.autograd.grad(weighted_gather_reference(v, indices, w), (v, w),
                                                    grad_out.double())
    return (grad_values if update_rows is None else grad_values[update_rows]), grad_weights


def _triton_backward(*args, **kwargs):
    from smf_kernels.triton_kernels import row_backward as triton_row_backward

    return triton_row_backward.gather_backward(*args, **kwargs)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("update_rows", [None, SELECTED], ids=["dense", "T rows"])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["both", "dV", "dW"])
def test_row_backward_matches_reference(dtype, update_rows, need):
    grad_out, values, indices, weights = _row_inputs(dtype)
    grad_values, grad_weights = _triton_backward(grad_out, values, indices, weights, update_rows, *need)
    want_values, want_weights = _reference_grads(grad_out, values, indices, weights, update_rows)
    rows = values.shape[0] if update_rows is None else update_rows.numel()
    assert grad_values.shape == ((rows, values.shape[1]) if need[0] else (0, values.shape[1]))
    assert grad_weights.shape == (indices.shape if need[1] else (0, indices.shape[1]))
    assert grad_values.dtype == grad_weights.dtype == torch.float32
    # fp32 sums of the inputs' exact products: fp32 rounding only, bf16 inputs included
    if need[0]:
        assert rel_err(grad_values, want_values) < 1e-6
        unread = torch.isin(torch.arange(values.shape[0]) if update_rows is None else update_rows,
                            indices.unique(), invert=True)
        assert unread.any() and (grad_values[unread] == 0).all(), "rows never read get a zero gradient"
    if need[1]:
        assert rel_err(grad_weights, want_weights) < 1e-6


@needs_triton
@pytest.mark.parametrize("dtype, update_rows", [(torch.float32, None), (torch.bfloat16, SELECTED)])
def test_row_backward_column_tiles_and_one_read_per_step(dtype, update_rows):
    """D = 100 in 32-column tiles (4 tiles, the last partial: dW partials summed through grad_weights)
    and one read per step (the GPU's configuration), against the default tile."""
    grad_out, values, indices, weights = _row_inputs(dtype)
    want_values, want_weights = _reference_grads(grad_out, values, indices, weights, update_rows)
    for tile in ({"BLOCK_D": 32}, {"BLOCK_P": 1}):
        grad_values, grad_weights = _triton_backward(grad_out, values, indices, weights, update_rows, True, True,
                                                     tile=tile)
        assert rel_err(grad_values, want_values) < 1e-6, tile
        assert rel_err(grad_weights, want_weights) < 1e-6, tile


@needs_triton
@pytest.mark.parametrize("update_rows", [None, SELECTED], ids=["dense", "T rows"])
def test_row_backward_is_bit_reproducible_and_one_path(update_rows):
    """No float atomics: two runs, a run under torch.use_deterministic_algorithms and a run with one item per
    program (so other programs draw the hot rows' last tickets and add their partial rows) give the same bits."""
    values, indices, weights = gather_inputs(ROW_SHAPE, torch.float32, requires_grad=True)
    indices[:, :3] = 3  # a hot row
    grad = torch.randn(indices.shape[0], values.shape[1])

    rows = None if update_rows is None else update_rows.sort().values
    if rows is None:
        out = weighted_gather(values, indices, weights, backend="triton")
    else:
        out, sink = gather_into_rows(values, indices, weights, rows, backend="triton")

    def run():  # the backward alone (the interpreter's forward costs seconds)
        if rows is None:
            return torch.autograd.grad(out, (values, weights), grad, retain_graph=True)
        sink.grad.zero_()
        (grad_weights,) = torch.autograd.grad(out, (weights,), grad, retain_graph=True)
        return sink.grad.clone(), grad_weights

    first, second = run(), run()
    torch.use_deterministic_algorithms(True)
    deterministic = run()
    torch.use_deterministic_algorithms(False)
    one_per_program = _triton_backward(grad, values.detach(), indices, weights.detach(), rows, True, True,
                                       tile={"items_per_program": 1})
    for got in (second, deterministic):
        assert all(torch.equal(a, b) for a, b in zip(first, got))
    assert torch.equal(first[0], one_per_program[0]) and torch.equal(first[1], one_per_program[1])


@needs_triton
@pytest.mark.parametrize("dtype, update_rows", [(torch.float32, None), (torch.bfloat16, SELECTED)],
                         ids=["dense fp32", "T rows bf16"])
@pytest.mark.parametrize("tile", [{"SPLIT": 3}, {"SPLIT": 5, "BLOCK_D": 32, "BLOCK_P": 2}, {"SPLIT": 1000}],
                         ids=["split 3", "split 5, 4 column tiles", "no split"])
def test_hot_rows_split_over_programs_match_reference_and_repeat(dtype, update_rows, tile):
    """Rows read more than SPLIT times are walked in chunks by several programs, their partial rows summed in
    chunk order by the last ticket holder: the reference's gradients, the same bits on a second run and with
    one item per program (other programs finish the hot rows)."""
    grad_out, values, indices, weights = _row_inputs(dtype)
    indices[:, 1] = 17  # a second hot row (selected), beside row 3 (selected too)
    indices[::2, 2] = 22
    want_values, want_weights = _reference_grads(grad_out, values, indices, weights, update_rows)
    runs = [_triton_backward(grad_out, values, indices, weights, update_rows, True, True, tile=t)
            for t in (tile, tile, {**tile, "items_per_program": 1})]
    assert rel_err(runs[0][0], want_values) < 1e-6
    assert rel_err(runs[0][1], want_weights) < 1e-6
    for again in runs[1:]:
        assert torch.equal(runs[0][0], again[0]) and torch.equal(runs[0][1], again[1])


@needs_triton
@pytest.mark.parametrize("tile", [{}, {"SPLIT": 3, "BLOCK_D": 32}], ids=["default", "hot rows, column tiles"])
def test_row_backward_into_a_sink_is_the_sink_plus_the_gradient(tile):
    """into=sink: the T rows' gradient added in the kernel's epilogue, the bits of sink += the gradient (hot
    rows' sums included); the sink is what comes back, and a sink of the wrong shape is refused."""
    grad_out, values, indices, weights = _row_inputs(torch.float32)
    sink = torch.randn(SELECTED.numel(), values.shape[1])
    sink[0, :3] = -0.0  # a row never read adds +0.0: -0.0 becomes +0.0 either way
    want = sink + _triton_backward(grad_out, values, indices, weights, SELECTED, True, False, tile=tile)[0]
    got, grad_weights = _triton_backward(grad_out, values, indices, weights, SELECTED, True, True, tile=tile,
                                         into=sink)
    assert got is sink and torch.equal(sink.view(torch.int32), want.view(torch.int32))
    assert rel_err(grad_weights, _reference_grads(grad_out, values, indices, weights, SELECTED)[1]) < 1e-6
    with pytest.raises(ValueError, match=r"into must be a contiguous \(6, 100\) float32 tensor"):
        _triton_backward(grad_out, values, indices, weights, SELECTED, True, False, into=sink[:, :50])


@needs_triton
@pytest.mark.parametrize("bad_rows", [[35, 3, 40], [35, -1, 3], [35, 3, 17, 3]], ids=["past M", "negative", "twice"])
def test_row_backward_rejects_bad_update_rows(bad_rows):
    """Called directly (the op's host check skipped, as on CUDA): the planning kernel checks update_rows as it
    maps them to slots, and the launcher raises."""
    grad_out, values, indices, weights = _row_inputs(torch.float32)
    with pytest.raises(RuntimeError, match=r"update_rows must hold distinct rows there"):
        _triton_backward(grad_out, values, indices, weights, torch.tensor(bad_rows), True, False)


@needs_triton
@pytest.mark.parametrize("update_rows", [None, SELECTED], ids=["dense", "T rows"])
def test_row_backward_rejects_out_of_range_indices(update_rows):
    """Called directly (the op's host check skipped, as under torch.compile): the kernels mask every
    access through a bad index and the launcher raises."""
    grad_out, values, indices, weights = _row_inputs(torch.float32)
    for bad in (values.shape[0], -1, 2**40):
        indices[5, 2] = bad
        with pytest.raises(RuntimeError, match=r"indices must lie in \[0, 40\)"):
            _triton_backward(grad_out, values, indices, weights, update_rows, True, True)
