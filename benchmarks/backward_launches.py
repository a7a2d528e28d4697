"""Count the launches each backward op of the triton backend makes: Triton kernels and ATen ops that run device work.

Runs on CPU under the Triton interpreter at a small shape (the counts do not depend on it): a TorchDispatchMode
records every ATen op the backend's entry point calls, and each Triton launch (``LaunchPlan.launch``) is recorded
as one kernel, with the mode off while the interpreter runs it (its own tensor copies are no GPU launches). ATen
ops that only allocate or make views launch nothing on a GPU and are left out. One ATen op may still be several
GPU kernels: ``sort`` is a radix sort of a few passes.

    TRITON_INTERPRET=1 python benchmarks/backward_launches.py [--json PATH]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

NO_LAUNCH = ("empty", "empty_strided", "empty_like", "view", "reshape", "_reshape_alias", "slice", "select",
             "as_strided", "alias", "detach", "t", "transpose", "expand", "unsqueeze", "squeeze", "_unsafe_view",
             "contiguous", "lift_fresh", "new_empty", "new_empty_strided", "unbind", "split", "chunk",
             "promote_types")


def _cases():
    """{name: (entry point, args, kwargs)} at a small shape: M = 64 rows, N = 37 tokens, L = 8, D = 48."""
    import torch

    from smf_kernels.backends import triton_impl

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(64, 48, generator=gen)
    indices = torch.randint(0, 64, (37, 8), generator=gen)
    weights = torch.randn(37, 8, generator=gen)
    grad_out = torch.randn(37, 48, generator=gen)
    rows = torch.arange(0, 64, 3)
    query, keys = torch.randn(37, 2, 32, generator=gen), torch.randn(2, 2, 12, 16, generator=gen)
    slots = torch.randint(0, 144, (37, 2, 4), generator=gen)
    grad_scores = torch.randn(37, 2, 4, generator=gen)
    return {
        "weighted_gather backward (dense)": (triton_impl.BACKEND.gather_backward,
                                             (grad_out, values, indices, weights, None, False, True, True)),
        "weighted_gather backward (T rows)": (triton_impl.BACKEND.gather_backward,
                                              (grad_out, values, indices, weights, rows, False, True, True)),
        "weighted_gather backward (T rows, no dW)": (triton_impl.BACKEND.gather_backward,
                                                     (grad_out, values, indices, weights, rows, False, True, False)),
        "weighted_gather backward into a sink (T rows)": (
            triton_impl.BACKEND.gather_backward_into, (grad_out, values, indices, weights, rows,
                                                       torch.zeros(rows.numel(), 48), True, True)),
        "product_key_topk backward": (triton_impl.BACKEND.topk_backward, (grad_scores, query, keys, slots, True, True)),
    }


def count(entry, args) -> dict:
    """{"triton": [kernel names], "aten": [op names that launch device work]} of one call of ``entry``."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from smf_kernels.triton_kernels import launch

    recorded = {"triton": [], "aten": []}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.rstrip("_") not in NO_LAUNCH:
                recorded["aten"].append(name)
            return func(*args, **(kwargs or {}))

    real_launch = launch.LaunchPlan.launch

    def recorded_launch(plan):
        recorded["triton"].append(plan.name)
        with _disable_current_modes():
            real_launch(plan)

    launch.LaunchPlan.launch = recorded_launch
    try:
        with Record():
            entry(*args)
    finally:
        launch.LaunchPlan.launch = real_launch
    return recorded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the counts to this path")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        parser.error("set TRITON_INTERPRET=1: the counts are taken on CPU, through the Triton interpreter")
    results = {name: count(entry, call_args) for name, (entry, call_args) in _cases().items()}
    print("| backward op | Triton kernels | ATen ops with device work | those ops |\n|---|---:|---:|---|")
    for name, got in results.items():
        ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in collections.Counter(got["aten"]).items())
        print(f"| {name} | {len(got['triton'])} | {len(got['aten'])} | {ops} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
