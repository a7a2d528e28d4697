"""ProductKeyMemory: init, forward against a reference composition, counting, sparse grads, compile."""
import pytest
import torch
import torch.nn.functional as F

from helpers import affine, backends_under_test, rel_err
from smf_kernels import ProductKeyMemory
from smf_kernels.reference import product_key_topk_reference, weighted_gather_reference

BACKENDS = backends_under_test()
SMALL = dict(n_keys=12, heads=2, topk=4, key_dim=20)  # awkward: 144 slots, halves of 10


def _reference_forward(mem: ProductKeyMemory, x: torch.Tensor) -> torch.Tensor:
    """docs/method.md#the-memory-layer steps 1-6 written out with the reference ops."""
    flat = x.reshape(-1, mem.d_model)
    q = affine(mem.query_map, flat).view(-1, mem.heads, mem.key_dim)
    scores, slots = product_key_topk_reference(q, mem.keys, mem.topk)
    p = torch.softmax(scores.float(), -1)
    r = weighted_gather_reference(mem.values, slots.flatten(1), p.flatten(1))
    return affine(mem.out_map, r * F.silu(affine(mem.gate_map, flat))).view_as(x)


def test_paper_size_parameter_count_and_init():
    with torch.device("meta"):
        mem = ProductKeyMemory(896)
    counts = {name: p.numel() for name, p in mem.named_parameters()}
    assert counts["values"] == 14_680_064
    assert counts["query_map.weight"] + counts["query_map.bias"] == 918_528
    assert counts["keys"] == 131_072
    assert counts["gate_map.weight"] + counts["gate_map.bias"] == 803_712
    assert sum(counts.values()) == 17_337_088
    small = ProductKeyMemory(64, n_keys=32, heads=2, topk=4, key_dim=64, value_dim=128)
    assert small.values.shape == (1024, 128) and small.keys.shape == (2, 2, 32, 32)
    assert abs(small.values.std().item() - 128 ** -0.5) < 0.01
    assert small.keys.abs().max() <= 64 ** -0.5
    assert abs(small.gate_map.weight.std().item() - 64 ** -0.5) < 0.02
    bound = (6 / (64 + 2 * 64)) ** 0.5  # xavier-uniform of query_map (64 -> heads * key_dim)
    assert small.query_map.weight.abs().max() <= bound


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_backward_match_reference(backend):
    mem = ProductKeyMemory(40, backend=backend, **SMALL)
    x = torch.randn(3, 7, 40, requires_grad=True)
    out = mem(x)
    ref = _reference_forward(mem, x)
    assert out.shape == x.shape
    assert rel_err(out, ref) < 1e-5
    grad = torch.randn_like(out)
    params = [x] + list(mem.parameters())
    got = torch.autograd.grad(out, params, grad)
    want = torch.autograd.grad(ref, params, grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-4


def test_read_counting_on_off_reset_and_padding():
    mem = ProductKeyMemory(40, **SMALL)
    x = torch.randn(2, 5, 40)
    mem(x)
    assert mem.read_counts.sum() == 0, "counting is off by default"
    mem.set_read_counting(True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mem(x, valid_mask=mask)
    _, slots = mem.lookup(x.reshape(-1, 40))
    expected = torch.bincount(slots[mask.flatten()].flatten(), minlength=mem.num_slots)
    assert torch.equal(mem.read_counts, expected)
    assert mem.read_counts.sum() == 8 * mem.heads * mem.topk
    mem.reset_read_counts()
    assert mem.read_counts.sum() == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="key_dim must be even"):
        ProductKeyMemory(40, key_dim=21)
    with pytest.raises(ValueError, match="topk must be <= n_keys"):
        ProductKeyMemory(40, n_keys=4, topk=5)
    with pytest.raises(ValueError, match="n_keys must be a positive int"):
        ProductKeyMemory(40, n_keys=0)
    mem = ProductKeyMemory(40, **SMALL)
    with pytest.raises(ValueError, match=r"x must have shape \(..., d_model=40\)"):
        mem(torch.randn(3, 41))
    with pytest.raises(ValueError, match="valid_mask must have shape"):
        mem(torch.randn(2, 3, 40), valid_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="sink must be a GradientSink or None, got Tensor"):
        mem.set_grad_sink(torch.tensor([1]))
    with pytest.raises(TypeError, match="x must be a floating-point tensor .* got dtype int64"):
        mem(torch.ones(2, 40, dtype=torch.int64))  # token ids by mistake: refused, not cast to floats
    with pytest.raises(ValueError, match="backend: unknown backend 'cuda'"):  # a device name is no backend
        ProductKeyMemory(40, **SMALL, backend="cuda")


def test_compiles_without_graph_breaks_with_counting():
    mem = ProductKeyMemory(40, backend="torch", **SMALL)
    mem.set_read_counting(True)
    x = torch.randn(2, 6, 40)
    compiled = torch.compile(mem, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    compiled_grad = mem.values.grad.clone()
    counts_after_compiled = mem.read_counts.clone()
    mem.zero_grad(set_to_none=True)
    eager = mem(x)
    eager.square().sum().backward()
    assert rel_err(out, eager) < 1e-6
    assert rel_err(compiled_grad, mem.values.grad) < 1e-6
    assert counts_after_compiled.sum() == 12 * mem.heads * mem.topk
    assert torch.equal(mem.read_counts, 2 * counts_after_compiled)


@pytest.mark.parametrize("fill", ["rows_first", "reads_kept"])
def test_a_row_gradient_sink_takes_the_rows_gradient_instead_of_a_grad(fill):
    """A RowGradSink as the memory's gradient sink: the values get no .grad; the sink holds the chosen rows'
    gradient, set before the backward or computed from the kept reads after it, equal to those rows of the dense
    gradient."""
    from smf_kernels.sparse import RowGradSink

    mem = ProductKeyMemory(40, **SMALL)
    x = torch.randn(5, 40)
    _, slots = mem.lookup(x)
    dense = torch.autograd.grad(mem(x).square().sum(), mem.values)[0]
    chosen = slots.unique()[:3]
    valid = torch.ones(3, dtype=torch.bool)
    sink = RowGradSink(mem.values, 3, fill=fill)
    mem.set_grad_sink(sink)
    out = mem(x).square().sum()
    if fill == "rows_first":
        sink.set_rows(chosen, valid)
    out.backward()
    assert mem.values.grad is None
    if fill == "reads_kept":
        sink.sum_reads(mem.values, chosen, valid)
    assert rel_err(sink.grad, dense[chosen]) < 1e-6
    unset = RowGradSink(mem.values, 3, fill="rows_first")
    mem.set_grad_sink(unset)
    with pytest.raises(RuntimeError, match="were not set before the backward"):
        mem(x).sum().backward()
    with pytest.raises(TypeError, match="a GradientSink or None"):
        mem.set_grad_sink("all")


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_changes_neither_the_slots_read_nor_finiteness(backend):
    mem = ProductKeyMemory(40, backend=backend, **SMALL)
    x = torch.randn(3, 7, 40)
    _, slots = mem.lookup(x.reshape(-1, 40))
    expected = mem(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, autocast_slots = mem.lookup(x.reshape(-1, 40))
        out = mem(x)
    assert torch.equal(autocast_slots, slots), "the lookup must not run in bf16 under autocast"
    assert torch.isfinite(out).all()
    assert rel_err(out, expected) < 2e-2  # only gate/out projections run in bf16


class _SmfOpCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the smf_kernels custom ops called while active (what each costs on the host: one dispatch)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "smf_kernels":
            self.calls.append(func._opname)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("value_grad", ["dense", "compact"])
def test_a_layer_makes_two_op_calls_each_way(value_grad):
    """The host path of issue 26: top-k and the gated gather forward (counting reads), their two backwards."""
    from smf_kernels.sparse import RowGradSink

    mem = ProductKeyMemory(40, **SMALL)
    mem.set_read_counting(True)
    if value_grad == "compact":
        handle = RowGradSink(mem.values, 3, fill="rows_first")
        handle.set_rows(torch.tensor([0, 5, 9]), torch.ones(3, dtype=torch.bool))
        mem.set_grad_sink(handle)
    x = torch.randn(2, 6, 40, requires_grad=True)
    with _SmfOpCalls() as forward:
        out = mem(x, valid_mask=torch.rand(2, 6) > 0.3)
    with _SmfOpCalls() as backward:
        out.square().sum().backward()
    assert forward.calls == ["product_key_topk", "weighted_gather_forward_counted"], forward.calls
    gather_backward = "weighted_gather_backward_into" if value_grad == "compact" else "weighted_gather_backward"
    assert sorted(backward.calls) == sorted([gather_backward, "product_key_topk_backward"]), backward.calls


FLOAT64_BACKENDS = [b for b in BACKENDS if b != "triton"]  # Triton has no float64


@pytest.mark.parametrize("backend", FLOAT64_BACKENDS)
def test_a_double_memory_computes_in_float64_end_to_end_and_passes_gradcheck(backend):
    """.double(): the whole layer in float64, softmax included (an fp32 step would leave ~1e-8 relative
    error and fail gradcheck, which each op alone passes)."""
    mem = ProductKeyMemory(8, n_keys=6, heads=2, topk=3, key_dim=4, backend=backend).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    flat = x.reshape(-1, 8)
    q = affine(mem.query_map, flat).view(-1, mem.heads, mem.key_dim)
    scores, slots = product_key_topk_reference(q, mem.keys, mem.topk)
    p = torch.softmax(scores, -1)  # float64
    want = affine(mem.out_map, weighted_gather_reference(mem.values, slots.flatten(1), p.flatten(1))
                  * F.silu(affine(mem.gate_map, flat)))
    got = mem(x)
    assert got.dtype == torch.float64
    assert rel_err(got, want) < 1e-13
    names, params = zip(*mem.named_parameters())

    def layer(x, *tensors):
        return torch.func.functional_call(mem, dict(zip(names, tensors)), (x,))

    assert torch.autograd.gradcheck(layer, (x, *[p.detach().requires_grad_() for p in params]))
