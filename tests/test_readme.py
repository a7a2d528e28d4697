"""Every Python block of README.md and docs/hf.md runs as written, on its own: each in a fresh interpreter (so
a block uses nothing another block defined), in the file's order (a block may read what an earlier one
saved), after the commands they need, in a fresh directory, offline, on the tiny preset.

What runs: every ```python block, and the commands of the ```bash blocks marked ``<!-- readme-test: run ... -->``
(the ones the Python blocks, or the lm-eval command line, depend on). The other bash blocks (installs, the
experiment commands) do not run here; tests/test_cli_smf.py and the suite tests cover those commands.

What is substituted, and why (nothing else is changed):

- ``smf ...`` runs as ``python -m smf.cli ...`` with this checkout on PYTHONPATH: the ``smf`` on PATH may
  belong to another checkout;
- in blocks marked ``local lm-eval task``, lm-eval's ``hellaswag`` (a hub dataset, and there is no network
  here) becomes ``smf_readme_choice``, a three-question multiple-choice task written to a local folder;
- ``lm_eval ...`` runs as ``python -c "... cli_evaluate()"`` (lm-eval's own entry point) in an interpreter that
  cannot import smf, so that the model is loaded by the code saved beside its weights.

Without lm-eval installed the blocks marked ``local lm-eval task`` are not run, and the test says so by
skipping after the others have passed.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marks>[^>]*) -->\n)?```(?P<lang>\w+)\n(?P<body>.*?)```", re.S)
TASK = "smf_readme_choice"
QUESTIONS = [{"question": "Which vitamin prevents scurvy?", "choices": [" Vitamin C.", " Iron."], "answer": 0},
             {"question": "Which organ makes insulin?", "choices": [" The liver.", " The pancreas."], "answer": 1},
             {"question": "Which blood cells carry oxygen?", "choices": [" White.", " Red.", " None."], "answer": 1}]
NO_SMF = ("import importlib.abc, sys\n"
          "class NoSmf(importlib.abc.MetaPathFinder):\n"
          "    def find_spec(self, name, path=None, target=None):\n"
          "        if name.split('.')[0] in ('smf', 'smf_kernels'):\n"
          "            raise ImportError(name + ' is blocked: the saved code must load the model')\n"
          "sys.meta_path.insert(0, NoSmf())\n"
          "from lm_eval.__main__ import cli_evaluate\n"
          "sys.argv[0] = 'lm_eval'\n"
          "cli_evaluate()\n")


DOCUMENTS = ("README.md", "docs/hf.md")  # the files whose blocks run


def readme_blocks(document: str = "README.md") -> list[dict]:
    """The fenced blocks of ``document``: language, body, marks (the words of a readme-test comment), line."""
    text = (REPO / document).read_text()
    return [{"lang": m["lang"], "body": m["body"], "line": text.count("\n", 0, m.start("body")) + 1,
             "marks": {mark.strip() for mark in (m["marks"] or "").split(",") if mark.strip()}}
            for m in BLOCK.finditer(text)]


def _write_task(folder: Path) -> None:
    folder.mkdir()
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'questions.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")


def _commands(body: str, task_dir: Path, local_task: bool) -> list[list[str]]:
    """The commands of a bash block (one per line, comments dropped), substituted as the module docstring says."""
    commands = []
    for line in body.splitlines():
        words = line.split("#")[0].split()
        if not words:
            continue
        if local_task:
            words = [TASK if word == "hellaswag" else word for word in words]
        if words[0] == "smf":
            commands.append([sys.executable, "-m", "smf.cli", *words[1:]])
        elif words[0] == "lm_eval":
            extra = ["--include_path", str(task_dir)] if local_task else []
            commands.append([sys.executable, "-c", NO_SMF, *words[1:], *extra])
        else:
            raise AssertionError(f"README bash block marked to run holds a command this test cannot run: {line!r}")
    return commands


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCUMENTS)
def test_python_blocks_run_as_written_each_on_its_own(tmp_path, document):
    blocks = readme_blocks(document)
    assert sum(b["lang"] == "python" for b in blocks) >= (2 if document == "README.md" else 4)
    have_lm_eval = importlib.util.find_spec("lm_eval") is not None
    task_dir = tmp_path / "lm_eval_task"
    _write_task(task_dir)
    steps, skipped = [], []
    for block in blocks:
        local_task = "local lm-eval task" in block["marks"]
        if local_task and not have_lm_eval:
            skipped.append(block["line"])
            continue
        if block["lang"] == "python":
            body = block["body"]
            if local_task:
                assert 'tasks=["hellaswag"]' in body, block["line"]
                body = body.replace('tasks=["hellaswag"]', f'tasks=["{TASK}"], task_manager=lm_eval.tasks.'
                                                           f'TaskManager(include_path={str(task_dir)!r})')
            steps.append(("python", block["line"], body))
        elif "run" in block["marks"]:
            steps.extend(("command", block["line"], command)
                         for command in _commands(block["body"], task_dir, local_task))
    # each Python block in an interpreter of its own: "python -c BODY"
    driver = (
        "import json, subprocess, sys, time\n"
        "steps = json.loads(sys.argv[1])\n"
        "for kind, line, what in steps:\n"
        "    started = time.perf_counter()\n"
        "    command = [sys.executable, '-c', what] if kind == 'python' else what\n"
        "    done = subprocess.run(command, capture_output=True, text=True)\n"
        "    shown = what if kind == 'python' else (what[3:] if what[1] == '-c' else what)\n"
        f"    assert done.returncode == 0, f'{document}:{{line}}: {{shown}}\\n' + done.stderr[-3000:]\n"
        "    print(done.stdout)\n"
        "    print('DONE', kind, line, f'{time.perf_counter() - started:.1f} s', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_MODULES_CACHE": str(tmp_path / "hf_modules")}
    result = subprocess.run([sys.executable, "-c", driver, json.dumps(steps)], capture_output=True, text=True,
                            timeout=900, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    done = [line for line in result.stdout.splitlines() if line.startswith("DONE ")]
    print("\n".join(done))
    assert len(done) == len(steps)
    if document == "README.md":
        saved = tmp_path / "runs" / "recipe" / "model"  # the recipe's model, loaded again by the next block
        assert (saved / "modeling_smf_memories.py").is_file() and (saved / "tokenizer").is_dir()
        assert "Do you wish to run the custom code" not in result.stdout + result.stderr
        losses = re.search(r"^loss: \[(.*)\]$", result.stdout, re.M)
        assert losses, result.stdout[-2000:]
        losses = [float(v) for v in losses[1].split(",")]
        assert len(losses) >= 3 and losses[-1] < losses[0], losses  # the example shows its loss falling
    if have_lm_eval and document == "docs/hf.md":
        assert re.search(rf"\|{TASK}\s*\|.*\|acc\s*\|", result.stdout), result.stdout[-2000:]  # the CLI's table
    if skipped:
        pytest.skip(f"lm-eval is not installed: {document} blocks at lines {skipped} did not run (the others did)")


def test_ci_checks_the_transformers_bound_pyproject_declares():
    declared = re.search(r'"transformers>=([\d.]+)"', (REPO / "pyproject.toml").read_text())[1]
    checked = re.search(r"^TRANSFORMERS_LOWER_BOUND=([\d.]+)$", (REPO / ".ci" / "run").read_text(), re.M)[1]
    assert checked == declared
    assert f"transformers>={declared}" in (REPO / "README.md").read_text()


def test_readme_is_short_and_ci_runs_its_test_command():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 160
    assert 'pip install -c constraints-cpu.txt -e ".[dev]" && python -m pytest -q tests\n' in text
    assert '-e ".[dev]" && python -m pytest -q tests\n' in (REPO / ".ci" / "run").read_text()  # no looser
