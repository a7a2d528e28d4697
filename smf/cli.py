"""The ``smf`` command line: one subcommand per experiment step.

Subcommands come from the modules in :data:`COMMAND_MODULES`; each defines ``COMMANDS = {name: one-line
help}``, ``add_arguments(parser, name)`` and ``run(args) -> exit code``. To add subcommands, add a module.

Bad input (a ConfigError: missing path, unknown mode, layer beyond the model, a device this machine lacks, a
flag the run would ignore, a file that is not what it claims, a run that diverged, ...) and a write the system
refuses (a full disk) print one line ``smf <command>: error: ...`` and exit with code 2, without a traceback.
Building the parser (``smf --help``) imports neither torch nor transformers: commands import them when they run.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

from smf.commands import eval as eval_command
from smf.commands import report as report_command
from smf.commands import suite as suite_command
from smf.commands import train as train_commands
from smf.errors import ConfigError
from smf.files import os_error_behind
from smf.vocabulary import REMOVED_OPTIONS

COMMAND_MODULES = (train_commands, suite_command, report_command, eval_command)
# The errors of a write the system refuses: no space, over quota, a read-only file system, a file size limit.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are a single line (exit code 2), naming what replaced a removed option."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            given = {word.split("=")[0] for word in message.split()}
            message += "".join(f"; {hint}" for option, hint in REMOVED_OPTIONS.items() if option in given)
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
    except (OSError, RuntimeError) as err:  # a write the system refused, wherever it happened (a library's save)
        cause = os_error_behind(err)
        if cause is None or cause.errno not in STORAGE_ERRNOS:
            raise
        where = f" ({cause.filename})" if cause.filename else ""
        print(f"smf {args.command}: error: a write failed{where}: {cause.strerror}; free space or choose another "
              "--output-dir", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
