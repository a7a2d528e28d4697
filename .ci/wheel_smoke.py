"""The installed wheel works outside the source tree (.ci/wheel_check.sh runs this in a fresh venv, from a folder
outside the checkout, after ``python -m smf_kernels.build_ext`` built the extension from the installed sources).

Checks: smf_kernels and smf are imported from the venv; ``__version__`` is the package metadata's; the license is
declared and shipped; the extension's sources, the configs and the tiny preset's data are in the package; a
``ProductKeyMemory`` on the ``ext`` backend matches the ``torch`` one, forward and backward, on random inputs.
"""
import importlib.metadata
import sys
from importlib.resources import files
from pathlib import Path

import torch

import smf
import smf_kernels
from smf_kernels import ProductKeyMemory, build_ext

venv = Path(sys.prefix).resolve()
for module in (smf_kernels, smf):
    where = Path(module.__file__).resolve()
    assert venv in where.parents, f"{module.__name__} imported from {where}, not from the venv {venv}"
distribution = importlib.metadata.distribution("smf-kernels")
assert venv in Path(distribution.locate_file("")).resolve().parents, distribution.locate_file("")
assert smf_kernels.__version__ == distribution.version, (smf_kernels.__version__, distribution.version)
assert distribution.metadata["License"] == "Apache-2.0", distribution.metadata["License"]
assert any(Path(str(f)).name == "LICENSE" for f in distribution.files), "LICENSE is not in the wheel"

package = Path(smf_kernels.__file__).resolve().parent
assert build_ext.SOURCE_DIR == package / "csrc", build_ext.SOURCE_DIR
assert {*build_ext.CPU_SOURCES, *build_ext.CUDA_SOURCES} <= {p.name for p in build_ext.SOURCE_DIR.iterdir()}
assert (files("smf") / "configs" / "preset_tiny.yaml").is_file()
assert (files("smf") / "assets" / "tiny" / "medmcqa_train.jsonl").is_file()

torch.manual_seed(0)
memories = {backend: ProductKeyMemory(d_model=72, n_keys=37, heads=3, topk=5, key_dim=22, backend=backend)
            for backend in ("torch", "ext")}
memories["ext"].load_state_dict(memories["torch"].state_dict())
x = torch.randn(3, 11, 72)
outputs, grads = {}, {}
for backend, memory in memories.items():
    inputs = x.clone().requires_grad_()
    outputs[backend] = memory(inputs)
    outputs[backend].square().sum().backward()
    grads[backend] = (inputs.grad, memory.values.grad)
error = ((outputs["ext"] - outputs["torch"]).norm() / outputs["torch"].norm()).item()
assert error < 1e-5, f"ext vs torch forward: relative error {error:.2e}"
for ext_grad, torch_grad in zip(grads["ext"], grads["torch"]):
    error = ((ext_grad - torch_grad).norm() / torch_grad.norm()).item()
    assert error < 1e-5, f"ext vs torch backward: relative error {error:.2e}"
print(f"wheel smoke test passed: smf-kernels {smf_kernels.__version__} from {package}, ext == torch")
