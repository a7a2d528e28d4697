"""SIGKILL a tiny `smf train` several times, at random moments and in the middle of checkpoint writes,
resume after each, and end with weights bit-identical to an unbroken run."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from smf.train import train
from smf.train.checkpoint import CHECKPOINT_FILE
from test_train_recipes import tiny_run_config, write_adapter_and_background

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = {"n_examples": 24, "global_batch_size": 2, "micro_batch_size": 2, "epochs": 1, "lr": 1e-2,
           "warmup_steps": 1, "save_every": 1}
# Child: one `smf train` run (resumed when its directory holds a checkpoint). STALL_AT_SAVE=k makes
# the k-th checkpoint write stop half-way (the temporary file holds half the bytes), say so and hang,
# so that the parent's SIGKILL lands inside the write.
CHILD = """
import io, json, os, sys, time
import torch
import smf.train.checkpoint as checkpoint
from smf.train import build_config, train

options = json.loads(sys.argv[1])
stall_at, saves = int(os.environ.get("STALL_AT_SAVE", "0")), [0]
real_save = torch.save

def save(obj, handle, *args, **kwargs):
    saves[0] += 1
    if saves[0] != stall_at:
        return real_save(obj, handle, *args, **kwargs)
    buffer = io.BytesIO()
    real_save(obj, buffer)
    handle.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    handle.flush()
    print("IN_SAVE", flush=True)
    time.sleep(120)

checkpoint.torch.save = save
torch.set_num_threads(1)
train(build_config("train", {}, options).resolved("sparse"))
print("DONE", flush=True)
"""


def _child(options: dict, stall_at: int = 0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "STALL_AT_SAVE": str(stall_at)}
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(options)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _log_rows(run_dir) -> int:
    path = run_dir / "train_log.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_log_rows(path, rows: int, child: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while child.poll() is None and time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.02)


def _options(run_dir, adapter) -> dict:
    return {"preset": "tiny", "recipe": "sparse", "output_dir": str(run_dir), "adapter": str(adapter),
            "background": str(adapter), **OPTIONS}


def test_several_sigkills_each_resumed_end_bit_identical_to_an_unbroken_run(tmp_path):
    adapter = write_adapter_and_background(tmp_path / "adapter", "additive+s")
    straight = tiny_run_config(tmp_path / "straight", "train", "sparse", adapter=str(adapter),
                               background=str(adapter), **OPTIONS)
    started = time.perf_counter()
    result = train(straight)
    run_seconds = time.perf_counter() - started
    total_steps = result["total_steps"]
    assert total_steps == 12

    run_dir = tmp_path / "killed" / "sparse-run"
    options = _options(run_dir, adapter)
    rng = random.Random(11)
    kills = []
    # Two kills inside a checkpoint write (the 2nd save of that process), two at random moments of training.
    for plan in ("in_save:2", "random", "in_save:2", "random"):
        resumed = (run_dir / CHECKPOINT_FILE).is_file()
        child = _child({**options, "resume": resumed}, int(plan.split(":")[1]) if plan != "random" else 0)
        try:
            if plan == "random":  # once it has logged a new step, within the next ~3 steps
                _wait_for_log_rows(run_dir / "train_log.jsonl", _log_rows(run_dir) + 1, child)
                time.sleep(rng.uniform(0.0, 3 * run_seconds / total_steps))
            else:
                line = child.stdout.readline().strip()
                assert line == "IN_SAVE", child.stderr.read()[-3000:]
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        step = torch.load(run_dir / CHECKPOINT_FILE, weights_only=True)["step"] if (run_dir / CHECKPOINT_FILE).is_file() \
            else 0
        kills.append((plan, child.returncode, step))
    assert all(code == -signal.SIGKILL for _, code, _ in kills), kills
    steps = [step for _, _, step in kills]
    assert steps == sorted(steps) and 0 < steps[-1] < total_steps, kills  # each resume made progress

    final = _child({**options, "resume": (run_dir / CHECKPOINT_FILE).is_file()})
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0 and "DONE" in out, err[-3000:]

    done = [torch.load(d / CHECKPOINT_FILE, weights_only=True) for d in (tmp_path / "straight" / "sparse-run", run_dir)]
    assert done[0]["step"] == done[1]["step"] == total_steps
    assert done[0]["trainable"].keys() == done[1]["trainable"].keys()
    for name, tensor in done[0]["trainable"].items():
        assert torch.equal(tensor, done[1]["trainable"][name]), name
    losses = [[json.loads(line)["loss"] for line in (d / "train_log.jsonl").read_text().splitlines()]
              for d in (tmp_path / "straight" / "sparse-run", run_dir)]
    assert losses[0] == losses[1] and len(losses[0]) == total_steps
