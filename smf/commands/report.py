"""``smf report``: Table 1, the Pareto figure, the accounting and the status of a suite directory."""
from __future__ import annotations

import argparse

COMMANDS = {"report": "Table 1 (md/csv/tex), Pareto figure, parameter accounting and status of a suite directory"}


def add_arguments(parser: argparse.ArgumentParser, command: str = "report") -> None:
    parser.add_argument("--suite-dir", required=True, metavar="DIR", help="directory written by `smf suite`")


def run(args: argparse.Namespace) -> int:
    from smf.suite.report import load_suite_dir, write_suite_report  # torch, transformers, matplotlib: when it runs

    for path in write_suite_report(args.suite_dir):
        print(path)
    notice = load_suite_dir(args.suite_dir).notice
    if notice:
        print(f"NOTE: {notice.strip()}")
    return 0
