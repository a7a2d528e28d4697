"""Training for the SMF experiments: one trainer (:func:`train`), four recipes (retrofit, sparse,
lora, full), background statistics, checkpoints with exact resume, torchrun data parallelism.

Command line: ``smf retrofit``, ``smf background``, ``smf train --recipe ...`` (:mod:`smf.cli`).
Models load through :mod:`smf.model.loading`.
"""
import warnings

from smf.errors import ConfigError
from smf.train.background import collect_background
from smf.train.config import RunConfig, build_config, read_config_file
from smf.train.loop import train

__all__ = ["ConfigError", "RunConfig", "build_config", "collect_background", "read_config_file", "train"]

_MOVED = {"load_base": "load_base", "load_trained_model": "load_run"}  # old name here -> its name in smf.model


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"smf.train.{name} is deprecated; use smf.model.{_MOVED[name]}", DeprecationWarning,
                      stacklevel=2)
        import smf.model

        return getattr(smf.model, _MOVED[name])
    raise AttributeError(f"module 'smf.train' has no attribute {name!r}")
