"""Value tables on transparent huge pages (smf_kernels.huge_pages, ProductKeyMemory(huge_pages=True)): the same
table bit for bit, kept where it is by load_state_dict, and on huge pages where the system's THP mode allows."""
import mmap

import pytest
import torch

from smf_kernels import ProductKeyMemory
from smf_kernels import memory as memory_module
from smf_kernels.huge_pages import empty_on_huge_pages, huge_page_bytes, transparent_huge_pages

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="MADV_HUGEPAGE is Linux's")


def test_empty_on_huge_pages_is_a_writable_contiguous_tensor_of_the_shape():
    table = empty_on_huge_pages((1000, 37), torch.float32)
    assert table.shape == (1000, 37) and table.dtype == torch.float32 and table.is_contiguous()
    assert table.device.type == "cpu"
    drawn = torch.randn(1000, 37, generator=torch.Generator().manual_seed(0))
    table.copy_(drawn)
    assert torch.equal(table, drawn)
    half = empty_on_huge_pages((7, 3, 5), torch.bfloat16)
    assert half.shape == (7, 3, 5) and half.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(), (0, 4), (3, -1), (2.0, 3), (True, 3)])
def test_empty_on_huge_pages_refuses_bad_shapes(shape):
    with pytest.raises(ValueError, match="shape must be a non-empty tuple of positive ints"):
        empty_on_huge_pages(shape, torch.float32)


@pytest.mark.skipif(transparent_huge_pages() not in ("always", "madvise"), reason="THP off on this system")
def test_a_fresh_table_is_faulted_in_on_huge_pages():
    table = empty_on_huge_pages((5 * 2 ** 20,), torch.float32)  # 20 MiB: 10 whole 2 MiB pages
    assert huge_page_bytes(table) == 0  # nothing written yet: no page at all
    table.fill_(1.5)
    assert huge_page_bytes(table) >= 16 * 2 ** 20


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_memory_on_huge_pages_is_the_same_memory(dtype):
    torch.manual_seed(3)
    plain = ProductKeyMemory(40, n_keys=23, heads=2, topk=5, key_dim=18, dtype=dtype)
    torch.manual_seed(3)
    huge = ProductKeyMemory(40, n_keys=23, heads=2, topk=5, key_dim=18, dtype=dtype, huge_pages=True)
    assert huge.huge_pages and not plain.huge_pages
    for (name, a), (_, b) in zip(plain.state_dict().items(), huge.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    x = torch.randn(31, 40, dtype=plain.values.dtype)
    assert torch.equal(plain(x), huge(x))
    # load_state_dict copies into the table: it stays in its mapping
    pointer = huge.values.data_ptr()
    plain.values.data.add_(torch.randn_like(plain.values))
    huge.load_state_dict(plain.state_dict())
    assert huge.values.data_ptr() == pointer and torch.equal(huge.values, plain.values)


def test_memory_takes_huge_pages_by_default_for_large_tables(monkeypatch):
    assert not ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8).huge_pages  # 4 KiB
    monkeypatch.setattr(memory_module, "HUGE_PAGES_MIN_BYTES", 64 * 16 * 4)  # this table's size
    expected = transparent_huge_pages() in ("always", "madvise")
    assert ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8).huge_pages == expected
    assert not ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8, dtype=torch.bfloat16).huge_pages  # 2 KiB
    assert not ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8, huge_pages=False).huge_pages
    with torch.device("meta"):  # not on CPU: no huge pages, and no error
        assert not ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8).huge_pages


def test_memory_huge_pages_must_be_a_bool_on_cpu():
    with pytest.raises(ValueError, match="huge_pages must be a bool or None"):
        ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8, huge_pages="yes")
    with torch.device("meta"), pytest.raises(ValueError, match="huge_pages needs a CPU table"):
        ProductKeyMemory(16, n_keys=8, topk=4, key_dim=8, huge_pages=True)
