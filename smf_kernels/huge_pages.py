"""CPU tensors on transparent huge pages (Linux), for large value tables.

A step of a 1M-slot memory reads 2,048 x 64 random rows of a 3.5 GiB table: with 4 KB pages nearly every row read
also misses the TLB, and the page walk reads page tables of 7 MiB (1/512 of the table) that no L2 holds. Memory
advised ``MADV_HUGEPAGE`` before its pages are first written is faulted in as 2 MB pages (where the system's THP
mode is ``always`` or ``madvise``), so no later ``MADV_COLLAPSE`` of the table is needed. Measured
(benchmarks/RESULTS.md, 2026-11-29): the ext gather of a step's reads 13% faster at 1M slots and 10% at 16k, the
1M/16k step ratio 1.21-1.27x -> 1.19-1.23x; faulting a 3.5 GiB table in as huge pages took 7 s more system time
on the project's VM (the kernel compacts memory for each 2 MB page).
:class:`~smf_kernels.memory.ProductKeyMemory` uses them by default for tables of at least
:data:`HUGE_PAGES_MIN_BYTES`.
"""
from __future__ import annotations

import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 with 4 KB base pages
# Tables from which ProductKeyMemory(huge_pages=None) takes huge pages: their 4 KB page tables (1/512 of the table,
# 1 MiB here) outgrow a core's L2, so that the gather's page walks go to L3 or memory.
HUGE_PAGES_MIN_BYTES = 512 << 20
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> str:
    """The system's THP mode: "always", "madvise" or "never" (the bracketed word of
    /sys/kernel/mm/transparent_hugepage/enabled); "unavailable" where there is none (not Linux, or a kernel
    without THP)."""
    try:
        with open(_THP_ENABLED) as handle:
            text = handle.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` in fresh anonymous memory advised
    ``MADV_HUGEPAGE`` before any of it is written, so that its pages are faulted in as huge pages where the THP
    mode allows (:func:`transparent_huge_pages` "always" or "madvise"; with "never" they are ordinary pages).
    The tensor keeps the mapping alive; it is unmapped when the last tensor viewing it is freed. A copy
    (``.clone()``, ``.to(dtype)``, ``copy.deepcopy``, ``torch.load``) is an ordinary tensor; ``copy_`` into it
    (``load_state_dict``) keeps it where it is; ``share_memory_()`` moves it to shared memory. Its storage cannot
    be resized (``resize_`` raises).

    ValueError for an empty shape or a non-positive size; RuntimeError where the system has no
    ``MADV_HUGEPAGE`` (not Linux)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        raise RuntimeError("huge pages: this system has no MADV_HUGEPAGE (transparent huge pages are Linux's)")
    if not shape or any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in shape):
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    # Whole huge pages: the mapping's tail would otherwise be 4 KB pages.
    mapping = mmap.mmap(-1, -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(shape)


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage that lie on huge pages now (the AnonHugePages of its mappings in
    /proc/self/smaps); 0 where that cannot be read (not Linux)."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as handle:
            for line in handle:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(part, 16) for part in head.split("-"))
                    inside = low < end and start < high
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return min(total, end - start)
