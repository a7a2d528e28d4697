"""The ``smf retrofit``, ``smf background`` and ``smf train`` subcommands: their flags and what they run."""
from __future__ import annotations

import argparse
import dataclasses

from smf.options import add_flags, flag, only, shown_value, takes
from smf.threads import use_threads
from smf.train.config import (OPTIONS, RECIPE_DEFAULTS, STAGE_COMMANDS, TINY_PRESET, RunConfig, build_config,
                              read_config_file, refuse_unused)
from smf.train.sections import SECTION_OF, SECTIONS, section_users
from smf.vocabulary import TRAIN_RECIPES


def config_from_args(args: argparse.Namespace, command: str) -> RunConfig:
    """Defaults < preset < --config file < flags, validated (ConfigError on bad input, and for a flag the run would
    not use)."""
    given = {name: value for name, value in vars(args).items() if name in OPTIONS}
    from_file = read_config_file(args.config, command) if "config" in args else {}
    config = build_config(command, from_file, given)
    refuse_unused(config, command, given, from_file)
    return config


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` (retrofit, background or train) with the options in ``args``."""
    config = config_from_args(args, args.command)
    config = config.resolved(config.recipe if args.command == "train" else args.command)
    use_threads(config.threads, config.model)
    if args.command == "background":
        from smf.train.background import collect_background as run_stage  # torch, transformers: when it runs
    else:
        from smf.train.loop import train as run_stage
    run_stage(config)  # it logs what it wrote
    return 0


def shown_defaults(command: str) -> dict[str, str]:
    """The defaults ``--help`` of ``command`` shows for the options its recipes fill in when the run starts
    (:data:`RECIPE_DEFAULTS`): one value, or one per recipe (``0.0005 sparse, 0.0002 lora, 5e-05 full``)."""
    recipes = [recipe for recipe, stage_command in STAGE_COMMANDS.items() if stage_command == command]
    shown = {"mode": "the adapter's"} if command == "train" else {}
    for name in dict.fromkeys(name for recipe in recipes for name in RECIPE_DEFAULTS[recipe]):
        values = {recipe: RECIPE_DEFAULTS[recipe][name] for recipe in recipes}
        shown[name] = (shown_value(values[recipes[0]]) if len(set(values.values())) == 1
                       else ", ".join(f"{shown_value(value)} {recipe}" for recipe, value in values.items()))
    return shown


def section_groups(command: str) -> list[tuple[str, str, list[str]]]:
    """``--help``'s groups of ``command``'s flags: (title, description, options) of each section that has some
    (:mod:`smf.train.sections`), the title naming the recipes that take the section where not all of them do."""
    groups = []
    for name, section in SECTIONS.items():
        options = [option for option in takes(RunConfig, command) if SECTION_OF[option] == name]
        users = section_users(name, command)
        taken = f" (--recipe {', '.join(users)})" if command == "train" and len(users) < len(TRAIN_RECIPES) else ""
        if options:
            groups.append((f"{name} options{taken}", section.__doc__.splitlines()[0], options))
    return groups


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """``--config`` and one flag per option of ``command``, grouped by section, each with the default that applies
    (and the tiny preset's, where it differs)."""
    parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="YAML or JSON file of options "
                        "(keys: option names below, e.g. output-dir); command-line flags override it (default: none)")
    add_flags(parser, RunConfig, command, shown_defaults(command), ("tiny", only(RunConfig, command, TINY_PRESET)),
              section_groups(command))
    parser.not_taken = not_taken(command)


def not_taken(command: str) -> dict[str, str]:
    """The flags of the other stage commands that ``command`` does not take, each with why: who uses it
    (``--rule``: ``smf retrofit does not take it: only smf train --recipe sparse uses it``)."""
    reasons = {}
    for spec in dataclasses.fields(RunConfig):
        commands = spec.metadata.get("commands", ())
        if command in commands:
            continue
        users = []
        for user in commands:
            recipes = section_users(SECTION_OF[spec.name], user) if user == "train" else TRAIN_RECIPES
            users.append(f"smf {user}" if len(recipes) == len(TRAIN_RECIPES)
                         else f"smf train --recipe {' or '.join(recipes)}")
        reasons[flag(spec.name)] = (f"smf {command} does not take it: only {' and '.join(users)} "
                                    f"use{'s' if len(users) == 1 else ''} it")
    return reasons


COMMANDS = {"retrofit": "stage 1: attach fresh memories and train them on oasst1 (memory adapter)",
            "background": "background read statistics of the retrofit memories on held-out oasst1",
            "train": "stage 2 on MedMCQA: --recipe sparse (from the retrofit memories), lora or full"}
