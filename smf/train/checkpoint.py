"""Training checkpoints for exact resume, written atomically.

``{output_dir}/checkpoint.pt`` holds, after optimizer step ``step``: the trainable parameters
(by name in the unwrapped model), the optimizer and scheduler states, the RNG states of python,
numpy and torch (CPU and CUDA) of every rank, and the step (which fixes the data position, see
:mod:`smf.train.data`). Frozen parameters are rebuilt from the base model / adapter on resume.
The file is written to a temporary name, synced and renamed over the old one, so a crash while
saving leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from smf.train.config import ConfigError

CHECKPOINT_FILE = "checkpoint.pt"
LOG_FILE = "train_log.jsonl"


def rng_state() -> dict:
    """RNG states of python, numpy, torch CPU and (when available) every CUDA device of this process."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj, path: Path) -> None:
    """torch.save to ``path`` via a synced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def save_checkpoint(path: Path, *, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                    rng_states: list[dict], run_options: dict) -> None:
    """Write the checkpoint (see module docstring); ``rng_states`` holds one entry per rank."""
    trainable = {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}
    atomic_save({"step": step, "trainable": trainable, "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "rng": rng_states, "options": run_options}, path)


def load_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, rank: int,
                    world_size: int) -> int:
    """Restore everything saved by :func:`save_checkpoint` (this rank's RNG); returns the step."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if len(state["rng"]) != world_size:
        raise ConfigError(f"{path} was written by {len(state['rng'])} processes; resume with the same number, "
                          f"not {world_size}")
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(state["trainable"]):
        raise ConfigError(f"{path} holds other trainable parameters than this run's model; was it written by "
                          "another recipe or configuration?")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state["trainable"][name])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"][rank])
    return int(state["step"])


def truncate_log(path: Path, step: int) -> None:
    """Drop log rows of steps after ``step`` (written after the checkpoint, before a crash)."""
    if not path.is_file():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
