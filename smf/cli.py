"""The ``smf`` command line: one subcommand per experiment step.

Subcommands come from modules listed in :data:`COMMAND_MODULES`; each module defines
``COMMANDS = {name: (help, add_arguments(parser), run(args) -> exit code)}``. To add
subcommands (e.g. ``eval``, ``suite``, ``report``), append your module to COMMAND_MODULES.

Bad input (a ConfigError: missing path, unknown mode, layer beyond the model, ...) prints one
line ``smf <command>: error: ...`` and exits with code 2, without a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from smf.errors import ConfigError

COMMAND_MODULES = ("smf.train.commands", "smf.suite.commands")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a single line (exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="smf", description="Sparse Memory Finetuning experiments (see README).")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_ArgumentParser)
    for module_name in COMMAND_MODULES:
        for name, (help_text, add_arguments, run) in importlib.import_module(module_name).COMMANDS.items():
            sub = subparsers.add_parser(name, help=help_text, description=help_text)
            add_arguments(sub)
            sub.set_defaults(run=run)
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
