"""``smf suite --jobs N``: the suite's work as tasks with dependencies, run in N worker processes.

A task is a shared stage (a retrofit, or the background statistics of a retrofit) or a whole run (its own training
stage, evaluation and results file); a sparse run needs its background, which needs its retrofit. Tasks start in
the order given (the plan's, seed by seed, each shared stage before the first run that needs it) as soon as a worker
is free and what they need has finished. The workers are started with ``spawn`` (a fresh interpreter each: no
forked torch state) and keep their state between tasks (loaded evaluation sets). A task that raises stops the
scheduling of new ones; those already running finish, and the first failure is returned.

What a task computes depends neither on the process it runs in nor on the order (each training stage seeds itself;
evaluation draws no random numbers), so the results files equal those of one process but for their timing and CPU
fields (tests/test_suite_jobs.py).
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass


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
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
                               initargs=initargs)
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
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return failure

