"""Run a script (argv[1:]) under ``accelerate launch --config_file docs/accelerate/fsdp2.yaml`` on CPU with FSDP2:
accelerate enables FSDP only on accelerators (its AcceleratorState leaves a CPU job MULTI_CPU, i.e. DDP), so every
Trainer's accelerator is switched to FSDP with the plugin that accelerate launch's environment describes (the
config file's fsdp_config). FSDP is set where accelerate sets it on GPUs: on the AcceleratorState and the
PartialState (each later AcceleratorState() copies the PartialState's distributed_type back). Test-only:
tests/test_hf_fsdp2.py."""
import runpy
import sys

import torch.distributed
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import Trainer

_create_accelerator = Trainer.create_accelerator_and_postprocess


def _with_fsdp2(self):
    _create_accelerator(self)
    if self.accelerator.state.distributed_type != DistributedType.MULTI_CPU:  # docs/sharding.md: why this shim
        raise RuntimeError(f"accelerate chose {self.accelerator.state.distributed_type} on CPU itself: run the "
                           "docs' command without tests/accelerate_fsdp2_cpu.py")
    self.accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from accelerate launch's FSDP_* env
    self.is_fsdp_enabled = True


Trainer.create_accelerator_and_postprocess = _with_fsdp2
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
# The process group ended before the interpreter exits: under load, gloo's threads torn down by exit's static
# destructors once aborted a rank after the run had finished ("terminate called without an active exception").
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
