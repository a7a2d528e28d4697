"""``smf report``: Table 1, the Pareto figure, the accounting and the status of a suite directory; or the tables of
a suite's packed per-run results (:mod:`smf.suite.shipped`), with no run folders."""
from __future__ import annotations

import argparse

from smf.errors import ConfigError

COMMANDS = {"report": "Table 1 (md/csv/tex), Pareto figure, parameter accounting and status of a suite directory"}


def add_arguments(parser: argparse.ArgumentParser, command: str = "report") -> None:
    source = parser.add_mutually_exclusive_group()  # one of them, checked when it runs (a misspelt option named first)
    source.add_argument("--suite-dir", metavar="DIR", help="directory written by `smf suite`")
    source.add_argument("--results", metavar="FILE", help="a suite's packed per-run results (--pack; e.g. "
                        "docs/science/results/*/results.json): its tables drawn into --out, no run folders needed")
    parser.add_argument("--out", metavar="DIR", help="with --results: the directory the tables are written to")
    parser.add_argument("--pack", metavar="FILE", help="with --suite-dir: also write its per-run results as one "
                        "compact JSON file (what --results reads)")


def run(args: argparse.Namespace) -> int:
    if args.suite_dir is None and args.results is None:
        raise ConfigError("give --suite-dir DIR (a suite directory) or --results FILE (a suite's packed results)")
    if args.results is not None:
        if args.out is None or args.pack is not None:
            raise ConfigError("--results needs --out DIR (where its tables go) and takes no --pack")
        from smf.suite.shipped import write_packed_report  # torch, matplotlib: when it runs

        for path in write_packed_report(args.results, args.out):
            print(path)
        return 0
    if args.out is not None:
        raise ConfigError("--out goes with --results; a suite directory's report is written into it")
    from smf.suite.report import load_suite_dir, write_suite_report  # torch, transformers, matplotlib: when it runs

    for path in write_suite_report(args.suite_dir):
        print(path)
    if args.pack is not None:
        from smf.suite.shipped import write_packed

        print(write_packed(args.suite_dir, args.pack))
    notice = load_suite_dir(args.suite_dir).notice
    if notice:
        print(f"NOTE: {notice.strip()}")
    return 0
