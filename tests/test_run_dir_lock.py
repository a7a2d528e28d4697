"""One run per output directory (a lock), and a failed run leaves the directory as it found it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import smf.train.loop as loop
from smf.train import build_config, train
from smf.train.checkpoint import CHECKPOINT_FILE
from smf.train.config import ConfigError
from smf.train.run_dir import LOCK_FILE, acquire_lock, release_lock

pytestmark = pytest.mark.usefixtures("one_thread")


def retrofit_config(output_dir, **overrides):
    options = {"preset": "tiny", "output_dir": str(output_dir), "max_steps": 1, **overrides}
    return build_config("retrofit", {}, options).resolved("retrofit")


class Boom(Exception):
    pass


def test_a_second_run_into_a_directory_being_written_is_refused(tmp_path):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / "notes.txt").write_text("mine")
    fd = acquire_lock(output_dir)  # a first run holds the directory
    try:
        with pytest.raises(ConfigError, match=r"another smf run \(pid \d+ on .*\) is writing to"):
            train(retrofit_config(output_dir))
    finally:
        release_lock(output_dir, fd)
    assert sorted(p.name for p in output_dir.iterdir()) == ["notes.txt"]  # the refused run wrote nothing
    result = train(retrofit_config(output_dir))  # free again
    assert result["step"] == 1
    assert not (output_dir / LOCK_FILE).exists()


def test_a_lock_held_by_another_process_refuses_and_a_dead_holders_lock_does_not(tmp_path):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib, time; from smf.train.run_dir import acquire_lock; "
         "acquire_lock(pathlib.Path(sys.argv[1])); print('locked', flush=True); time.sleep(60)", str(output_dir)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
            train(retrofit_config(output_dir))
    finally:
        holder.kill()  # SIGKILL: no cleanup, the lock file stays behind
        holder.wait()
    assert json.loads((output_dir / LOCK_FILE).read_text())["pid"] == holder.pid
    assert train(retrofit_config(output_dir))["step"] == 1  # a dead holder's lock is stale


def test_a_run_that_fails_before_its_first_checkpoint_removes_what_it_wrote(tmp_path, monkeypatch):
    def fails(*args, **kwargs):
        raise Boom

    monkeypatch.setattr(loop, "run_step", fails)
    new_dir = tmp_path / "new"
    with pytest.raises(Boom):
        train(retrofit_config(new_dir))
    assert not new_dir.exists()

    old_dir = tmp_path / "old"
    old_dir.mkdir()
    (old_dir / "notes.txt").write_text("mine")
    with pytest.raises(Boom):
        train(retrofit_config(old_dir))
    assert sorted(p.name for p in old_dir.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_run_removes_only_what_it_created_never_what_others_added_meanwhile(tmp_path, monkeypatch, existed):
    """While the run runs, someone else adds a file and a folder (with a file) to its directory: the failed run
    removes its own files (run_config.json, train_log.jsonl) and keeps theirs; a directory the run created stays
    for them."""
    output_dir = tmp_path / "run"
    if existed:
        output_dir.mkdir()

    def others_write_then_the_step_fails(*args, **kwargs):
        (output_dir / "notes.txt").write_text("theirs")
        (output_dir / "plots").mkdir()
        (output_dir / "plots" / "loss.png").write_bytes(b"theirs")
        (output_dir / "final.bak").write_text("theirs")
        raise Boom

    monkeypatch.setattr(loop, "run_step", others_write_then_the_step_fails)
    with pytest.raises(Boom):
        train(retrofit_config(output_dir))
    assert sorted(str(p.relative_to(output_dir)) for p in output_dir.rglob("*")) == \
        ["final.bak", "notes.txt", "plots", "plots/loss.png"]


def test_a_model_that_fails_to_load_leaves_no_run_config_behind(tmp_path, monkeypatch):
    def cannot_load(*args, **kwargs):
        raise OSError("weights missing")

    monkeypatch.setattr(loop, "build_setup", cannot_load)
    output_dir = tmp_path / "run"
    with pytest.raises(OSError, match="weights missing"):
        train(retrofit_config(output_dir))
    assert not output_dir.exists()


def test_a_run_that_fails_after_a_checkpoint_keeps_it_for_resume_and_says_so(tmp_path, monkeypatch, caplog):
    output_dir = tmp_path / "run"
    real_step, calls = loop.run_step, []

    def fails_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Boom
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "run_step", fails_on_second)
    with pytest.raises(Boom):
        train(retrofit_config(output_dir, max_steps=None, save_every=1))
    assert (output_dir / CHECKPOINT_FILE).is_file()
    assert "keeps its checkpoint for --resume" in caplog.text
    assert not (output_dir / LOCK_FILE).exists()
