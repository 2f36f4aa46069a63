"""DeepSpeed ZeRO-2 / ZeRO-3 through accelerate: what flowrl adds around ``accelerator.prepare``.

accelerate hands the trained module and its AdamW to DeepSpeed's engine when launched with
``configs/accelerate/deepspeed_zero2.yaml`` or ``deepspeed_zero3.yaml``. Three things in flowrl's loop do not fit
accelerate's DeepSpeed defaults, and this module bridges them (docs/distributed.md, "DeepSpeed"):

* **One optimizer step per minibatch, several backward passes.** flowrl calls ``backward()`` once per trained
  denoising step (GRPO's per-step losses keep one step's activations alive at a time). accelerate's
  ``backward()`` under DeepSpeed also calls ``engine.step()``, which steps the optimizer at every gradient
  accumulation boundary, and divides the loss by the accumulation count. flowrl instead drives the engine
  itself: ``engine.backward(loss, scale_wrt_gas=False)`` for every loss (already scaled by the objective), the
  accumulation boundary set on the last one only (``set_gradient_accumulation_boundary``, DeepSpeed's API for
  client-controlled accumulation), then one ``engine.step()``. Knowing which loss is last needs one loss of
  look-ahead: the previous loss is back-propagated only once the next one exists, so two steps' activations
  are alive at the peak instead of one (the price of DeepSpeed's boundary flag, paid only under DeepSpeed).
* **The config values accelerate fills from a dataloader** (flowrl has none): the micro batch is
  ``train.batch_size`` per process, accumulation 1 (flowrl marks its own boundary), and gradient clipping is
  ``train.max_grad_norm`` (DeepSpeed clips inside its step; the launch config's value is replaced).
* **CPU processes.** accelerate turns DeepSpeed on only when it is not told ``cpu=True``; on a machine without
  a GPU flowrl lets it (``cpu=False`` there is still the CPU) and selects DeepSpeed's CPU accelerator
  (``DS_ACCELERATOR=cpu``, gloo), so the CPU test runs DeepSpeed's own ZeRO code.

Checkpoints: every process takes part; the main process writes the full weights in flowrl's format (ZeRO-3's
partitioned parameters gathered with ``GatheredParameters``), so ``flowrl export`` is unchanged, and beside
them DeepSpeed's own engine checkpoint (``deepspeed/``: the partitioned fp32 master weights and AdamW
moments, one file per process) from which a DeepSpeed run resumes with the same number of processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import FlowRLError

ENGINE_DIR = "deepspeed"  # the engine checkpoints inside a flowrl checkpoint directory, one tag per role


def engine_tag(role: str) -> str:
    """The directory of a role's engine state under deepspeed/: "engine" for the policy (as before roles), else its name."""
    return "engine" if role == "policy" else role


