"""Sharded training (FSDP2 through accelerate's plugin): what flowrl adds around ``accelerator.prepare``.

accelerate shards the trained module (the denoiser or the language model) when launched with an FSDP config
(``configs/accelerate/fsdp.yaml``); everything frozen (text encoders, VAE, reward models, the KL reference copy
taken before ``prepare``) is never handed to it. flowrl adds (docs/distributed.md):

* which blocks become FSDP units, per family: the model class's own ``_no_split_modules`` (diffusers and
  transformers list their transformer/UNet blocks there: ``FluxTransformerBlock``, ``JointTransformerBlock``,
  ``WanTransformerBlock``, ...), kept to those present in the model, unless the config names them;
* CPU processes: accelerate 1.15 turns an FSDP config on only for GPU-like devices and silently runs plain
  data parallelism on CPUs; torch's ``fully_shard`` runs on CPU over gloo, so flowrl turns it on (the CPU test
  then exercises accelerate's own FSDP2 code path, not a copy of it);
* checkpoints hold full tensors: every rank takes part in gathering the sharded weights and AdamW state
  (``DTensor.full_tensor``), the main process writes them in the same format as an unsharded run, so
  ``flowrl export`` reads them unchanged, in one process;
* resume: full tensors are split back into this process's shards (``distribute_tensor`` with each
  parameter's mesh and placement) before they are loaded;
* a one-sentence refusal of CPU offload on CPU processes.

DeepSpeed ZeRO launches are bridged in flowrl/training/deepspeed_zero.py.

Every launch (DDP too): a run's error said once per launch (``report_error``), a failure on one process told to the
others before they would wait for it in a collective (``exchange_failures`` / ``check_peers``, with accelerate's
``gather_object``), and a failed run's processes ending together (``end_failed_run``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import torch
from torch import Tensor

from ..errors import FlowRLError

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover - older torch has no FSDP2 and nothing here is sharded
    DTensor, distribute_tensor = (), None


# How long a process other than rank 0 of a launched run waits before it says its error itself (below).
ERROR_GRACE_SECONDS = 10.0


def report_error(line: str) -> None:
    """Print a run's one-sentence error (``line``) once per launch, not once per process, and hand it to the launcher.

    One process: printed. Several (torchrun / ``accelerate launch`` set ``WORLD_SIZE`` and ``RANK``): rank 0 prints at
    once; any other process first waits ``ERROR_GRACE_SECONDS``, since a start-up error (a bad config, an output_dir
    that holds a run) strikes every process alike and the launcher ends the others as soon as rank 0 exits; only a
    process still alive then (its error was its own) prints. Under torch elastic (what ``accelerate launch`` runs),
    the printing process also writes the sentence to its ``TORCHELASTIC_ERROR_FILE``, so the launcher's failure report
    shows it as the root cause, instead of "To enable traceback see: ...".
    """
    import json
    import time

    try:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    except ValueError:
        world, rank = 1, 0
    if world > 1 and rank != 0:
        time.sleep(ERROR_GRACE_SECONDS)
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if world > 1 and error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the sentence is printed above; the launcher's report just lacks it


class PeerFailed(FlowRLError):
    """Raised on the processes of a launch that were well when another one failed (``report``: the failed one's, see
    ``exchange_failures``), so that every process leaves the iteration together and takes part in saving the last
    completed one."""

    def __init__(self, report: dict[str, Any]):
        super().__init__(report["head"])
        self.report = report


def exchange_failures(report: dict[str, Any] | None, world: int) -> dict[str, Any] | None:
    """Every process's failure report (None: this process is well), exchanged with accelerate's ``gather_object``; the
    lowest-ranked failure, or None when every process is well. A collective: a process that failed calls it where it
    caught its error (training/run.py), the others at the next point the loop checks (``check_peers``), so a failure
    on one process alone ends the iteration of all of them instead of leaving the others waiting in a collective
    the failed one never reaches. In one process (``world`` 1), nothing is exchanged."""
    from accelerate.utils import gather_object

    if world == 1:
        return report
    return next((r for r in gather_object([report]) if r is not None), None)


def check_peers(world: int) -> None:
    """Called before a collective that follows code which can fail on one process alone (a user's reward, the
    objective's prepare, the main process's own writes): if another of the ``world`` processes failed, raise
    :class:`PeerFailed` here, so that every process ends the iteration together."""
    if world > 1 and (report := exchange_failures(None, world)) is not None:
        raise PeerFailed(report)


def end_process_group() -> bool:
    """Leave the process group at the end of a launched run, every process together; True when there was one. A
    process that exits with its group alive can abort at interpreter shutdown ("terminate called without an active
    exception", a gloo thread destroyed while running), which fails the launch after the run itself finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        return True
    return False


def exit_launched_process(code: int) -> NoReturn:
    """End a launched process whose run has finished, without the interpreter's teardown. Destroying the group is
    not always enough: objects the run kept (FSDP's state, the engine) still hold the gloo group's C++ threads, and
    when the interpreter frees them at exit a thread can be destroyed while running, so the process aborts (SIGABRT,
    "terminate called without an active exception") after its work was written and the launch fails. Everything the
    run writes is closed by then (trackers, checkpoints, summary.json, the lock), so only the streams are flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_failed_run(line: str, is_main: bool, together: bool) -> int:
    """End a process of a run that failed (training/failure.py), with exit status 2. ``together``: every process agreed
    on the failure and saved with the others; then the main process prints the sentence (``line``), once for the
    launch, and every process leaves the group together, after the sentence is out. The others wait before they exit,
    so that the main process exits first and the launcher's report names it, with the sentence, as the root cause;
    the launcher ends them then. Not together (another process was gone): each says it as report_error does."""
    import time

    if is_main or not together:
        report_error(line)
    if together and end_process_group():
        if not is_main:
            time.sleep(ERROR_GRACE_SECONDS)
        exit_launched_process(2)
    return 2


def enable_fsdp_on_cpu(accelerator) -> None:
    """An FSDP launch of CPU processes: hand accelerate's state the FSDP plugin its CPU branch leaves out."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if wants_fsdp and state.distributed_type == DistributedType.MULTI_CPU:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables accelerate launch set from the config
        if plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":
            raise FlowRLError(
                "fsdp_offload_params moves the shards from the GPUs to CPU RAM, but these processes run on the CPU; "
                "launch with configs/accelerate/fsdp.yaml."
            )
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        # AcceleratorState() copies PartialState's fields each time it is built (trackers, samplers build one): set both
        PartialState().distributed_type = DistributedType.FSDP


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def choose_blocks_to_wrap(accelerator, module: torch.nn.Module) -> list[str]:
    """The block classes that become FSDP units: the config's, or the family's ``_no_split_modules`` present in
    ``module`` (accelerate would refuse a listed class the model lacks, e.g. a tiny UNet without ``UpBlock2D``)."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.transformer_cls_names_to_wrap:
        return list(plugin.transformer_cls_names_to_wrap)
    present = {type(m).__name__ for m in module.modules()}
    listed = list(getattr(module, "_no_split_modules", None) or [])
    chosen = [name for name in listed if name in present]
    plugin.transformer_cls_names_to_wrap = chosen
    return chosen


def full_tensors(state: dict[str, Any], keep: bool = True) -> dict[str, Any]:
    """``state`` with every sharded tensor gathered whole (on the CPU). A collective under FSDP: every process
    must call it, in the same order. ``keep=False`` (the processes that do not write): each gathered tensor is
    dropped at once, so they never hold the whole model, and an empty dict comes back."""
    out = {}
    for k, v in state.items():
        full = v.full_tensor().cpu() if isinstance(v, DTensor) else v
        if keep:
            out[k] = full
    return out


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool = True) -> dict[str, Any]:
    """The optimizer's state_dict with its per-parameter tensors (AdamW's moments) gathered whole; collective."""
    state = optimizer.state_dict()
    return {**state, "state": {idx: full_tensors(s, keep) for idx, s in state["state"].items()}}


def shard_like(current: Tensor, full: Tensor) -> Tensor:
    """``full`` split as ``current`` is (this process's shard of it); unchanged where ``current`` is not sharded
    or the shapes differ (a scalar such as AdamW's step)."""
    if isinstance(current, DTensor) and tuple(full.shape) == tuple(current.shape):
        return distribute_tensor(full.to(current.device, current.dtype), current.device_mesh, current.placements)
    return full


def shard_state_dict(current: dict[str, Tensor], full: dict[str, Tensor]) -> dict[str, Tensor]:
    """A full state dict turned into this process's shards, key by key, after ``current`` (the module's own)."""
    return {k: shard_like(current[k], v) if k in current else v for k, v in full.items()}


def shard_optimizer_tensors(optimizer: torch.optim.Optimizer, state: dict[int, dict[str, Tensor]]) -> dict[int, dict[str, Tensor]]:
    """Full per-parameter optimizer tensors (keyed by parameter index) split after their parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {idx: {name: shard_like(params[idx], v) for name, v in s.items()} for idx, s in state.items()}
