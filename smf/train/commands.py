"""The ``smf retrofit``, ``smf background`` and ``smf train`` subcommands: options and what they run.

Every option of :class:`smf.train.config.RunConfig` that a command takes becomes a flag
(``output_dir`` -> ``--output-dir``); ``--config FILE`` reads the same names from YAML/JSON.
"""
from __future__ import annotations

import argparse
import logging

from smf.train.config import FIELDS, RECIPE_LR, RunConfig, build_config, field_type, read_config_file
from smf.vocabulary import canonical

logger = logging.getLogger(__name__)

_DEFAULTS = RunConfig()


def _default_text(name: str) -> str:
    default = getattr(_DEFAULTS, name)
    if isinstance(default, (list, tuple)):
        return " ".join(str(v) for v in default)
    return "none" if default is None else str(default)


def _bool_flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _choice(flag: str):
    return lambda text: canonical(text, flag)


def add_run_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``--config`` and one flag per option of ``command``; unset flags stay out of the namespace."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="YAML or JSON file of options (keys: the option names below, e.g. output-dir); "
                             "command-line flags override it (default: none)")
    for name, spec in FIELDS.items():
        if command not in spec.metadata["commands"]:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{spec.metadata['help']} (default: {_default_text(name)})"
        choices = spec.metadata["choices"]
        kind = field_type(name)
        if name == "resume":
            parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_text)
        elif name == "layers":
            parser.add_argument(flag, type=int, nargs="+", metavar="INDEX", default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(flag, type=_bool_flag if kind is bool else _choice(flag) if choices else kind,
                                choices=choices,
                                metavar=None if choices else name.upper(), default=argparse.SUPPRESS,
                                help=help_text)


def config_from_args(args: argparse.Namespace, command: str) -> RunConfig:
    """Defaults < preset < --config file < flags, validated (ConfigError on bad input)."""
    given = {name: value for name, value in vars(args).items() if name in FIELDS}
    file_options = read_config_file(args.config, command) if "config" in args else {}
    return build_config(command, file_options, given)


def run_retrofit(args: argparse.Namespace) -> int:
    from smf.train.loop import train

    config = config_from_args(args, "retrofit").resolved("retrofit")
    result = train(config)
    logger.info("retrofit: %d of %d steps done; final artefact: %s", result["step"], result["total_steps"],
                result["final_dir"])
    return 0


def run_background(args: argparse.Namespace) -> int:
    from smf.train.background import collect_background

    config = config_from_args(args, "background").resolved("background")
    logger.info("background statistics written to %s", collect_background(config))
    return 0


def run_train(args: argparse.Namespace) -> int:
    from smf.train.loop import train

    config = config_from_args(args, "train")
    config = config.resolved(config.recipe)
    result = train(config)
    logger.info("%s: %d of %d steps done; final artefact: %s", config.recipe, result["step"],
                result["total_steps"], result["final_dir"])
    return 0


def add_retrofit_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser, "retrofit")


def add_background_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser, "background")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser, "train")


# name -> (one-line help, add_arguments, run); smf.cli registers these.
COMMANDS = {
    "retrofit": ("stage 1: attach fresh memories and train them on oasst1 (memory adapter)",
                 add_retrofit_arguments, run_retrofit),
    "background": ("background read statistics of the retrofit memories on held-out oasst1",
                   add_background_arguments, run_background),
    "train": (f"stage 2 on MedMCQA: --recipe sparse (lr {RECIPE_LR['sparse']}), lora ({RECIPE_LR['lora']}) "
              f"or full ({RECIPE_LR['full']})", add_train_arguments, run_train),
}
