"""What a result was computed with: package versions, CPU, threads (recorded beside every suite's results and base,
so a number that another machine does not reproduce can be traced to what differed)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "peft", "triton", "smf-kernels")


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; else platform.processor())."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """python, package versions (None: not installed), CPU model and count, torch threads, OMP_NUM_THREADS, the
    CUDA device when there is one."""
    import torch  # smf's base modules import no torch at module level (the command line's parser loads them)

    return {"python": platform.python_version(), **{package: _version(package) for package in PACKAGES},
            "platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
