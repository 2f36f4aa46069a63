"""Which processes and which device this run has: the ``Accelerator``, built once per run.

``accelerate launch`` decides the launch (one process, DDP, FSDP2, DeepSpeed; training/engine.py turns it into an
engine); ``pipeline.device`` is honoured exactly in a single process, and a DeepSpeed launch on a machine without a GPU
runs DeepSpeed's CPU accelerator over gloo (training/deepspeed_zero.py).
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from ..config import resolve_device
from ..errors import FlowRLError
from . import deepspeed_zero
from .distributed import enable_fsdp_on_cpu


def _settle_single_process_state(mixed_precision: str, device: torch.device | None) -> None:
    """accelerate keeps one state per process and refuses an Accelerator with other settings than the first one's. In
    a single process (a notebook or a script building several Trainers, the test suite) an earlier Trainer's precision
    or device must not bind a later one: when they differ, the state starts afresh (one process: no group to keep)."""
    from accelerate.state import AcceleratorState, PartialState

    if not PartialState._shared_state:
        return
    current = PartialState().device
    wanted = device if device is not None else (torch.device("cuda") if torch.cuda.is_available() else current)  # auto: accelerate's pick
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    precision = AcceleratorState._shared_state.get("_mixed_precision", mixed_precision)
    if (current.type, current.index or 0) != (wanted.type, wanted.index or 0) or precision != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=True)


def make_accelerator(config, log_with: list | None = None) -> Accelerator:
    """accelerate puts a single process on its default device (a GPU when there is one, whatever was asked);
    pipeline.device is honoured exactly, or refused in one sentence when this machine lacks that device."""
    spec = config.pipeline.device
    device = resolve_device(spec)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device is not None and device.type == "cuda" and device.index is not None and world > 1:
        raise FlowRLError(
            f"pipeline.device is '{spec}', one GPU, but {world} processes run; use pipeline.device=cuda "
            "(each process takes its own GPU) or auto."
        )
    if world == 1:
        _settle_single_process_state(config.train.mixed_precision, device)
    if world == 1 and device is not None and device.type != "cpu":
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        before = os.environ.get("ACCELERATE_TORCH_DEVICE")
        os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)  # read by accelerate when it first sets up its state
        try:
            accelerator = Accelerator(mixed_precision=config.train.mixed_precision, log_with=log_with)
        finally:
            if before is None:
                os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
            else:
                os.environ["ACCELERATE_TORCH_DEVICE"] = before
    else:
        # a DeepSpeed launch on a machine without a GPU: cpu=False (still the CPU) lets accelerate turn DeepSpeed on,
        # and gloo is named because accelerate finds no device backend there (flowrl/training/deepspeed_zero.py)
        deepspeed_on_cpu = deepspeed_zero.prepare_cpu_processes()
        accelerator = Accelerator(
            mixed_precision=config.train.mixed_precision,
            cpu=device is not None and device.type == "cpu" and not deepspeed_on_cpu,
            log_with=log_with,
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if deepspeed_on_cpu else None,
        )
    if device is not None and (accelerator.device.type, accelerator.device.index or 0) != (device.type, device.index or 0) and world == 1:
        raise FlowRLError(f"pipeline.device is '{spec}' but accelerate placed the run on '{accelerator.device}'.")
    enable_fsdp_on_cpu(accelerator)  # an FSDP launch of CPU processes shards as it would on GPUs
    if deepspeed_zero.is_deepspeed(accelerator):
        deepspeed_zero.load_models_whole()  # before any model is loaded: only the trained modules are partitioned, at prepare
    return accelerator
