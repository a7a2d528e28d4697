"""``smf suite --dry-run``: what a suite would do, without doing it: the steps before the runs (the science
preset's world and pretrained model), one line per planned run with its state, and the totals with a time
estimate from the runs already finished."""
from __future__ import annotations

import statistics

from smf.data.world import WorldOptions
from smf.files import read_json_object
from smf.suite.config import SuiteConfig, base_root, seed_config
from smf.suite.finished import run_state
from smf.suite.plan import SuiteLayout, plan_runs


def _pretraining_state(config: SuiteConfig, seed: int | None) -> str:
    """'done (N s)', 'to do', 'to do (resumes its checkpoint)' or 'refused: ...' for the pretraining of the base
    of ``seed`` (None: the suite's one shared base) in ``config``."""
    from smf.train.pretrain import MARKER, PretrainOptions, base_fingerprint  # torch: only with a world

    own = config if seed is None else seed_config(config, seed)
    directory = base_root(config.output_dir, seed) / "pretrain"
    marker = directory / MARKER
    if marker.is_file():
        recorded = read_json_object(marker, "pretraining marker")
        fingerprint = base_fingerprint(WorldOptions.from_dict(own.world), PretrainOptions.from_dict(own.pretrain))
        if recorded.get("fingerprint") != fingerprint:
            return "refused: it holds a model pretrained with other world or pretrain options"
        return f"done ({recorded.get('seconds', 0):.0f} s)"
    return "to do (resumes its checkpoint)" if directory.is_dir() and any(directory.iterdir()) else "to do"


def _pretraining_lines(config: SuiteConfig) -> list[str]:
    """The lines on the steps before the runs: the shared world and base, or each seed's (``base_per_seed``)."""
    if not config.base_per_seed:
        return [f"before the runs: the world (world/) and the model pretrained on it (pretrain/): "
                f"{_pretraining_state(config, None)}"]
    return [f"before the runs of seed {seed}: its world and the model pretrained on it (bases/seed{seed}/): "
            f"{_pretraining_state(config, seed)}" for seed in config.seeds]


def _run_state(layout: SuiteLayout, config: SuiteConfig, run) -> tuple[str, float | None]:
    """(state, wall seconds of a finished run) of a planned run."""
    state = run_state(layout, config, run)  # the rule the runner follows
    if state.state == "foreign":
        return "refused: written with other settings (delete it to recompute)", None
    if state.state == "damaged":
        return "to do (its results file is damaged: it is computed again)", None
    return state.state, None if state.record is None else state.record["timing"].get("wall_s")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {seconds:02d} s"


def dry_run_lines(config: SuiteConfig) -> list[str]:
    """The lines ``smf suite --dry-run`` prints for ``config``."""
    layout = SuiteLayout(config.output_dir)
    runs = plan_runs(config)
    lines = [f"suite {config.name}: {len(runs)} runs, seeds {', '.join(map(str, config.seeds))}, "
             f"into {config.output_dir}"]
    if config.pretrain:
        lines += _pretraining_lines(config)
    width = max(len(run.name) for run in runs)
    lines.append(f"{'run':<{width}}  state")
    states = [_run_state(layout, config, run) for run in runs]
    lines += [f"{run.name:<{width}}  {state}" for run, (state, _) in zip(runs, states)]
    done = [seconds for state, seconds in states if state == "done"]
    todo = sum(state.startswith("to do") for state, _ in states)
    total = f"total: {len(runs)} runs, {len(done)} done, {todo} to do"
    if len(done) + todo < len(runs):
        total += f", {len(runs) - len(done) - todo} refused"
    timed = [seconds for seconds in done if seconds is not None]
    if todo and timed:
        total += (f"; about {_duration(statistics.fmean(timed) * todo)} left at the finished runs' mean of "
                  f"{statistics.fmean(timed):.0f} s per run on this machine (the first runs of a seed also train "
                  "the stages later ones share)")
    elif todo:
        total += "; no time estimate before a run has finished (README and docs/*.md give measured times)"
    return lines + [total]
