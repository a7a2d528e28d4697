"""Training for the SMF experiments: one trainer (:func:`train`), four recipes (retrofit, sparse,
lora, full), background statistics, checkpoints with exact resume, torchrun data parallelism.

Command line: ``smf retrofit``, ``smf background``, ``smf train --recipe ...`` (:mod:`smf.cli`).
Models load through :mod:`smf.model.loading`. Names are imported from their modules on first use
(:mod:`smf._lazy`).
"""
from smf._lazy import lazy_exports
from smf.errors import ConfigError

_EXPORTS = {"collect_background": "background", "RunConfig": "config", "build_config": "config",
            "read_config_file": "config", "train": "loop"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted({"ConfigError", *_EXPORTS})
