"""A stream of tasks in a synthetic world (docs/science.md#a-stream-of-tasks): the world's new people split into
tasks A, B, C, ... that a suite with ``stream:`` teaches one after another.

The new people are split in the world's own order of them (a shuffle of the names, :mod:`smf.data.world`) into
``tasks`` consecutive groups as equal as possible (the first ``n_new % tasks`` groups one person larger). Task k's
sets are the rows of the world's ``train`` and ``eval_learn`` sets that ask about its people, in the world's order:
every row of those sets lands in exactly one task, and the tasks' rows together are the world's. The old people's
sets (retrofit, background, held-out, retain) are the world's and shared by every stage.

Everything is a function of the world and ``tasks``: the same options give the same files.
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Field

from smf.data.world import ATTRIBUTES, NEW_KINDS, World
from smf.files import write_text_atomic
from smf.options import OPTIONS_CONFIG, checked, mapping, section_names

__all__ = ["STREAM_ROLES", "StreamOptions", "split_people", "stream_task_rows", "task_name", "write_stream_tasks"]

STREAM_ROLES = ("train", "eval_learn")  # the world's sets that each task has its own part of
MAX_TASKS = len(string.ascii_uppercase)  # tasks are named A, B, C, ...


@dataclass(frozen=True)
class StreamOptions:
    """``stream:`` of a suite config: how many tasks the new people are split into."""

    __pydantic_config__ = OPTIONS_CONFIG

    tasks: Annotated[int, Field(ge=2, le=MAX_TASKS)]  # tasks A, B, C, ... trained one after another

    @classmethod
    def from_dict(cls, raw: dict | None) -> "StreamOptions":
        """Checked options (ConfigError naming a bad, missing or unknown key)."""
        return checked(cls, mapping(raw, "stream", cls.__dataclass_fields__), section_names("stream"))

    def smallest_task(self, n_new: int) -> int:
        """People in the smallest task of a world with ``n_new`` new people."""
        return n_new // self.tasks

    def train_rows(self, n_new: int, new_kind: bool = False) -> int:
        """Training rows of the smallest task (every fact once per question template; ``new_kind``: the world's new
        facts are of :data:`~smf.data.world.NEW_KINDS`, with their own count of templates)."""
        kinds = NEW_KINDS if new_kind else ATTRIBUTES
        return self.smallest_task(n_new) * sum(len(templates) for _, _, templates in kinds.values())


def task_name(index: int) -> str:
    """The name of the task at 0-based ``index``: A, B, C, ..."""
    return string.ascii_uppercase[index]


def split_people(people: list, tasks: int) -> list[list]:
    """``people`` in ``tasks`` consecutive groups, as equal as possible (the first ones one larger)."""
    if not 1 <= tasks <= len(people):
        raise ValueError(f"stream: option 'tasks' {tasks} needs 1 to {len(people)} (the world's new people)")
    size, extra = divmod(len(people), tasks)
    bounds = [0]
    for index in range(tasks):
        bounds.append(bounds[-1] + size + (index < extra))
    return [people[start:end] for start, end in zip(bounds, bounds[1:])]


def _asks_about(question: str, names: set[str]) -> str | None:
    """The name of ``names`` that ``question`` asks about (names are two words, so a match between spaces is the
    person's), or None."""
    words = question.split()
    found = {f"{a} {b}" for a, b in zip(words, words[1:])} & names
    return next(iter(found)) if len(found) == 1 else None


def stream_task_rows(world: World, tasks: int) -> list[dict[str, list[dict]]]:
    """Per task (in order A, B, ...): role of :data:`STREAM_ROLES` -> the world's rows of that role that ask about
    the task's people (module docstring). ValueError if a row asks about no new person or several (the world
    generator's rows always ask about one)."""
    groups = split_people(world.new, tasks)
    task_of = {person.name: index for index, group in enumerate(groups) for person in group}
    per_task: list[dict[str, list[dict]]] = [{role: [] for role in STREAM_ROLES} for _ in groups]
    for role in STREAM_ROLES:
        for row in world.datasets[role]:
            name = _asks_about(row["question"], set(task_of))
            if name is None:
                raise ValueError(f"world {role} row {row['question']!r} asks about no single new person")
            per_task[task_of[name]][role].append(dict(row))
    return per_task


def _write_if_changed(path: Path, text: str) -> None:
    """``text`` into ``path`` unless it holds it already; atomically (several processes may prepare one world)."""
    if path.is_file() and path.read_text() == text:
        return
    write_text_atomic(path, text)


def write_stream_tasks(world: World, tasks: int, directory: str | Path) -> list[dict[str, str]]:
    """Each task's sets as ``{directory}/task{A,B,...}/{role}.jsonl`` (own-data schema), rewritten only when their
    rows changed; returns per task role -> path."""
    paths = []
    for index, rows in enumerate(stream_task_rows(world, tasks)):
        task_dir = Path(directory) / f"task{task_name(index)}"
        written = {}
        for role, role_rows in rows.items():
            path = task_dir / f"{role}.jsonl"
            _write_if_changed(path, "".join(json.dumps(row) + "\n" for row in role_rows))
            written[role] = str(path)
        paths.append(written)
    return paths
