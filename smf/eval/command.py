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
from smf.eval.settings import EvalSettings
from smf.vocabulary import DEFAULT_MODEL, TASKS

logger = logging.getLogger(__name__)

COMMANDS = {"eval": "MedMCQA / WikiText / TriviaQA of a base model, memory adapter, LoRA adapter or finetuned model"}


def add_arguments(parser: argparse.ArgumentParser, command: str = "eval") -> None:
    defaults = EvalSettings()
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"base model: hub id, local directory or 'tiny' (default: {DEFAULT_MODEL})")
    parser.add_argument("--adapter", metavar="DIR",
                        help="what to evaluate on top of --model: a training run directory, a memory adapter, a "
                             "peft LoRA adapter, or a full-finetune model directory (default: the base model)")
    parser.add_argument("--tasks", metavar="LIST",
                        help=f"comma-separated tasks from {', '.join(TASKS)} (default: all, or the --config's)")
    parser.add_argument("--config", metavar="NAME_OR_FILE",
                        help="take data paths, protocol and evaluation settings from this suite config (e.g. tiny)")
    parser.add_argument("--protocol", choices=PROTOCOLS,
                        help=f"evaluation protocol (smf/data/protocol.py; default: the --config's, else "
                             f"{DEFAULT_PROTOCOL})")
    for task, help_text in (("medmcqa", "MedMCQA validation"), ("wikitext", "WikiText-103 test"),
                            ("triviaqa", "TriviaQA rc.nocontext validation")):
        parser.add_argument(f"--{task}-path", metavar="PATH",
                            help=f"local {help_text} split in the hub schema (default: the --config's, else the hub)")
    parser.add_argument("--medmcqa-examples", type=int, metavar="N",
                        help=f"first N single-answer questions (default: {defaults.medmcqa_examples})")
    parser.add_argument("--triviaqa-examples", type=int, metavar="N",
                        help=f"first N questions (default: {defaults.triviaqa_examples})")
    parser.add_argument("--device", default="auto", help="torch device (default: auto)")
    parser.add_argument("--backend", help="memory kernel backend (torch, triton, ext; default: automatic)")
    parser.add_argument("--output-dir", metavar="DIR",
                        help="where metrics.json and the per-example jsonl files go (default: eval/ inside "
                             "--adapter, else ./smf-eval)")


def _eval_inputs(args: argparse.Namespace) -> tuple[DataPaths, EvalSettings, str]:
    """Data paths, settings and protocol: paper defaults < --config < flags."""
    from smf.suite.config import load_suite_config, parse_suite_config

    base = {"model": args.model, "output_dir": ".", "seeds": [0], "conditions": ["base"]}
    if args.config is not None:
        saved = load_suite_config(args.config).to_dict()
        base.update(data=saved["data"], eval=saved["eval"], protocol=saved["protocol"])
    if args.protocol is not None:
        base["protocol"] = args.protocol
    data = dict(base.get("data", {}))
    for task, key in (("medmcqa", "medmcqa_validation"), ("wikitext", "wikitext"), ("triviaqa", "triviaqa")):
        if getattr(args, f"{task}_path") is not None:
            data[key] = getattr(args, f"{task}_path")
    settings = dict(base.get("eval", {}))
    for key, value in (("tasks", args.tasks), ("medmcqa_examples", args.medmcqa_examples),
                       ("triviaqa_examples", args.triviaqa_examples)):
        if value is not None:
            settings[key] = value
    parsed = parse_suite_config({**base, "data": data, "eval": settings}, Path.cwd(), source="smf eval")
    return parsed.data, parsed.eval, parsed.protocol


def run(args: argparse.Namespace) -> int:
    from smf.eval.tasks import evaluate_model, load_eval_sets
    from smf.files import write_json_atomic
    from smf.model.loading import load_model
    from smf.train.distributed import pick_device

    data, settings, protocol = _eval_inputs(args)
    if args.output_dir is not None:
        output_dir = Path(args.output_dir)
    else:
        output_dir = Path(args.adapter) / "eval" if args.adapter is not None else Path("smf-eval")
    model, tokenizer = load_model(args.model, args.adapter, pick_device(args.device), backend=args.backend)
    metrics, seconds = evaluate_model(model, tokenizer, load_eval_sets(data, settings, protocol), settings,
                                      output_dir, protocol)
    summary = {"model": args.model, "adapter": args.adapter, "protocol": protocol, "metrics": metrics,
               "eval_s": seconds,
               "settings": {**dataclasses.asdict(settings), "tasks": list(settings.tasks)}}
    write_json_atomic(output_dir / "metrics.json", summary)
    print(json.dumps(metrics, indent=2))
    logger.info("metrics and per-example files written to %s", output_dir)
    return 0
