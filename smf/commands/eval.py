"""``smf eval``: the three evaluations of one model (base, memory adapter, LoRA adapter, finetuned model,
or a training run directory), with data and settings from flags or a suite config."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from smf.data.paths import DataPaths
from smf.data.protocol import DEFAULT_PROTOCOL, PROTOCOLS
from smf.errors import ConfigError
from smf.eval.settings import EvalSettings
from smf.files import write_json_atomic
from smf.options import ListAction, positive_int
from smf.threads import use_threads
from smf.train.config import check_device_and_backend
from smf.vocabulary import BACKENDS, DEFAULT_MODEL, EVAL_ROLES, TASKS

logger = logging.getLogger(__name__)

COMMANDS = {"eval": "MedMCQA / WikiText / TriviaQA (or own learn / heldout / retain files) of a base model, memory "
                    "adapter, LoRA adapter or finetuned model"}
PAPER_PATH_FLAGS = ("medmcqa_path", "wikitext_path", "triviaqa_path")
OWN_ROLE_FLAGS = {"learn": "eval_learn", "heldout": "eval_heldout", "retain": "eval_retain",
                  "retain_heldout": "eval_retain_heldout"}


def add_arguments(parser: argparse.ArgumentParser, command: str = "eval") -> None:
    defaults = EvalSettings()
    parser.add_argument("--model", help=f"base model: hub id, local directory or 'tiny' (default: the base model "
                                        f"--adapter records, else {DEFAULT_MODEL})")
    parser.add_argument("--adapter", metavar="DIR",
                        help="what to evaluate on top of --model: a training run directory, a memory adapter, a "
                             "peft LoRA adapter, or a full-finetune model directory (default: the base model)")
    parser.add_argument("--tasks", action=ListAction, item_choices=TASKS + EVAL_ROLES, metavar="TASK",
                        help=f"tasks, space- or comma-separated, from {', '.join(TASKS)}, or with own data "
                             f"{', '.join(EVAL_ROLES)} (default: all, or the --config's; own data: the roles given)")
    parser.add_argument("--config", metavar="NAME_OR_FILE",
                        help="take data paths, protocol and evaluation settings from this suite config (e.g. tiny)")
    parser.add_argument("--protocol", choices=PROTOCOLS,
                        help=f"evaluation protocol (smf/data/protocol.py; default: the --config's, else "
                             f"{DEFAULT_PROTOCOL})")
    for task, help_text in (("medmcqa", "MedMCQA validation"), ("wikitext", "WikiText-103 test"),
                            ("triviaqa", "TriviaQA rc.nocontext validation")):
        parser.add_argument(f"--{task}-path", metavar="PATH",
                            help=f"local {help_text} split in the hub schema (default: the --config's, else the hub)")
    for role, (schema, rule) in {"learn": ("qa or mc", "learn_acc, the TriviaQA or MedMCQA rule"),
                                 "heldout": ("text", "heldout_ppl, the WikiText rule"),
                                 "retain": ("qa or mc", "retain_acc, the TriviaQA or MedMCQA rule"),
                                 "retain-heldout": ("qa or mc", "retain_heldout_acc (old knowledge asked in a form no "
                                                    "training text holds), the TriviaQA or MedMCQA rule")
                                 }.items():
        parser.add_argument(f"--eval-{role}", metavar="PATH",
                            help=f"own {schema} rows (docs/own-data.md) scored as {rule}; instead of the paper's "
                                 "data (default: the --config's)")
    parser.add_argument("--medmcqa-examples", type=int, metavar="N",
                        help=f"first N single-answer questions (default: {defaults.medmcqa_examples})")
    parser.add_argument("--triviaqa-examples", type=int, metavar="N",
                        help=f"first N questions (default: {defaults.triviaqa_examples})")
    parser.add_argument("--device", default="auto", help="torch device: auto (cuda if available, else cpu), cpu, "
                                                          "cuda, cuda:1, ... (default: auto)")
    parser.add_argument("--backend", choices=BACKENDS, help="memory kernel backend of a model with memories; it must "
                        "run on --device (default: automatic: triton on CUDA, else ext when built, else torch)")
    parser.add_argument("--threads", type=positive_int, metavar="N", help="torch threads of this process (default: "
                        "1 for a small model: tiny, or a local one of hidden size <= 256; else torch's default)")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="where metrics.json and the per-example jsonl files go (default: eval/ inside "
                             "--adapter, else ./smf-eval)")


def _eval_inputs(args: argparse.Namespace) -> tuple[DataPaths, EvalSettings, str]:
    """Data paths, settings and protocol: paper defaults < --config < flags."""
    from smf.suite.config import load_suite_config, parse_suite_config  # its schema: 30 ms that `smf --help` skips

    base = {"model": args.model or DEFAULT_MODEL, "output_dir": ".", "seeds": [0], "conditions": ["base"]}
    if args.config is not None:
        saved = load_suite_config(args.config).to_dict()
        base.update(data=saved["data"], eval=saved["eval"], protocol=saved["protocol"])
    if args.protocol is not None:
        base["protocol"] = args.protocol
    evaluated = ("medmcqa_validation", "wikitext", "triviaqa", *(f"eval_{role}" for role in EVAL_ROLES))
    data = {key: value for key, value in base.get("data", {}).items() if key in evaluated}  # not training files
    own_given = [role for role, name in OWN_ROLE_FLAGS.items() if getattr(args, name, None) is not None]
    paper_given = [name for name in PAPER_PATH_FLAGS if getattr(args, name) is not None]
    if own_given and paper_given:
        raise ConfigError(f"--eval-{own_given[0]} cannot be combined with --{paper_given[0].replace('_', '-')}: own "
                          "data replaces the paper's (docs/own-data.md)")
    settings = dict(base.get("eval", {}))
    if own_given:  # the flags' own files replace the config's data; their roles are the tasks unless --tasks says
        data = {f"eval_{role}": getattr(args, OWN_ROLE_FLAGS[role]) for role in own_given}
        settings["tasks"] = own_given
    for task, key in (("medmcqa", "medmcqa_validation"), ("wikitext", "wikitext"), ("triviaqa", "triviaqa")):
        if getattr(args, f"{task}_path") is not None:
            data[key] = getattr(args, f"{task}_path")
    for key, value in (("tasks", args.tasks), ("medmcqa_examples", args.medmcqa_examples),
                       ("triviaqa_examples", args.triviaqa_examples)):
        if value is not None:
            settings[key] = value
    parsed = parse_suite_config({**base, "data": data, "eval": settings}, Path.cwd(), source="smf eval")
    return parsed.data, parsed.eval, parsed.protocol


def refuse_unused(args: argparse.Namespace, settings: EvalSettings) -> None:
    """ConfigError, with the reason, for a flag this evaluation would not use: a task's path or size when
    --tasks leaves the task out, --backend for a model without memories, a --model other than the base model
    a training run in --adapter records. A --model beside a whole finetuned model is logged."""
    from smf.model.loading import adapter_kind, read_run_config  # torch and transformers: only when a command runs

    for task, flags in (("medmcqa", ("medmcqa_path", "medmcqa_examples")), ("wikitext", ("wikitext_path",)),
                        ("triviaqa", ("triviaqa_path", "triviaqa_examples"))):
        for name in flags:
            if getattr(args, name) is not None and task not in settings.tasks:
                raise ConfigError(f"--{name.replace('_', '-')} is not used: --tasks leaves out {task}")
    for role, name in OWN_ROLE_FLAGS.items():
        if getattr(args, name, None) is not None and role not in settings.tasks:
            raise ConfigError(f"--eval-{role} is not used: --tasks leaves out {role}")
    kind = None if args.adapter is None else adapter_kind(args.adapter)
    recipe = read_run_config(args.adapter)["recipe"] if kind == "run" else None
    if args.backend is not None and (kind in (None, "lora", "full") or recipe in ("lora", "full")):
        raise ConfigError(f"--backend is not used: the model evaluated has no memories "
                          f"({'a base model' if kind is None else f'--adapter holds a {recipe or kind} model'})")
    if args.model is not None and kind == "run":
        recorded = read_run_config(args.adapter)["model"]
        if recorded != args.model:
            raise ConfigError(f"--model {args.model} is not used: the run in --adapter trained on {recorded!r}, "
                              "which it loads; omit --model")
    if args.model is not None and kind == "full":  # its base cannot be checked: said, not refused
        logger.warning("--model %s is not used: --adapter holds a whole finetuned model", args.model)


def run(args: argparse.Namespace) -> int:
    from smf.eval.tasks import evaluate_model, load_eval_sets  # torch and transformers: only when a command runs
    from smf.model.loading import load_model
    from smf.train.distributed import pick_device

    data, settings, protocol = _eval_inputs(args)
    refuse_unused(args, settings)
    check_device_and_backend(args.device, args.backend)
    if args.output_dir is not None:
        output_dir = Path(args.output_dir)
    else:
        output_dir = Path(args.adapter) / "eval" if args.adapter is not None else Path("smf-eval")
    own_sets = load_eval_sets(data, settings, protocol) if data.own else None  # read and checked before the model
    model, tokenizer = load_model(args.model, args.adapter, pick_device(args.device), backend=args.backend)
    use_threads(args.threads, model.config._name_or_path)
    rows = {}
    metrics, seconds = evaluate_model(model, tokenizer, own_sets or load_eval_sets(data, settings, protocol), settings,
                                      output_dir, protocol, rows=rows)
    summary = {"model": args.model, "adapter": args.adapter, "protocol": protocol, "metrics": metrics,
               "eval_s": seconds, "eval_rows": rows,
               "settings": {**dataclasses.asdict(settings), "tasks": list(settings.tasks)}}
    write_json_atomic(output_dir / "metrics.json", summary)
    print(json.dumps(metrics, indent=2))
    logger.info("metrics and per-example files written to %s", output_dir)
    return 0
