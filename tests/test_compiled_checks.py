"""Compiled calls check their inputs as eager ones do, on every backend (issue 27, item 1).

torch.compile traces the public ops but calls the custom ops' bodies as they are, so the
data-dependent checks (index ranges, distinct update rows) live in those bodies. The Triton
kernels also guard every access through a loaded index themselves (smf_kernels.triton_kernels.guards):
tested here by calling the kernels' launchers directly, with no host check in front of them.
``aot_eager`` traces exactly as Inductor does (dynamo, then AOTAutograd) without compiling C++.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import rel_err
from smf_kernels.backends import unavailable_reason
from smf_kernels.ops import weighted_gather
from smf_kernels.reference import weighted_gather_reference
from smf_kernels.sparse import RowGradSink

pytestmark = pytest.mark.skipif(torch.get_default_device().type != "cpu",
                                reason="off CPU a range check is a device-side assertion, which ends the context")

BACKENDS = [b for b in ("torch", "triton", "ext") if unavailable_reason(b, torch.device("cpu")) is None]


def _compiled_gather(backend, fullgraph=True):
    torch._dynamo.reset()  # every example traces afresh: no cached graph, no silent fallback to eager

    def call(values, indices, weights, counts, grad_sink):
        return weighted_gather(values, indices, weights, counts=counts, grad_sink=grad_sink, backend=backend)
    return torch.compile(call, backend="aot_eager", fullgraph=fullgraph, dynamic=False)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_compiled_gather_matches_the_reference_or_raises_on_bad_ids(backend, data):
    m, n, d, l = 6, data.draw(st.integers(1, 5), label="N"), 5, 3
    indices = torch.randint(0, m, (n, l))
    bad = data.draw(st.sampled_from([None, -1, m, 100, 10 ** 8]), label="bad id")
    if bad is not None:
        indices[data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, l - 1))] = bad
    values = torch.randn(m, d, requires_grad=True)
    weights = torch.softmax(torch.randn(n, l), -1).requires_grad_()
    counts = torch.randint(0, 3, (m,))
    before = counts.clone()
    compiled = _compiled_gather(backend)
    if bad is not None:
        with pytest.raises(IndexError, match=rf"indices must lie in \[0, {m}\)"):
            compiled(values, indices, weights, counts, None)
        assert torch.equal(counts, before), "a rejected call must not count its reads"
        return
    out = compiled(values, indices, weights, counts, None)
    out.backward(torch.ones_like(out))
    assert rel_err(out, weighted_gather_reference(values, indices, weights)) < 1e-6
    assert torch.equal(counts, before + torch.bincount(indices.flatten(), minlength=m))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows, error, match", [
    ([1, 1], ValueError, "update_rows must hold distinct rows"),
    ([2, 6], IndexError, r"update_rows must lie in \[0, 6\)"),
])
def test_compiled_backward_checks_the_sinks_rows(backend, rows, error, match):
    """A row-gradient sink's rows are checked where the backward uses them."""
    values = torch.randn(6, 4, requires_grad=True)
    indices, weights = torch.randint(0, 6, (3, 2)), torch.rand(3, 2)
    sink = RowGradSink(values, 2, fill="rows_first")
    sink.set_rows(torch.tensor(rows), torch.ones(2, dtype=torch.bool))
    out = _compiled_gather(backend, fullgraph=False)(values, indices, weights, None, sink)
    with pytest.raises(error, match=match):
        out.sum().backward()


@pytest.mark.skipif("triton" not in BACKENDS, reason="the Triton interpreter is off")
@pytest.mark.parametrize("bad", [-1, 7, 10 ** 8])
def test_triton_forward_kernel_guards_its_own_ids(bad):
    """The kernel alone (no host check in front): the out-of-range read adds nothing and is not
    counted, every other read is, the error flag goes up, and the launcher raises."""
    from smf_kernels.triton_kernels import gather as triton_gather

    values, weights = torch.randn(7, 5), torch.rand(4, 3)
    indices = torch.randint(0, 7, (4, 3))
    indices[2, 1] = bad
    counts = torch.zeros(7, dtype=torch.int64)
    plan, out, flag = triton_gather.plan_gather_forward(values, indices, weights, counts, None)
    plan.launch()
    assert int(flag[0]) == 1
    kept = weights.clone()
    kept[2, 1] = 0.0
    assert rel_err(out, weighted_gather_reference(values, indices.clamp(0, 6), kept)) < 1e-6
    assert torch.equal(counts, torch.bincount(indices[indices != bad], minlength=7))
    with pytest.raises(RuntimeError, match=r"indices must lie in \[0, 7\)"):
        triton_gather.gather_forward(values, indices, weights, None, None)
