"""Items of a benchmark run so that one failing item costs that item only, each result saved as it finishes.

A *stage file* holds one JSON object per line, appended and flushed the moment it is known:

    {"item": "lookup/bf16", "event": "start"}
    {"item": "lookup/bf16", "event": "done", "result": {...}}
    {"item": "dense bwd/bf16", "event": "failed", "reason": "RuntimeError: ..."}

The worker side (:func:`run_items`, inside a benchmark script) runs its items in order and writes those lines; after
an item that raised it checks the device, and exits with :data:`POISONED` when the CUDA context is unusable (a
device-side assert, e.g. ``torch._assert_async``, poisons every later CUDA call in the process). The parent side
(:func:`run_guarded`, in ``gpu_run.py``) starts a worker for the items left, kills it when an item outlasts its time
limit, records ``failed`` for the item a dead or killed worker was running, and starts a fresh worker for the rest,
until every item has a row or the stage's deadline passes (the items left then get ``failed: not started``); when
two workers in a row die before starting any item, every item left fails with their reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import traceback
from pathlib import Path
from typing import Callable

POISONED = 3  # worker exit status: the device cannot run another item in this process
POLL_S = 0.2


def append_line(path: Path | str, row: dict) -> None:
    """Append ``row`` as one JSON line to ``path`` and flush it to disk (a killed run keeps every finished row)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: Path | str) -> list[dict]:
    """The complete JSON lines of a stage file (a line cut off by a killed writer is skipped)."""
    if not Path(path).is_file():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def final_rows(path: Path | str) -> dict[str, dict]:
    """{item: its last "done" or "failed" row} of a stage file, in the order the items finished."""
    return {row["item"]: row for row in read_rows(path) if row.get("event") in ("done", "failed")}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _synchronize(device) -> None:
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _device_usable(device) -> bool:
    """False when ``device`` is a CUDA device whose context an earlier error left unusable."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
        torch.cuda.empty_cache()  # what the failed item held (an out-of-memory, say) goes back for the next
        return True
    except Exception:  # noqa: BLE001 - torch.AcceleratorError, RuntimeError: the context is gone either way
        return False


def run_items(items: list[str], run_one: Callable[[str], dict], path: Path | str | None, device=None) -> list[dict]:
    """Worker side: ``run_one(item)`` for each of ``items`` in order, each framed by lines in ``path`` (None: no
    file). An item that raises gets a ``failed`` row with the exception's first line and the run goes on, unless the
    CUDA ``device`` is then unusable: the process exits with :data:`POISONED` so that a fresh one runs the rest.
    Returns the rows written."""
    rows = []
    for item in items:
        if path is not None:
            append_line(path, {"item": item, "event": "start"})
        try:
            result = run_one(item)
            _synchronize(device)  # an asynchronous CUDA error (a device-side assert) is this item's, not the next's
            row = {"item": item, "event": "done", "result": result}
        except Exception as exc:  # noqa: BLE001 - one item's failure of any kind is that item's row
            traceback.print_exc()
            row = {"item": item, "event": "failed", "reason": _one_line(exc)}
        rows.append(row)
        if path is not None:
            append_line(path, row)
        if row["event"] == "failed" and not _device_usable(device):
            raise SystemExit(POISONED)
    return rows


def _last_line(log: Path, start: int) -> str:
    """The last non-empty line a worker wrote to ``log`` since byte ``start``."""
    with open(log, "rb") as f:
        f.seek(start)
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _stop(proc: subprocess.Popen) -> None:
    """Kill the worker and its children (it runs in its own process group)."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def run_guarded(command_for: Callable[[list[str]], list[str]], items: list[str], path: Path, log: Path,
                item_timeout_s: float, deadline: float, env: dict | None = None, cwd: Path | None = None) -> dict:
    """Parent side: run ``items`` through workers ``command_for(items_left)`` (argv) writing stage file ``path``,
    their stdout and stderr appended to ``log``. Every item ends with a row in ``path``: the worker's ``done`` or
    ``failed``, or one written here: ``failed`` with "timed out after N s", "worker died (...)" or "not started: the
    stage's time ran out". ``deadline``: a time.monotonic() value. Returns :func:`final_rows` of ``path``."""
    left = [item for item in items if item not in final_rows(path)]
    dead_on_start = 0  # workers in a row that ended before starting an item
    while left:
        if time.monotonic() >= deadline:
            for item in left:
                append_line(path, {"item": item, "event": "failed", "reason": "not started: the stage's time ran out"})
            break
        with open(log, "ab") as out:
            log_start = out.tell()
            proc = subprocess.Popen(command_for(left), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        running, since, why = None, time.monotonic(), None
        while proc.poll() is None:
            time.sleep(POLL_S)
            current = _running(path, left)
            if current != running:
                running, since = current, time.monotonic()
            now = time.monotonic()
            if now - since > item_timeout_s:
                why = f"timed out after {item_timeout_s:.0f} s"
            elif now >= deadline:
                why = f"timed out after {now - since:.0f} s: the stage's time ran out"
            if why:
                _stop(proc)
                break
        if why is None:
            status = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
            why = f"worker died ({status}): {_last_line(log, log_start)}"
        finished = final_rows(path)
        # the item the worker was in when it ended; a worker that ended before starting one costs the first item left,
        # and a second such worker in a row all of them (the stage cannot start: no device, a broken import)
        culprit = _running(path, left)
        started = culprit is not None or any(item in finished for item in left)
        dead_on_start = 0 if started else dead_on_start + 1
        if culprit is not None:
            blamed = [culprit]
        else:
            blamed = [] if started else left[:1] if dead_on_start < 2 else left
        for item in blamed:
            append_line(path, {"item": item, "event": "failed", "reason": why})
        left = [item for item in left if item not in final_rows(path)]
    return final_rows(path)


def _running(path: Path, items: list[str]) -> str | None:
    """The item of ``items`` that has a start row in stage file ``path`` and no final row yet, if any."""
    rows = read_rows(path)
    finished = {row["item"] for row in rows if row.get("event") in ("done", "failed")}
    started = [row["item"] for row in rows if row.get("event") == "start" and row["item"] in items]
    return next((item for item in reversed(started) if item not in finished), None)
