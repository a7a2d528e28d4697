"""The options of ``smf retrofit``, ``smf background`` and ``smf train``: :class:`RunConfig`, which holds the options
of every section of :mod:`smf.train.sections` (where each is declared, with the paper's defaults:
docs/method.md#two-stage-training), a tiny preset for CPU runs, and :func:`build_config`, which layers defaults <
``preset`` < config file < command-line flags and checks the rules of the sections a run takes
(:mod:`smf.train.rules`). Options left at None get the recipe's paper default when the run starts
(:meth:`RunConfig.resolved`); :func:`refuse_unused` refuses a flag of a section the run does not take
(:data:`smf.train.sections.STAGE_SECTIONS`)."""
from __future__ import annotations

import dataclasses
import logging
import os
import typing
import warnings
from pathlib import Path

from smf.errors import ConfigError
from smf.options import OPTIONS_CONFIG, checked, flag, only, read_file, takes
from smf.train.rules import adapter_mode, check_run
from smf.train.sections import SECTION_OF, SECTIONS, STAGE_SECTIONS, section_users
from smf.vocabulary import (DEPRECATED_SPELLINGS, RECIPE_KINDS, TINY_MEMORY_KWARGS, TINY_MEMORY_LAYERS, TINY_MODEL,
                            TRAIN_RECIPES, UPDATE_KINDS)

logger = logging.getLogger(__name__)

# Paper defaults of the options a recipe leaves at None (docs/method.md#two-stage-training; background: see n_examples).
RECIPE_LR = {"retrofit": 5e-4, "sparse": 5e-4, "lora": 2e-4, "full": 5e-5}
RECIPE_DEFAULTS = {"retrofit": {"mode": "additive", "lr": RECIPE_LR["retrofit"], "epochs": 2, "n_examples": 50_000},
                   "background": {"n_examples": 50_000},
                   **{recipe: {"lr": RECIPE_LR[recipe], "epochs": 3, "n_examples": 60_000} for recipe in TRAIN_RECIPES}}
# The command that runs each stage, the ``recipe`` of a resolved RunConfig.
STAGE_COMMANDS = {"retrofit": "retrofit", "background": "background", **dict.fromkeys(TRAIN_RECIPES, "train")}
CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # shipped configs and the tiny preset (package data)

# The order of the options in run_config.json and --help, as written before they were grouped into sections (so
# that runs write the same files); an option added since follows them, in section order.
RECORDED_ORDER = (
    "output_dir", "preset", "model", "recipe", "mode", "layers", "n_keys", "heads", "topk", "key_dim", "alpha_init",
    "backend", "adapter", "background", "rule", "rows_per_step", "update", "row_optimizer", "count_reads",
    "shard_memories", "fsdp", "lora_r", "lora_alpha", "lora_dropout", "protocol", "oasst_path", "oasst_languages",
    "medmcqa_path", "retrofit_data", "background_data", "train_data", "loss_on", "n_examples", "n_background",
    "batch_size", "data_seed", "max_length", "epochs", "lr", "alpha_lr", "weight_decay", "warmup_steps",
    "global_batch_size", "micro_batch_size", "max_grad_norm", "seed", "bf16", "device", "threads", "compile",
    "save_every", "max_steps", "resume")
MEMORY_SIZES = ("layers", "n_keys", "heads", "topk", "key_dim")


def model_config(model: str):
    """The transformers config of base model ``model`` (:func:`smf.model.sizes.model_architecture`), or a
    ConfigError saying which options to give instead."""
    from smf.model.sizes import model_architecture

    try:
        return model_architecture(model)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {model!r}: cannot read its config to scale the memory sizes to it ({err}); give "
                          "--layers, --n-keys, --heads, --topk and --key-dim") from None


