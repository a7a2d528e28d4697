"""Optional compiled extension: built only with SMF_KERNELS_BUILD_EXT=1.

A plain ``pip install -e .`` needs no compiler. To build ``smf_kernels._ext`` in
place against the installed torch (with the CUDA kernels when torch has CUDA):

    SMF_KERNELS_BUILD_EXT=1 pip install --no-build-isolation -e .

(``--no-build-isolation``: torch is deliberately not a build requirement.) Without
it, ``python -m smf_kernels.build_ext`` builds the CPU kernels into a cache.

A built wheel carries the extension's sources, ``csrc/``, as ``smf_kernels/csrc/`` (``SourcesInPackage``), so
that ``python -m smf_kernels.build_ext`` builds from an installed package too; the sdist carries ``csrc/``
(MANIFEST.in).
"""
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _build_ext_module():
    """smf_kernels/build_ext.py loaded on its own (the package __init__ needs an installed package)."""
    path = HERE / "smf_kernels" / "build_ext.py"
    spec = importlib.util.spec_from_file_location("smf_kernels_build_ext", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SourcesInPackage(build_py):
    """build_py, plus csrc/'s sources copied to smf_kernels/csrc/ in the build (not in an editable install, which
    finds csrc/ beside the package)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "smf_kernels" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted((HERE / "csrc").iterdir()):
            if source.suffix in (".h", ".cpp", ".cu"):
                shutil.copyfile(source, target / source.name)


if os.environ.get("SMF_KERNELS_BUILD_EXT", "0") not in ("", "0"):
    from torch.utils.cpp_extension import BuildExtension

    setup(ext_modules=_build_ext_module().setup_extensions(),
          cmdclass={"build_ext": BuildExtension, "build_py": SourcesInPackage})
else:
    setup(cmdclass={"build_py": SourcesInPackage})
