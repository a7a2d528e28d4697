"""``smf suite``: run (or finish) the suite of a config, or list its runs (registered by :mod:`smf.cli`)."""
from __future__ import annotations

import argparse

from smf.suite.config import load_suite_config
from smf.vocabulary import CONDITIONS


def add_arguments(parser: argparse.ArgumentParser, command: str = "suite") -> None:
    parser.add_argument("--config", required=True, metavar="NAME_OR_FILE", help="suite config: a YAML/JSON file "
                        "or a shipped name (tiny, paper); relative data paths in it resolve against the file's folder")
    parser.add_argument("--output-dir", metavar="DIR", help="suite directory (default: the config's output_dir, "
                        "relative to the current directory)")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="SEED", help="override the config's seeds")
    parser.add_argument("--conditions", metavar="LIST",
                        help=f"override the config's conditions, comma-separated, from: {', '.join(CONDITIONS)}")
    parser.add_argument("--device", help="override the config's torch device (auto, cpu, cuda, cuda:1, ...)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and whether each is done; run none")
    parser.add_argument("--no-report", action="store_true", help="skip `smf report` at the end")


def run(args: argparse.Namespace) -> int:
    from smf.report.suite_dir import write_suite_report
    from smf.suite.plan import SuiteLayout, plan_runs
    from smf.suite.runner import run_suite

    overrides = {key: getattr(args, key) for key in ("output_dir", "seeds", "conditions", "device")
                 if getattr(args, key) is not None}
    config = load_suite_config(args.config, overrides)
    if args.dry_run:
        layout = SuiteLayout(config.output_dir)
        for planned in plan_runs(config):
            print(f"{planned.name:<24} {'done' if layout.results_path(planned).is_file() else 'to do'}")
        return 0
    run_suite(config)
    if not args.no_report:
        for path in write_suite_report(config.output_dir):
            print(path)
    return 0


COMMANDS = {"suite": "run Table 1: base + the eight trained conditions across seeds, evaluated, resumable"}
