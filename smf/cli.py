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
import difflib
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
    """argparse whose usage errors are a single line (exit code 2) from the subcommand's parser (``smf train:
    error: ...``); an unknown option is named with the closest option of that subcommand, with what replaced
    it where it was removed, or with the reason where it is an option of other commands (:attr:`not_taken`)."""

    not_taken: dict[str, str] = {}  # a subcommand's: flag -> why it does not take that flag (set by its module)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            parser = self._subcommand_parsers().get(command, self)
            parser.error(parser.unrecognized(extras))
        return parsed

    def _subcommand_parsers(self) -> dict[str, argparse.ArgumentParser]:
        actions = [action for action in self._actions if isinstance(action, argparse._SubParsersAction)]
        return dict(actions[0].choices) if actions else {}

    def unrecognized(self, extras: list[str]) -> str:
        """``unrecognized argument --rows-per-stpe (did you mean --rows-per-step?)`` for the words of ``extras``
        that look like options (the others are their values), else for every word."""
        options = [word for word in extras if word.startswith("-") and len(word) > 1] or extras
        known = [name for name in self._option_string_actions if name.startswith("--")]
        described = []
        for word in options:
            name = word.split("=")[0]
            close = difflib.get_close_matches(name, known, n=1) if name.startswith("--") else []
            described.append(f"{word} ({REMOVED_OPTIONS[name]})" if name in REMOVED_OPTIONS
                             else f"{word} ({self.not_taken[name]})" if name in self.not_taken
                             else f"{word} (did you mean {close[0]}?)" if close else word)
        return f"unrecognized argument{'s' if len(options) > 1 else ''} {', '.join(described)}"


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
