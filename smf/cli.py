"""The ``smf`` command line: one subcommand per experiment step.

Subcommands come from the modules in :data:`COMMAND_MODULES`; each defines ``COMMANDS = {name: one-line
help}``, ``add_arguments(parser, name)`` and ``run(args) -> exit code``. To add subcommands, add a module.

Bad input (a ConfigError: missing path, unknown mode, layer beyond the model, ...) prints one
line ``smf <command>: error: ...`` and exits with code 2, without a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from smf.errors import ConfigError
from smf.eval import command as eval_command
from smf.report import command as report_command
from smf.suite import commands as suite_command
from smf.train import commands as train_commands

COMMAND_MODULES = (train_commands, suite_command, report_command, eval_command)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a single line (exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="smf", description="Sparse Memory Finetuning experiments (see README).")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    for module in COMMAND_MODULES:
        for name, help_text in module.COMMANDS.items():
            sub = subparsers.add_parser(name, help=help_text, description=help_text)
            module.add_arguments(sub, name)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    level = args.log_level if int(os.environ.get("RANK", 0)) == 0 else "WARNING"  # torchrun: rank 0 reports
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except ConfigError as err:
        print(f"smf {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
