"""Training for the SMF experiments: one trainer (:func:`train`), four recipes (retrofit, sparse,
lora, full), background statistics, checkpoints with exact resume, torchrun data parallelism.

Command line: ``smf retrofit``, ``smf background``, ``smf train --recipe ...`` (:mod:`smf.cli`).
"""
from smf.train.artifacts import load_base, load_trained_model
from smf.train.background import collect_background
from smf.errors import ConfigError
from smf.train.config import RunConfig, build_config, read_config_file
from smf.train.loop import train

__all__ = ["ConfigError", "RunConfig", "build_config", "collect_background", "load_base", "load_trained_model",
           "read_config_file", "train"]
