"""``smf suite --jobs N``: the suite's work as tasks with dependencies, run in N worker processes.

A task is a shared stage (a retrofit, or the background statistics of a retrofit) or a whole run (its own training
stage, evaluation and results file); a sparse run needs its background, which needs its retrofit. Tasks start in
the order given (the plan's, seed by seed, each shared stage before the first run that needs it) as soon as a worker
is free and what they need has finished. The workers are started with ``spawn`` (a fresh interpreter each: no
forked torch state) and keep their state between tasks (loaded evaluation sets). A task that raises stops the
scheduling of new ones; those already running finish, and the first failure is returned.

Stopping the suite stops its workers: SIGTERM, SIGHUP or SIGINT (Ctrl-C) to the main process ends it with exit code
128 + the signal's number after terminating every worker (a running task leaves no results file: each is written
whole, at its end), and a worker whose parent dies (SIGKILL, a crash) notices within :data:`PARENT_POLL_S` seconds and
exits, so that no orphan goes on writing into the suite folder.

What a task computes depends neither on the process it runs in nor on the order (each training stage seeds itself;
evaluation draws no random numbers), so the results files equal those of one process but for their timing and CPU
fields (tests/test_suite_jobs.py).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass


PARENT_POLL_S = 0.5  # how often a worker checks that the process that started it is alive
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name))
ORPHANED_EXIT = 3  # a worker's exit code once its parent is gone


@dataclass(frozen=True)
class Task:
    """One unit of work: ``key`` names it (unique), ``payload`` is what the worker function gets, ``needs`` the keys
    of tasks that must finish first, ``run`` the name of the run it finishes (None: a shared stage)."""

    key: tuple
    payload: object
    needs: tuple = ()
    run: str | None = None


def run_tasks(tasks: list[Task], jobs: int, worker: Callable, initializer: Callable, initargs: tuple,
              on_finished: Callable[[Task, object], None], on_started: Callable[[Task], None] = lambda task: None,
              environment: dict[str, str] | None = None) -> tuple[Task, BaseException] | None:
    """Run ``tasks`` in ``jobs`` spawned processes (each started with ``environment`` added to this process's
    variables, then ``initializer(*initargs)``; each task as ``worker(task.payload)``), calling ``on_started(task)``
    and ``on_finished(task, result)`` in this process; returns None, or (task, exception) of the first task that
    raised (no further task is started then)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    keys = {task.key for task in tasks}
    if len(keys) != len(tasks):
        raise ValueError(f"tasks: a key given twice (each names one task): {[task.key for task in tasks]}")
    unknown = [need for task in tasks for need in task.needs if need not in keys]
    if unknown:
        raise ValueError(f"tasks need {unknown[0]}, which is not among the tasks")
    reachable, left = set(), list(tasks)  # a cycle of needs would leave its tasks unrun, reported as no failure
    while left:
        ready = {task.key for task in left if set(task.needs) <= reachable}
        if not ready:
            raise ValueError(f"tasks {[task.key for task in left]} wait on each other (a cycle of needs)")
        reachable |= ready
        left = [task for task in left if task.key not in ready]
    saved = {name: os.environ.get(name) for name in environment or {}}
    os.environ.update(environment or {})  # the workers start with it (spawned on the first submit)
    waiting, running, done = list(tasks), {}, set()
    failure: tuple[Task, BaseException] | None = None
    handlers = _stop_on_signals()
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                               initargs=(os.getpid(), initializer, initargs))
    finished_normally = False
    try:
        while waiting or running:
            if failure is None:
                for task in [task for task in waiting if all(need in done for need in task.needs)]:
                    if len(running) >= jobs:
                        break
                    waiting.remove(task)
                    on_started(task)
                    running[pool.submit(worker, task.payload)] = task
            if not running:
                break  # what is left waits on a task that failed
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                task = running.pop(future)
                error = future.exception()
                if error is not None:
                    failure = failure or (task, error)
                    continue
                done.add(task.key)
                on_finished(task, future.result())
        finished_normally = True
    finally:
        if not finished_normally:  # stopped (a signal, an error here): what runs must not finish after this process
            _terminate_workers(pool)
        pool.shutdown(wait=True, cancel_futures=True)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return failure



def _stop(signum, frame) -> None:
    """A stop signal's handler in the main process: SystemExit(128 + signum), which terminates the workers on its
    way out (:func:`run_tasks`' ``finally``) and ends the command without a traceback."""
    raise SystemExit(128 + signum)


def _stop_on_signals() -> dict:
    """Install :func:`_stop` for :data:`STOP_SIGNALS` (only the main thread can); returns the handlers replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}


def _terminate_workers(pool: ProcessPoolExecutor) -> None:
    """SIGTERM to every worker process of ``pool``, then wait for each to end."""
    processes = list((pool._processes or {}).values())  # the executor has no public handle on them
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join()


def _start_worker(parent: int, initializer: Callable, initargs: tuple) -> None:
    """A worker's initializer: watch ``parent`` (:func:`_exit_when_orphaned`), then ``initializer(*initargs)``."""
    threading.Thread(target=_exit_when_orphaned, args=(parent,), name="smf-watch-parent", daemon=True).start()
    initializer(*initargs)


def _exit_when_orphaned(parent: int) -> None:
    """End this worker as soon as the process that started it (pid ``parent``) is gone: its parent pid changes."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(ORPHANED_EXIT)
