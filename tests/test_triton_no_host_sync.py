"""The Triton path's forward and backward never call an op that synchronises a CUDA stream with the host.

Recorded on CPU under the interpreter with a TorchDispatchMode around the backend's
entry points (argument checks in smf_kernels.ops are outside: on CUDA they use
torch._assert_async). Ops whose result size or value must reach the host sync there.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smf_kernels.backends import implementation
from smf_kernels.memory import ProductKeyMemory

SYNCING = ("nonzero", "unique", "local_scalar_dense", "masked_", "item", "is_nonzero", "equal",
           "repeat_interleave", "bincount", "histc", "argwhere", "where.default_1arg")


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__) + "." + func._overloadname
        if name.startswith(("index.", "index_put")) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            name = "masked_" + name  # a boolean index sizes its result from the data: nonzero inside
        self.names.append(name)
        return func(*args, **(kwargs or {}))


def _syncing(names):
    return sorted({n for n in names if any(n.lstrip("_").startswith(s) for s in SYNCING)})


def _gather_inputs(n=21, rows=50, per_token=6, dim=40):
    values = torch.randn(rows, dim)
    indices = torch.randint(0, rows, (n, per_token))
    weights = torch.randn(n, per_token)
    return values, indices, weights


def test_topk_forward_makes_no_host_sync():
    query, keys = torch.randn(19, 2, 32), torch.randn(2, 2, 20, 16)
    with _RecordOps() as rec:
        implementation("triton").topk_forward(query, keys, 5)
    assert not _syncing(rec.names), _syncing(rec.names)


def test_topk_backward_makes_no_host_sync():
    query, keys = torch.randn(19, 2, 32), torch.randn(2, 2, 20, 16)
    _, slots = implementation("triton").topk_forward(query, keys, 5)
    with _RecordOps() as rec:
        implementation("triton").topk_backward(torch.randn(19, 2, 5), query, keys, slots, True, True)
    assert not _syncing(rec.names), _syncing(rec.names)


def test_gather_forward_with_counts_makes_no_host_sync():
    values, indices, weights = _gather_inputs()
    counts = torch.zeros(values.shape[0], dtype=torch.int64)
    valid = torch.rand(indices.shape[0]) > 0.3
    with _RecordOps() as rec:
        implementation("triton").gather_forward(values, indices, weights, counts, valid)
    assert not _syncing(rec.names), _syncing(rec.names)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_gather_backward_makes_no_host_sync(sparse, deterministic):
    values, indices, weights = _gather_inputs()
    grad_out = torch.randn(indices.shape[0], values.shape[1])
    update_rows = torch.randperm(values.shape[0])[:17].sort().values if sparse else None
    with _RecordOps() as rec:
        grad_values, grad_weights = implementation("triton").gather_backward(
            grad_out, values, indices, weights, update_rows, deterministic, True, True)
    assert not _syncing(rec.names), _syncing(rec.names)
    assert grad_values.shape == (17 if sparse else values.shape[0], values.shape[1])
    assert grad_weights.shape == indices.shape


def test_recorder_sees_a_syncing_op():
    with _RecordOps() as rec:
        torch.unique(torch.tensor([3, 1, 3]))
        torch.tensor([1.0, 0.0]).nonzero()
        torch.arange(3)[torch.tensor([True, False, True])]
        torch.tensor(2.0).item()
    assert len(_syncing(rec.names)) == 4, rec.names
