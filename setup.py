"""Optional compiled extension: built only with SMF_KERNELS_BUILD_EXT=1.

A plain ``pip install -e .`` needs no compiler. To build ``smf_kernels._ext`` in
place against the installed torch (with the CUDA kernels when torch has CUDA):

    SMF_KERNELS_BUILD_EXT=1 pip install --no-build-isolation -e .

(``--no-build-isolation``: torch is deliberately not a build requirement.) Without
it, ``python -m smf_kernels.build_ext`` builds the CPU kernels into a cache.
"""
import importlib.util
import os
from pathlib import Path

from setuptools import setup


def _build_ext_module():
    """smf_kernels/build_ext.py loaded on its own (the package __init__ needs an installed package)."""
    path = Path(__file__).resolve().parent / "smf_kernels" / "build_ext.py"
    spec = importlib.util.spec_from_file_location("smf_kernels_build_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if os.environ.get("SMF_KERNELS_BUILD_EXT", "0") not in ("", "0"):
    from torch.utils.cpp_extension import BuildExtension

    setup(ext_modules=_build_ext_module().setup_extensions(), cmdclass={"build_ext": BuildExtension})
else:
    setup()
