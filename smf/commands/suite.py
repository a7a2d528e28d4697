"""``smf suite``: run (or finish) the suite of a config, or list its runs (registered by :mod:`smf.cli`)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from smf.errors import ConfigError
from smf.options import ListAction, positive_int
from smf.vocabulary import CONDITIONS, SPARSE_CONDITIONS

logger = logging.getLogger(__name__)
# The shipped suite configs (smf/configs/suite_NAME.yaml), by name, for the help text.
SHIPPED = sorted(path.stem.removeprefix("suite_")
                 for path in (Path(__file__).resolve().parents[1] / "configs").glob("suite_*.yaml"))


def add_arguments(parser: argparse.ArgumentParser, command: str = "suite") -> None:
    parser.add_argument("--config", required=True, metavar="NAME_OR_FILE", help="suite config: a YAML/JSON file "
                        f"or a shipped name ({', '.join(SHIPPED)}); relative data paths in it resolve against the "
                        "file's folder")
    parser.add_argument("--output-dir", metavar="DIR", help="suite directory (default: the config's output_dir, "
                        "relative to the current directory)")
    parser.add_argument("--seeds", action=ListAction, item_type=int, metavar="SEED",
                        help="override the config's seeds, space- or comma-separated (--seeds 0 1, --seeds 0,1)")
    parser.add_argument("--conditions", action=ListAction, item_choices=CONDITIONS, metavar="CONDITION",
                        help=f"override the config's conditions, space- or comma-separated, from: "
                             f"{', '.join(CONDITIONS)}; the config's authors_update ablation keeps only the chosen "
                             f"ones (add --authors-update to choose it)")
    parser.add_argument("--authors-update", action=ListAction, item_choices=("none", *SPARSE_CONDITIONS),
                        metavar="CONDITION", help="override the config's authors_update: the sparse conditions also "
                        "run with the authors' update (ablation_update.md), or 'none' for no ablation runs")
    parser.add_argument("--device", help="override the config's torch device (auto, cpu, cuda, cuda:1, ...)")
    parser.add_argument("--threads", type=positive_int, metavar="N", help="override the config's threads: torch "
                        "threads of the suite's process (default: the config's, else 1 for a small model, else "
                        "torch's default)")
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N", help="run independent runs in N worker "
                        "processes (one torch thread each unless --threads says otherwise), each shared retrofit and "
                        "background stage before the runs that need it; the same results as one process, resumable "
                        "(default: 1, everything in this process)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and whether each is done; run none")
    parser.add_argument("--no-report", action="store_true", help="skip `smf report` at the end")


def overrides_from_args(args: argparse.Namespace) -> dict:
    """The top-level keys the flags replace. ``--authors-update none`` drops the ablation; without the flag,
    ``--conditions`` keeps the ablation runs of the conditions chosen (it needs no ablation of a condition the
    suite no longer runs)."""
    from smf.suite.config import read_suite_file  # the suite config's schema: 30 ms that `smf --help` skips

    overrides = {key: getattr(args, key) for key in ("output_dir", "seeds", "conditions", "device", "threads")
                 if getattr(args, key) is not None}
    if args.authors_update is not None:
        if "none" in args.authors_update and len(args.authors_update) > 1:
            raise ConfigError("--authors-update: 'none' cannot be combined with conditions")
        overrides["authors_update"] = [] if args.authors_update == ["none"] else args.authors_update
    elif args.conditions is not None:
        ablation = read_suite_file(args.config).get("authors_update") or []
        ablation = [ablation] if isinstance(ablation, str) else list(ablation)
        kept = [condition for condition in ablation if condition in args.conditions]
        if kept != ablation:
            logger.info("authors_update: %s (the config's %s, narrowed to --conditions)", kept or "none", ablation)
        overrides["authors_update"] = kept
    return overrides


def run(args: argparse.Namespace) -> int:
    from smf.suite.config import load_suite_config  # as in overrides_from_args
    from smf.suite.dry_run import dry_run_lines

    config = load_suite_config(args.config, overrides_from_args(args))
    if args.dry_run:
        print("\n".join(dry_run_lines(config)))
        return 0
    # torch, transformers, matplotlib: imported after the config's checks, which fail in seconds without them
    from smf.suite.report import write_suite_report
    from smf.suite.runner import run_suite

    run_suite(config, args.jobs)
    if not args.no_report:
        for path in write_suite_report(config.output_dir):
            print(path)
    if config.notice:
        print(f"NOTE: {config.notice.strip()}")
    return 0


COMMANDS = {"suite": "run Table 1: base + the eight trained conditions across seeds, evaluated, resumable"}
