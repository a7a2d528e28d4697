"""The machine a GPU run ran on: Python and package versions, the device, the driver, the source's commit.

    python benchmarks/gpu_env.py [--jsonl env.jsonl]

One item, "versions" (benchmarks/guarded.py), whose row holds every field; a missing package is recorded as
None, and whether pydantic imports (a stock CUDA image has none: nothing the GPU run imports needs it).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys

PACKAGES = ("torch", "triton", "transformers", "peft", "numpy", "safetensors", "pytest", "pydantic")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(argv: list[str], containing: str = "") -> str | None:
    """The first line of ``argv``'s output that holds ``containing``, or None when it cannot run."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=os.path.dirname(__file__))
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if containing in line and line.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def versions() -> dict:
    """Every field of the run's machine (torch imported here: CUDA initialised when there is a device)."""
    import torch

    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), platform=platform.platform(),
                packages={name: _version(name) for name in PACKAGES}, pydantic_importable=_importable("pydantic"),
                torch_cuda=torch.version.cuda,
                triton_interpret=os.environ.get("TRITON_INTERPRET"),
                commit=_command(["git", "rev-parse", "--short", "HEAD"]),
                nvcc=_command(["nvcc", "--version"], containing="release"),
                driver=_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                device=None)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = dict(name=props.name, capability=f"{props.major}.{props.minor}",
                              multiprocessors=props.multi_processor_count,
                              memory_gib=round(props.total_memory / 2 ** 30, 1))
    return info


def main(argv=None) -> int:
    from guarded import run_items

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jsonl", help="append the row to this file (benchmarks/guarded.py)")
    args = p.parse_args(argv)
    (row,) = run_items(["versions"], lambda item: versions(), args.jsonl)
    print(row)
    return 0 if row["event"] == "done" else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
