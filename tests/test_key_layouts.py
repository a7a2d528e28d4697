"""The top-k's key layouts made once (smf_kernels.ops.KeyLayoutCache) and the few-token (decode) lookups: results
bit-identical to the per-call layout and to the same tokens looked up in a batch; the cache remade whenever the keys
change (optimizer step, in-place edit, load_state_dict, .to()), and training through it unchanged."""
import copy

import pytest
import torch

from helpers import backends_under_test
from smf_kernels import ProductKeyMemory
from smf_kernels.backends import implementation
from smf_kernels.ops import KeyLayoutCache, product_key_topk

BACKENDS = backends_under_test()
# (heads, key_dim, n_keys, topk): n_keys not a power of two nor a multiple of 16, a 3-wide half, the paper's head
SHAPES = [(3, 6, 37, 5), (2, 34, 20, 7), (4, 256, 128, 16)]


def _inputs(heads, key_dim, n_keys, tokens, dtype=torch.float32):
    query = torch.randn(tokens, heads, key_dim).to(dtype)
    keys = (torch.rand(heads, 2, n_keys, key_dim // 2) * 2 - 1).to(dtype)
    return query, keys


def _assert_same(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_tokens_with_the_cached_layout_equal_the_per_call_layout(backend, shape, dtype):
    """1..8 tokens (decoding) with the layout made once: bit-identical to the per-call path. On ext also to the
    same tokens inside a batch: its kernel scores a tail of fewer tokens than a register tile with a narrower tile,
    each score the same d-ordered sum (torch's GEMM may round a lone token differently from a batch)."""
    heads, key_dim, n_keys, topk = shape
    if backend == "triton" and key_dim > 64:
        pytest.skip("the Triton interpreter is slow: small shapes only")
    query, keys = _inputs(heads, key_dim, n_keys, 29, dtype)
    batch = product_key_topk(query, keys, topk, backend=backend)
    cache = KeyLayoutCache()
    for tokens in range(1, 9):
        start = 29 - tokens - tokens // 2  # rows that sit mid-tile in the batch
        part = query[start:start + tokens]
        per_call = product_key_topk(part, keys, topk, backend=backend)
        _assert_same(product_key_topk(part, keys, topk, backend=backend, key_layouts=cache), per_call)
        if backend == "ext":
            _assert_same(per_call, (batch[0][start:start + tokens], batch[1][start:start + tokens]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_is_made_once_and_again_after_an_in_place_edit(backend):
    query, keys = _inputs(3, 6, 37, 4)
    cache = KeyLayoutCache()
    made = []
    real = implementation(backend).prepare_topk_keys

    def counting(k):
        made.append(1)
        return real(k)

    impl = implementation(backend)
    impl.prepare_topk_keys = counting
    try:
        for _ in range(3):
            product_key_topk(query, keys, 5, backend=backend, key_layouts=cache)
        assert len(made) == 1
        keys.mul_(-1)  # same storage, shape and dtype: only the version tells
        _assert_same(product_key_topk(query, keys, 5, backend=backend, key_layouts=cache),
                     product_key_topk(query, keys, 5, backend=backend))
        assert len(made) == 2
    finally:
        del impl.prepare_topk_keys


def _memory(backend, seed=0):
    torch.manual_seed(seed)
    return ProductKeyMemory(24, n_keys=37, heads=3, topk=5, key_dim=6, backend=backend)


def _uncached(memory):
    """A copy of ``memory`` whose lookups lay the keys out on every call."""
    twin = copy.deepcopy(memory)
    twin.key_layouts = None
    return twin


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_training_with_keys_learning_equals_the_per_call_layout(backend):
    """Optimizer steps on every parameter, keys included: each step's output and gradients are bit-identical to
    those of a twin that lays the keys out on every call (a stale layout would pick other slots)."""
    cached = _memory(backend)
    twin = _uncached(cached)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (cached, twin)]
    for step in range(4):
        x = torch.randn(2, 7, 24)
        outs = [m(x) for m in (cached, twin)]
        assert torch.equal(outs[0], outs[1]), f"step {step}"
        for out in outs:
            out.square().sum().backward()
        assert cached.keys.grad.abs().sum() > 0
        for a, b in zip(cached.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), f"step {step}"
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    assert not torch.equal(cached.keys, _memory(backend).keys)  # the keys did move


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_load_state_dict_and_to_remake_the_layout(backend):
    memory = _memory(backend)
    x = torch.randn(9, 24)
    memory.lookup(x)  # a layout of the first keys
    memory.load_state_dict(_memory(backend, seed=1).state_dict())
    _assert_same(memory.lookup(x), _uncached(memory).lookup(x))
    memory.double()
    _assert_same(memory.lookup(x.double()), _uncached(memory).lookup(x.double()))
    memory.float()
    _assert_same(memory.lookup(x), _uncached(memory).lookup(x))
    with torch.no_grad():
        memory.keys.copy_(torch.randn_like(memory.keys))
    _assert_same(memory.lookup(x), _uncached(memory).lookup(x))
    memory.keys.data = torch.randn_like(memory.keys)  # new storage under the same Parameter
    _assert_same(memory.lookup(x), _uncached(memory).lookup(x))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_two_memories_and_one_cache_for_two_tables(backend):
    first, second = _memory(backend, 0), _memory(backend, 1)
    x = torch.randn(5, 24)
    for _ in range(2):
        for memory in (first, second):
            _assert_same(memory.lookup(x), _uncached(memory).lookup(x))
    shared = KeyLayoutCache()
    query = torch.randn(5, 3, 6)
    for keys in (first.keys, second.keys, first.keys):
        _assert_same(product_key_topk(query, keys, 5, backend=backend, key_layouts=shared),
                     product_key_topk(query, keys, 5, backend=backend))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_layout_never_requires_grad_and_inference_mode_works(backend):
    memory = _memory(backend)
    x = torch.randn(4, 24)
    memory.lookup(x)
    layout = memory.key_layouts.layout(memory.keys, backend)
    assert layout is None or not layout.requires_grad
    with torch.inference_mode():
        _assert_same(memory.lookup(x), _uncached(memory).lookup(x))
        inference_keys = memory.keys.detach().clone()  # an inference tensor: no version, not cached
        assert memory.key_layouts.layout(inference_keys, backend) is None
    # a functorch wrapper shows no storage: laid out per call
    wrapped = torch.func.vmap(lambda k: torch.tensor(memory.key_layouts.layout(k, backend) is None))(
        memory.keys.detach().unsqueeze(0))
    assert bool(wrapped.all())


@pytest.mark.skipif("ext" not in BACKENDS, reason="the compiled extension is not built")
def test_ext_rejects_a_layout_of_other_keys():
    from smf_kernels.backends import ext_impl

    query, keys = _inputs(3, 6, 37, 4)
    layout = ext_impl._ext.prepare_topk_keys(keys)
    _, other = _inputs(3, 6, 20, 4)
    with pytest.raises(RuntimeError, match="key_layout"):
        ext_impl._ext.topk_forward(query, other[:, :, :20], 5, layout)
    with pytest.raises(RuntimeError, match="key_layout"):
        ext_impl._ext.topk_forward(query, keys, 5, layout.double())
    _assert_same(ext_impl._ext.topk_forward(query, keys, 5, layout), ext_impl._ext.topk_forward(query, keys, 5))
