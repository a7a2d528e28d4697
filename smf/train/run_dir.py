"""One writer per output directory, and a failed run that leaves the directory as it found it.

:func:`claim_output_dir` wraps a training or background run:

- Lock: rank 0 holds an exclusive ``flock`` on ``{output_dir}/.smf-run.lock`` (which records the
  holder's pid, host and start time) for the whole run. A second run into the directory is
  refused at once with ConfigError naming the holder. The kernel drops the lock when its holder
  dies, however it dies (SIGKILL included), so a lock file left by a dead run is stale by
  construction: the next run takes it over, with no pid guessing. (``flock`` is advisory and
  per machine: two hosts writing one directory over NFS are not detected.)
- Cleanup: the run names each file and folder it writes through :class:`RunFiles` before creating
  it, which records the ones that did not exist yet. If the run fails (any exception,
  KeyboardInterrupt included) before it wrote a checkpoint, exactly those are removed, a
  ``run_config.json`` it replaced is restored, and a directory it created is deleted if nothing
  else is left in it: files and folders that others add to the directory while the run runs are
  never touched. If a checkpoint exists, the directory is kept for ``--resume`` and the error log
  lists what the run created there. A killed process cannot clean up; its checkpoint (written
  atomically) is resumable.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from smf.errors import ConfigError
from smf.model.loading import RUN_CONFIG
from smf.train.checkpoint import CHECKPOINT_FILE
from smf.train.distributed import World, gather_objects

logger = logging.getLogger(__name__)

LOCK_FILE = ".smf-run.lock"


def _describe_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet written its details"


def acquire_lock(output_dir: Path) -> int:
    """Exclusive lock on ``output_dir`` (which must exist); returns the lock file's descriptor.

    Raises ConfigError if another process holds it.
    """
    path = output_dir / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"another smf run ({_describe_holder(path)}) is writing to {str(output_dir)!r}; "
                              "wait for it to finish or use another --output-dir") from None
        # The holder we waited on may have unlinked the file after we opened it: lock the file at `path`.
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(holder) + "\n").encode())
    return fd


def release_lock(output_dir: Path, fd: int) -> None:
    """Remove the lock file and drop the lock (in that order, see :func:`acquire_lock`)."""
    with contextlib.suppress(FileNotFoundError):
        (output_dir / LOCK_FILE).unlink()
    os.close(fd)


class RunFiles:
    """The files and folders a run creates in its output directory, recorded as it creates them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.created: list[str] = []  # names in the directory, in creation order

    def path(self, name: str) -> Path:
        """``directory / name``, recorded as this run's when nothing is there yet: ask for it just before
        creating it (a file there already, e.g. a replaced run_config.json, stays someone else's)."""
        path = self.directory / name
        if name not in self.created and not (path.exists() or path.is_symlink()):
            self.created.append(name)
        return path


def _undo(output_dir: Path, created_dir: bool, files: RunFiles, old_run_config: bytes | None) -> None:
    """Put ``output_dir`` back as it was before the run, or say what is left (see module docstring).
    Runs while the lock is held."""
    created = [name for name in files.created if (output_dir / name).exists() or (output_dir / name).is_symlink()]
    if (output_dir / CHECKPOINT_FILE).is_file():
        if created:
            logger.error("the run failed; %s keeps its checkpoint for --resume (created by this run: %s)",
                         output_dir, ", ".join(created))
        return
    for name in created:
        path = output_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if old_run_config is not None:
        (output_dir / RUN_CONFIG).write_bytes(old_run_config)
    removed_dir = False
    if created_dir and not any(name != LOCK_FILE for name in os.listdir(output_dir)):  # others' files keep it
        with contextlib.suppress(OSError):
            (output_dir / LOCK_FILE).unlink()  # still locked through our descriptor until release_lock
            output_dir.rmdir()
            removed_dir = True
    if created or removed_dir:
        logger.error("the run failed; removed what it had written to %s (%s)%s", output_dir,
                     ", ".join(created) or "nothing", " and the directory it created" if removed_dir else "")


@contextlib.contextmanager
def claim_output_dir(output_dir: Path, world: World) -> Iterator[RunFiles]:
    """Hold ``output_dir`` for one run: create it, lock it, and clean it up if the run fails. Yields the
    :class:`RunFiles` through which the run names what it writes there.

    Collective under torch.distributed: rank 0 locks and cleans; every rank raises ConfigError if
    rank 0 could not lock.
    """
    created_dir = not output_dir.exists()
    fd, refusal = None, None
    files, old_run_config = RunFiles(output_dir), None
    if world.is_main:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            fd = acquire_lock(output_dir)
        except (ConfigError, OSError) as err:
            if created_dir:
                with contextlib.suppress(OSError):
                    output_dir.rmdir()
            refusal = str(err)
        else:
            run_config = output_dir / RUN_CONFIG
            old_run_config = run_config.read_bytes() if run_config.is_file() else None
    refusal = gather_objects(refusal, world)[0]
    if refusal is not None:
        raise ConfigError(refusal)
    try:
        yield files
    except BaseException:
        if world.is_main:
            try:
                _undo(output_dir, created_dir, files, old_run_config)
            except OSError:  # never hide the run's own error behind a cleanup error
                logger.exception("the run failed and cleaning up %s failed too", output_dir)
        raise
    finally:
        if fd is not None:
            release_lock(output_dir, fd)
