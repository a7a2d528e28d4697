"""The ``smf retrofit``, ``smf background`` and ``smf train`` subcommands: their flags and what they run."""
from __future__ import annotations

import argparse

from smf.options import add_flags
from smf.train.config import OPTIONS, RunConfig, build_config, read_config_file


def config_from_args(args: argparse.Namespace, command: str) -> RunConfig:
    """Defaults < preset < --config file < flags, validated (ConfigError on bad input)."""
    given = {name: value for name, value in vars(args).items() if name in OPTIONS}
    return build_config(command, read_config_file(args.config, command) if "config" in args else {}, given)


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` (retrofit, background or train) with the options in ``args``."""
    config = config_from_args(args, args.command)
    config = config.resolved(config.recipe if args.command == "train" else args.command)
    if args.command == "background":
        from smf.train.background import collect_background as run_stage
    else:
        from smf.train.loop import train as run_stage
    run_stage(config)  # it logs what it wrote
    return 0


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """``--config`` and one flag per option of ``command``."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="YAML or JSON file of options "
                        "(keys: option names below, e.g. output-dir); command-line flags override it (default: none)")
    add_flags(parser, RunConfig, command)


COMMANDS = {"retrofit": "stage 1: attach fresh memories and train them on oasst1 (memory adapter)",
            "background": "background read statistics of the retrofit memories on held-out oasst1",
            "train": "stage 2 on MedMCQA: --recipe sparse (from the retrofit memories), lora or full"}
