"""Training for the SMF experiments: one trainer (:func:`train`), four recipes (retrofit, sparse,
lora, full), background statistics, checkpoints with exact resume, torchrun data parallelism.

Command line: ``smf retrofit``, ``smf background``, ``smf train --recipe ...`` (:mod:`smf.cli`).
Models load through :mod:`smf.model.loading`. Names are imported from their modules on first use
(:mod:`smf._lazy`).
"""
import warnings

from smf._lazy import lazy_exports
from smf.errors import ConfigError

_EXPORTS = {"collect_background": "background", "RunConfig": "config", "build_config": "config",
            "read_config_file": "config", "train": "loop"}
_exported, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted({"ConfigError", *_EXPORTS})

_MOVED = {"load_base": "load_base", "load_trained_model": "load_run"}  # old name here -> its name in smf.model


def __getattr__(name: str):
    if name in _MOVED:
        warnings.warn(f"smf.train.{name} is deprecated; use smf.model.{_MOVED[name]}", DeprecationWarning,
                      stacklevel=2)
        import smf.model  # torch: this package's namespace stays light for the command line

        return getattr(smf.model, _MOVED[name])
    return _exported(name)
