"""SparseMemoryTrainer under accelerate's FSDP2 (docs/accelerate/fsdp2.yaml, docs/accelerate/smf_fsdp2.py) on 2 CPU
processes: the base model's decoder layers are FSDP2 DTensors, the memories and alpha stay plain, the adapter
equals that of one process on the same global batches, and the Trainer's own checkpoints resume bit-identically
and load into one process with from_pretrained."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from smf.model import from_pretrained, load_memory_adapter
from smf.model.adapter import ADAPTER_WEIGHTS
from smf.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "accelerate" / "smf_fsdp2.py"
CONFIG = ROOT / "docs" / "accelerate" / "fsdp2.yaml"
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
          str(ROOT / "tests" / "accelerate_fsdp2_cpu.py"), str(SCRIPT)]  # the docs' command, through the CPU shim


def _run(command, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The 3 steps of the script under FSDP2, a Trainer checkpoint at steps 2 and 3: (its directory, stdout)."""
    directory = tmp_path_factory.mktemp("fsdp2")
    return directory, _run([*LAUNCH, "--output-dir", str(directory), "--save-steps", "2"], directory)


def _adapter(directory):
    return load_file(str(directory / "final" / ADAPTER_WEIGHTS))


@pytest.mark.usefixtures("one_thread")
def test_sparse_memory_trainer_under_accelerate_fsdp2_matches_one_process(launched, tmp_path):
    directory, stdout = launched
    assert "2 processes, 98 of 125 parameters sharded by FSDP2" in stdout  # every decoder layer; no memory
    single = _run([sys.executable, str(SCRIPT), "--output-dir", str(tmp_path / "one"), "--per-device-batch", "4"],
                  tmp_path)
    assert "1 processes, 0 of 125" in single
    got, expected = _adapter(directory), _adapter(tmp_path / "one")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        err = float((got[name].double() - tensor.double()).norm() / tensor.double().norm().clamp_min(1e-30))
        # a gradient summed in another order, carried by Adam's normalised steps (the same with DDP: 1.8e-5 for
        # the last alpha)
        assert err < 1e-4, (name, err)


@pytest.mark.usefixtures("one_thread")
def test_trainer_checkpoint_under_fsdp2_resumes_bit_identically_and_loads_into_one_process(launched, tmp_path):
    directory, _ = launched
    _run([*LAUNCH, "--output-dir", str(tmp_path), "--save-steps", "2",
          "--resume-from-checkpoint", str(directory / "checkpoint-2")], tmp_path)
    unbroken, resumed = _adapter(directory), _adapter(tmp_path)
    assert unbroken.keys() == resumed.keys()
    assert all(torch.equal(resumed[name], tensor) for name, tensor in unbroken.items())
    # the last checkpoint holds the whole model: the frozen base (FSDP2 shards, the tied embedding's 259 rows
    # split unevenly) and the trained memories, as the adapter written from the plain memories has them
    loaded = from_pretrained(directory / "checkpoint-3").state_dict()
    expected = tiny_model()
    load_memory_adapter(expected, directory / "final")
    expected = expected.state_dict()
    assert loaded.keys() == expected.keys()
    assert [name for name, tensor in expected.items() if not torch.equal(loaded[name], tensor)] == []