def is_deepspeed_launch() -> bool:
    """``accelerate launch`` with a DeepSpeed config sets this before the process starts."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def prepare_cpu_processes() -> bool:
    """A DeepSpeed launch on a machine without a GPU: select DeepSpeed's CPU accelerator before accelerate imports
    DeepSpeed. Returns whether accelerate must be built with ``cpu=False`` for it to turn DeepSpeed on."""
    if not is_deepspeed_launch() or torch.cuda.is_available():
        return False
    try:
        import deepspeed  # noqa: F401  (only to refuse a missing install in one sentence)
    except ImportError:
        raise FlowRLError("this is a DeepSpeed launch but deepspeed is not installed; pip install 'flowrl[deepspeed]'.") from None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return True


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def load_models_whole() -> None:
    """accelerate registers its DeepSpeed config with transformers for every launch, so under ZeRO-3 each later
    ``from_pretrained`` would build its model partitioned (``zero.Init``), the frozen text encoder and reward models
    included, which no engine then gathers. flowrl loads every model whole and lets the engine partition only the
    trained module at ``prepare`` (the ZeRO-3 config's ``zero3_init_flag: false``): unregister it."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def configure(accelerator, micro_batch: int, max_grad_norm: float | None) -> None:
    """Fill in what accelerate would take from a dataloader, and flowrl's own boundary and clipping."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["gradient_accumulation_steps"] = 1  # flowrl marks the one boundary of a minibatch itself
    config["train_batch_size"] = micro_batch * accelerator.num_processes
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    config.setdefault("steps_per_print", 10**9)  # DeepSpeed's own periodic log lines: flowrl logs the run
    config.setdefault("zero_allow_untested_optimizer", True)  # the client AdamW is torch's: ZeRO wraps it as any


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())


def backward_roles(engines: dict, losses: Iterable, on_loss: Callable) -> set[str]:
    """Back-propagate every loss of one minibatch, each through the engine of its role (``engines``: role -> engine;
    a loss for a role without an engine, a module every process keeps whole, through plain autograd), with each
    engine's accumulation boundary on its last loss, then one step of every engine that received a loss; returns the
    roles that received one. ``on_loss(loss_output)`` sees each loss (its metrics)."""
    pending: dict[str, Any] = {}  # role -> its latest loss, back-propagated once the next one (or the end) shows it was not the last
    hit: set[str] = set()
    for loss_out in losses:
        on_loss(loss_out)
        if not loss_out.loss.requires_grad:  # no trained weight shaped it (a frozen Wan2.2 expert's step): nothing to do
            continue
        hit.add(loss_out.role)
        engine = engines.get(loss_out.role)
        if engine is None:
            loss_out.loss.backward()
            continue
        if loss_out.role in pending:
            engine.set_gradient_accumulation_boundary(False)
            engine.backward(pending[loss_out.role].loss, scale_wrt_gas=False)
        pending[loss_out.role] = loss_out
    for role, loss_out in pending.items():
        engine = engines[role]
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss_out.loss, scale_wrt_gas=False)
        engine.step()
    return hit


def grad_norm(engine) -> torch.Tensor | None:
    """The global gradient norm DeepSpeed computed in its last step (before clipping), as clip_grad_norm_ returns."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else torch.as_tensor(float(norm))


@contextlib.contextmanager
def full_parameters(engine) -> Iterator[None]:
    """ZeRO-3 keeps each process's partition only: gather the whole parameters for the duration (collective);
    ZeRO-1/2 parameters are whole already."""
    if zero_stage(engine) < 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        yield


def full_weights(engine, state_dict: Callable[[], dict[str, torch.Tensor]], keep: bool) -> dict[str, torch.Tensor]:
    """``state_dict()`` of the whole parameters, copied to the CPU on the process that writes (collective)."""
    with full_parameters(engine):
        weights = state_dict()
        return {k: v.detach().cpu().clone() for k, v in weights.items()} if keep else {}


def save_engine_state(engine, staging: Path, tag: str) -> None:
    """Every process writes its partition of DeepSpeed's state (fp32 master weights, AdamW moments) into
    ``staging/<tag>``; the main process then moves it into the checkpoint it writes (``move_into``)."""
    engine.save_checkpoint(str(staging), tag=tag, save_latest=False)


def move_into(staging: Path, checkpoint_tmp: Path) -> None:
    shutil.move(str(staging), str(checkpoint_tmp / ENGINE_DIR))


def load_engine_state(engine, checkpoint: Path, tag: str) -> None:
    """Resume the engine from the checkpoint's ``deepspeed/<tag>`` (same number of processes, same ZeRO stage)."""
    directory = Path(checkpoint) / ENGINE_DIR
    if not (directory / tag).is_dir():
        raise FlowRLError(
            f"checkpoint '{checkpoint}' holds no DeepSpeed engine state (it was not written by a DeepSpeed run), "
            "so this DeepSpeed run cannot resume its optimizer from it; resume it with the launch that wrote it."
        )
    path, _ = engine.load_checkpoint(
        str(directory), tag=tag, load_module_strict=True, load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise FlowRLError(
            f"DeepSpeed could not load the engine state in '{directory}' (written with another number of processes or ZeRO stage?)."
        )
