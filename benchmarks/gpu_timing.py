"""Timers of the GPU run's benchmarks: an op's time with its host path, and its kernels' time alone."""
from __future__ import annotations

import statistics
import time


def op_time(fn, device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (CUDA: CUDA events around each call, after one warm-up
    call that also compiles; CPU: wall clock), the host's work in the call included."""
    import torch

    if device.type == "cuda":
        fn()  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_time(fn, device, calls: int) -> tuple[float, float]:
    """(ms, launches) per call of ``fn``, from ``torch.profiler`` over ``calls`` calls: on CUDA the summed GPU time
    of every kernel (and memset/copy) a call launches, without the host's time between them; on CPU (the dry
    run) the summed self time of the torch ops, the interpreter's kernels not counted."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if not cuda or e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total if cuda else e.self_cpu_time_total for e in events)
    return total_us / calls / 1e3, sum(e.count for e in events) / calls


def kernel_time_or_reason(fn, device, calls: int) -> tuple[float | None, float | None, str | None]:
    """:func:`kernel_time` as (ms, launches, None), or (None, None, why) when the profiler fails: a row keeps its
    check and op times whatever the profiler does."""
    try:
        return (*kernel_time(fn, device, calls), None)
    except Exception as exc:  # noqa: BLE001 - any profiler failure is that column's, not the row's
        return None, None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
