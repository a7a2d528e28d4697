"""``--fsdp``: the base model under FSDP2 (``torch.distributed.fsdp.fully_shard``), the memories left out of it
(docs/sharding.md#the-base-model-under-fsdp2).

- :func:`shard_base_model` wraps every decoder layer (the classes a transformers model names in
  ``_no_split_modules``), the input embeddings (unless tied to the output head, which then shares the root's
  group) and the model with ``fully_shard`` over all processes. Every memory parameter (the memory modules
  and ``alpha``) is passed as ``ignored_params``: it stays a plain tensor, replicated (or column-sharded by
  ``--shard-memories``), so the row selection, the row-sparse update and its exactness are those of DDP.
- :func:`parallelize_fsdp` applies it (in :func:`smf.train.parallel.parallelize`, before the optimizer is built)
  and says how it takes part in a step
  (:class:`~smf.train.distributed.Parallelism`): FSDP reduce-scatters (averages) the gradients of the parameters
  it shards; the trainable parameters it leaves alone are averaged after the step's last backward, as DDP would,
  unless the step reduces them itself (the controller's value rows, a column shard's values). Clipping then
  takes the norm of every gradient, FSDP's shards included (a shard's squared norm is summed over the ranks).
- Checkpoints are consolidated: :func:`consolidated` lets rank 0 see the whole tensors of the sharded
  parameters and their optimizer state, so ``checkpoint.pt`` and ``final/`` are those a single process
  writes; :func:`local_part` and :func:`shard_optimizer_state` give each rank its part back on resume.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from smf.errors import ConfigError
from smf.model import memory_blocks
from smf.train.distributed import Parallelism, World
from smf_kernels.fsdp import average_gradients

logger = logging.getLogger(__name__)


def memory_parameters(model: nn.Module) -> set[nn.Parameter]:
    """Every parameter of the memory blocks' memories and their ``alpha``: what FSDP must leave alone."""
    params = set()
    for block in memory_blocks(model):
        params.update(block.memory.parameters())
        if block.alpha is not None:
            params.add(block.alpha)
    return params


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` whose class a transformers model (also inside a peft wrapper) names in its
    ``_no_split_modules``: its decoder layers. ConfigError when there are none."""
    classes = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or ())}
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    if not layers:
        raise ConfigError(f"--fsdp: {type(model).__name__} names no decoder-layer class (_no_split_modules) to shard")
    return layers


def shard_base_model(model: nn.Module, world: World) -> None:
    """``fully_shard`` the decoder layers, the untied input embeddings and ``model`` over all ``world`` processes,
    the memories left out (see the module docstring); the optimizer is built afterwards, on the sharded
    parameters that replace the model's (:func:`smf.train.parallel.parallelize`). Collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    ignored = memory_parameters(model)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    embeddings = model.get_input_embeddings()
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embeddings.weight
    if not tied:
        fully_shard(embeddings, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    logger.info("--fsdp: %d decoder layers%s and the rest of the base model sharded over %d processes; %d memory "
                "parameters left out", len(layers), "" if tied else ", the embeddings", world.size, len(ignored))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters FSDP's gradients (off for all but a step's last micro-batch)."""
    model.set_requires_gradient_sync(enabled)


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, last: bool) -> Iterator[None]:
    """One micro-batch's forward and backward: FSDP reduce-scatters its gradients at the step's ``last`` only."""
    set_gradient_sync(model, last)
    yield


def parallelize_fsdp(model: nn.Module, world: World, kept_out: list[str]) -> Parallelism:
    """:func:`shard_base_model`, and how it takes part in a step: FSDP reduce-scatters (averages) the gradients
    of the parameters it shards once per step (at its last micro-batch); the trainable parameters it leaves alone
    are averaged over the processes after the last backward (one all_reduce), as DDP would, except those named
    in ``kept_out`` (reduced by the sparse step or by the sharded read itself). Collective."""
    shard_base_model(model, world)
    replicated = [p for name, p in model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)
                  and name not in kept_out]
    return Parallelism(micro_batch=lambda last: _gradient_sync(model, last),
                       reduce_gradients=lambda: average_gradients(replicated), sharded=True)


def local_part_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole of DTensor ``tensor`` on the CPU where ``keep``, else None (collective: every rank calls it)."""
    whole = tensor.full_tensor()
    return whole.cpu() if keep else None


@contextlib.contextmanager
def consolidated(model: nn.Module, optimizer: torch.optim.Optimizer | None, world: World,
                 trainable_only: bool = True) -> Iterator[None]:
    """Within the block, rank 0's ``model`` holds plain whole (CPU) tensors in place of its FSDP-sharded
    parameters (the trainable ones, or all of them), and ``optimizer`` the whole state of those parameters; the
    other ranks are unchanged. Collective: every rank enters it. Everything is put back afterwards."""
    keep = world.is_main
    swapped_params: list[tuple[nn.Module, str, nn.Parameter]] = []
    swapped_state: list[tuple[nn.Parameter, dict]] = []
    try:
        whole: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if not isinstance(param, DTensor) or (trainable_only and not param.requires_grad):
                    continue
                if id(param) not in whole:  # a tied parameter is gathered once and stays tied
                    full = _full(param.detach(), keep)
                    whole[id(param)] = None if full is None else nn.Parameter(full, requires_grad=param.requires_grad)
                if keep:
                    module._parameters[name] = whole[id(param)]
                    swapped_params.append((module, name, param))
        if optimizer is not None:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    state = optimizer.state.get(param)
                    if not isinstance(param, DTensor) or not state:
                        continue
                    full = {key: _full(value, keep) if isinstance(value, DTensor) else value
                            for key, value in state.items()}
                    if keep:
                        swapped_state.append((param, state))
                        optimizer.state[param] = full
        yield
    finally:
        for module, name, param in swapped_params:
            module._parameters[name] = param
        for param, state in swapped_state:
            optimizer.state[param] = state


def local_part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (a checkpoint's whole tensor) as DTensor ``like`` holds it; ``whole`` itself
    when ``like`` is a plain tensor."""
    if not isinstance(like, DTensor):
        return whole
    return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of a consolidated state: the state of each DTensor parameter that
    loaded as a whole plain tensor of its shape becomes a DTensor laid out like the parameter."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    state[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                   src_data_rank=None)