class _RunConfigMethods:
    """The methods of :class:`RunConfig` (whose fields are its sections' options)."""

    def __post_init__(self) -> None:
        self.layers = None if self.layers is None else list(self.layers)

    def resolved(self, recipe: str) -> "RunConfig":
        """A copy with ``recipe`` set and the recipe's paper defaults filled in where options are None."""
        defaults = {name: value for name, value in RECIPE_DEFAULTS[recipe].items() if getattr(self, name) is None}
        if self.own_data(recipe):  # own files are used whole unless --n-examples cuts them
            defaults.pop("n_examples", None)
        if recipe == "retrofit" and any(getattr(self, name) is None for name in MEMORY_SIZES):
            defaults.update(self._scaled_sizes())
        return dataclasses.replace(self, recipe=recipe, **defaults)

    def _scaled_sizes(self) -> dict:
        """The memory sizes left at None, scaled to the model (:mod:`smf.model.sizes`); topk by the rule for a
        given n_keys."""
        from smf.model.sizes import scaled_memory_sizes

        scaled = scaled_memory_sizes(model_config(self.model))
        scaled["layers"] = list(scaled["layers"])
        if self.topk is None and self.n_keys is not None:
            scaled["topk"] = max(1, min(scaled["topk"], self.n_keys // 2))
        return {name: scaled[name] for name in MEMORY_SIZES if getattr(self, name) is None}

    def own_data(self, recipe: str | None = None) -> bool:
        """Whether stage ``recipe`` (default: this config's) reads a user's own files (docs/own-data.md)."""
        recipe = recipe or self.recipe
        if recipe == "retrofit":
            return self.retrofit_data is not None
        if recipe == "background":
            return self.background_data is not None
        return self.train_data is not None

    def to_dict(self) -> dict:
        """The options the run's command takes (plus ``recipe``), e.g. for run_config.json."""
        return {"recipe": self.recipe, **only(RunConfig, STAGE_COMMANDS[self.recipe], dataclasses.asdict(self))}

    def stage(self, command: str) -> str:
        """The stage a ``command`` run of this config is: its recipe for train, else the command."""
        return self.recipe if command == "train" else command

    def frozen_alpha(self, command: str) -> str | None:
        """:func:`frozen_alpha` of this config."""
        return frozen_alpha(self, command)


def _run_config_fields() -> list[tuple]:
    """(name, type, field) of every section's options, in :data:`RECORDED_ORDER` (new ones after, by section)."""
    declared = {spec.name: (spec, typing.get_type_hints(section, include_extras=True)[spec.name])
                for section in SECTIONS.values() for spec in dataclasses.fields(section)}
    order = [name for name in RECORDED_ORDER if name in declared] + [n for n in declared if n not in RECORDED_ORDER]
    return [(name, declared[name][1], dataclasses.field(default=declared[name][0].default,
                                                        metadata=declared[name][0].metadata)) for name in order]


RunConfig = dataclasses.make_dataclass(
    "RunConfig", _run_config_fields(), bases=(_RunConfigMethods,),
    namespace={"__module__": __name__, "__pydantic_config__": OPTIONS_CONFIG,  # every float finite
               "__doc__": "Options of ``smf retrofit``, ``smf background`` and ``smf train``: those of every section "
                          "of :mod:`smf.train.sections`, flat (``config.lr``), in :data:`RECORDED_ORDER`."})


OPTIONS = tuple(field.name for field in dataclasses.fields(RunConfig))
# (own-data option, the paper's dataset option it replaces): not both (docs/own-data.md).
OWN_INSTEAD_OF = (("retrofit_data", "oasst_path"), ("background_data", "oasst_path"), ("train_data", "medmcqa_path"))

# The options --update replaced (docs/method.md#migrating-from---optimizer): --optimizer row_sparse | dense_masked |
# authors is --update exact | dense_masked | authors; --sparse-backward and --fused-update are gone (one exact path,
# which fills the rows' gradient by itself: smf_kernels.sparse.updates.ExactRows).
LEGACY_UPDATE_OPTIONS = ("optimizer", "sparse_backward", "fused_update")
# An --optimizer value, in its spelling before the renames too -> the --update that replaced it.
_BY_OPTIMIZER = {kind.optimizer: kind.name for kind in UPDATE_KINDS.values()}
UPDATE_OF_OPTIMIZER = {**_BY_OPTIMIZER, **{old: _BY_OPTIMIZER[new] for old, new in DEPRECATED_SPELLINGS.items()
                                           if new in _BY_OPTIMIZER}}


def migrate_update_options(options: dict, where: str) -> dict:
    """``options`` with the keys --update replaced (:data:`LEGACY_UPDATE_OPTIONS`) mapped to ``update`` or dropped,
    with one warning naming them; an unknown ``optimizer`` value is left for the check to refuse."""
    legacy = [name for name in LEGACY_UPDATE_OPTIONS if name in options]
    if not legacy:
        return options
    migrated = {name: value for name, value in options.items() if name not in LEGACY_UPDATE_OPTIONS}
    if options.get("optimizer") is not None and "update" not in migrated:
        migrated["update"] = UPDATE_OF_OPTIMIZER.get(str(options["optimizer"]), options["optimizer"])
    message = (f"{where}: {', '.join(legacy)} {'is' if len(legacy) == 1 else 'are'} replaced by 'update' (exact, "
               "dense_masked or authors; the exact update fills the rows' gradient by itself): read as update "
               f"{migrated.get('update', 'exact')!r}")
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    logger.warning(message)
    return migrated


# The tiny preset: the tiny model and memories of smf.vocabulary and the options in smf/configs/preset_tiny.yaml.
TINY_PRESET = {"model": TINY_MODEL, "layers": list(TINY_MEMORY_LAYERS), **TINY_MEMORY_KWARGS, **{
    name: str((CONFIGS / value).resolve()) if name.endswith("_path") else value
    for name, value in read_file(CONFIGS / "preset_tiny.yaml", OPTIONS).items()}}


def checked_options(options: dict, where: str) -> dict:
    """``options`` (of RunConfig) checked and coerced to their types; ConfigError: ``{where}: option 'name': ...``."""
    config = checked(RunConfig, options, lambda name: f"{where}: option {name!r}")
    return {name: getattr(config, name) for name in options}


def read_config_file(path: str | Path, command: str) -> dict:
    """The options in a YAML or JSON file whose keys are option names (``output-dir`` or ``output_dir``), checked.
    Keys of options ``command`` does not take are skipped (one file serves every command); unknown ones: ConfigError."""
    where = f"--config {str(path)!r}"
    options = migrate_update_options(read_file(path, OPTIONS + LEGACY_UPDATE_OPTIONS), where)
    return checked_options(only(RunConfig, command, options), where)


def check_device_and_backend(device: str, backend: str | None) -> None:
    """ConfigError unless ``device`` is a device of this machine and ``backend`` runs on it; with no ``backend``
    (automatic), the one the environment variable ``SMF_KERNELS_BACKEND`` names, where set."""
    from smf.train.distributed import pick_device
    from smf_kernels.backends import ENV_VAR, unavailable_reason

    resolved = pick_device(device)
    chosen = backend if backend is not None else os.environ.get(ENV_VAR) or None  # as resolve_backend reads it
    reason = None if chosen is None else unavailable_reason(chosen, resolved)
    if reason is not None:
        source = f"--backend {backend}" if backend is not None else f"the environment variable {ENV_VAR}={chosen}"
        raise ConfigError(f"{source} cannot run on {resolved.type} (--device {device}): {reason}")


def unused_options(config: RunConfig, command: str) -> dict[str, str]:
    """The options of ``command`` that a run of ``config`` does not use, each with the reason: those of the sections
    its stage does not take (:data:`smf.train.sections.STAGE_SECTIONS`), and those its sections' rules name."""
    stage, unused = config.stage(command), {}
    for name in takes(RunConfig, command):
        section = SECTION_OF[name]
        if section not in STAGE_SECTIONS[stage]:
            users = " or ".join(f"--recipe {user}" for user in section_users(section, command))
            unused[name] = f"only {users} uses it (this run is --recipe {config.recipe})"
    for section in STAGE_SECTIONS[stage]:
        unused.update({name: why for name, why in SECTIONS[section].unused(config, command).items()
                       if name in takes(RunConfig, command)})
    return unused


def frozen_alpha(config: RunConfig, command: str) -> str | None:
    """Why a ``command`` run of ``config`` trains no alpha (so that --alpha-lr has nothing to set), or None when
    it trains one: a retrofit in an additive mode, --recipe sparse in mode additive+s, --recipe full from an adapter
    with an alpha. Reads the adapter's config (a small JSON file) when the mode is the adapter's."""
    if command == "retrofit":
        return "--mode replacement has no alpha (the memory replaces the MLP)" if config.mode == "replacement" else None
    kind = RECIPE_KINDS[config.recipe]
    if not kind.trains_memories or (kind.memories == "adapter if given" and config.adapter is None):
        return f"--recipe {config.recipe} trains no memory, so no alpha"
    saved = adapter_mode(config.adapter)
    mode = (config.mode or saved) if kind.sparse_step else saved  # --mode: the sparse step's
    if mode == "replacement":
        return "the adapter's memories are in mode replacement, which has no alpha"
    if kind.sparse_step and mode != "additive+s":
        return (f"--recipe {config.recipe} in mode {mode} keeps alpha frozen (mode additive+s trains it: --mode "
                "additive+s)")
    return None


def refuse_unused(config: RunConfig, command: str, cli_options: dict, file_options: dict) -> None:
    """ConfigError for a command-line flag the run would ignore (whatever its value: ``--recipe lora --update exact``
    too), with the reason; a logged warning for such a key of a config file given a value other than its default
    (one file may serve several commands and recipes)."""
    defaults = {field.name: field.default for field in dataclasses.fields(RunConfig)}
    for name, why in unused_options(config, command).items():
        if name in cli_options:
            raise ConfigError(f"{flag(name)} is not used by this run: {why}; drop it")
        if name in file_options and file_options[name] != defaults[name]:
            logger.warning("--config: %s %r is not used by this run: %s", name, file_options[name], why)


def build_config(command: str, file_options: dict, cli_options: dict) -> RunConfig:
    """Defaults < preset (from file or flags) < file options < command-line options, checked (ConfigError): each value
    by its type (choices, bounds, existing paths), then by the rules of the sections ``command``'s stage takes
    (:func:`smf.train.rules.check_run` without the world: combinations, the model directory, what the stage needs),
    and that the device exists and the backend runs on it."""
    preset = cli_options.get("preset", file_options.get("preset"))
    options = {**(only(RunConfig, command, TINY_PRESET) if preset == "tiny" else {}), **file_options, **cli_options}
    given = {**file_options, **cli_options}
    for own, paper in OWN_INSTEAD_OF:
        if given.get(own) is not None and given.get(paper) is not None:
            raise ConfigError(f"{flag(own)} and {flag(paper)} cannot both be given: own data replaces the paper's "
                              "dataset (docs/own-data.md)")
        if options.get(own) is not None:
            options.pop(paper, None)  # the preset's paper data gives way to the user's own
    config = checked(RunConfig, options)
    check_run(config, command)
    check_device_and_backend(config.device, config.backend)
    return config
