"""Model FLOPs of a run, counted per denoiser call, and what they make of the iteration's time: achieved FLOP/s and,
against a peak FLOP/s, the model FLOPs utilisation (MFU). docs/throughput.md says what is counted and why.

The one seam is :class:`ModelFlops`: forward hooks on the run's models (the policy's module and what wraps it, every
other trained role's module, the frozen models a run reads: a reference copy, an objective's own teacher). A call is
one forward of the outermost hooked module; its FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode``
(matmuls, convolutions and attention, as torch counts them: 2 FLOPs per multiply-accumulate) on the first call of each
distinct input signature (the tensors' shapes and dtypes, the flags), then read from a cache: counting costs one
dispatch-mode pass per shape, never one per call. A call whose output then receives a gradient adds 2 x its forward
FLOPs (backward = 2 x forward, the usual convention: the input and the weight gradients). Guidance passes are calls
like any other: classifier-free guidance's batched pair is one call of twice the rows, a detached unconditional branch
a forward without backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils import flop_counter

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) of the GPUs flowrl has a number for; matched as a substring of
# torch.cuda.get_device_name(). Anything else: None unless ``log.peak_flops`` says it (then no MFU is reported).
PEAK_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
}

MAX_COUNTED_SIGNATURES = 256  # beyond this many distinct signatures a new one is scaled from a counted one, not counted


# attention on the CPU: sdpa's CPU kernel, which torch's flop registry leaves out, counted with the registry's own sdpa
# formula (the two batched matmuls, 4 * B * H * L * S * D)
def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


_EXTRA_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop}


def count_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` and the FLOPs it did (FlopCounterMode's count, CPU attention included)."""
    with flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS) as mode:
        out = fn(*args, **kwargs)
    return out, int(mode.get_total_flops())


def peak_flops_per_s(device: torch.device | str, override: float | None = None) -> float | None:
    """The peak FLOP/s of one ``device``: ``override`` (log.peak_flops) when given, else the table's number for a known
    GPU, else None (a CPU, an unknown GPU)."""
    if override:
        return float(override)
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def _output_tensor(out: Any) -> torch.Tensor | None:
    """The tensor a call returns (diffusers: ``.sample``, transformers: ``.logits``, else the first element)."""
    if torch.is_tensor(out):
        return out
    for name in ("sample", "logits"):
        value = getattr(out, name, None)
        if torch.is_tensor(value):
            return value
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    return None


def _signature(value: Any, depth: int = 0) -> Any:
    """What decides a call's FLOPs: each tensor's shape and dtype, flags (bool / str / None) by value, numbers by type
    (a float timestep changes no FLOPs, and keying on it would count every call)."""
    if torch.is_tensor(value):
        return (tuple(value.shape), value.dtype)
    if isinstance(value, (bool, str)) or value is None:
        return value
    if callable(getattr(value, "get_seq_length", None)):  # a transformers KV cache: its length is attention's keys
        return (type(value).__name__, int(value.get_seq_length()))
    if isinstance(value, (int, float)):
        return type(value).__name__
    if depth < 3 and isinstance(value, dict):
        return tuple((k, _signature(v, depth + 1)) for k, v in value.items())
    if depth < 3 and isinstance(value, (list, tuple)):
        return tuple(_signature(v, depth + 1) for v in value)
    return type(value).__name__


def _first_numel(args: tuple, kwargs: dict) -> int:
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value):
            return value.numel()
    return 1


def _rows(args: tuple, kwargs: dict, out: Any) -> int:
    y = _output_tensor(out)
    if y is not None and y.dim():
        return y.shape[0]
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value) and value.dim():
            return value.shape[0]
    return 1


def module_chain(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and what it wraps, outermost first: DDP / DeepSpeed / accelerate's ``.module``, a torch.compile'd
    ``._orig_mod``, peft's base model (adapters calls the base model directly too)."""
    chain: list[torch.nn.Module] = []
    while isinstance(module, torch.nn.Module) and all(module is not m for m in chain):
        chain.append(module)
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            get = getattr(module, "get_base_model", None)
            inner = get() if callable(get) else None
        module = inner
    return chain


class ModelFlops:
    """Counts the forward calls of the hooked modules: calls, rows, forward FLOPs, and the backward FLOPs of the calls
    whose outputs receive a gradient. ``modules`` is read again at each ``start()`` (a reference copy made later is
    hooked then); ``start()`` zeroes the counts, ``metrics(seconds)`` is the iteration's ``perf/*``."""

    def __init__(self, modules: Callable[[], Iterable[torch.nn.Module]], device: torch.device | str, peak: float | None = None):
        self.modules, self.device = modules, torch.device(device)
        self.peak = peak_flops_per_s(self.device, peak)
        self.cache: dict[Any, int] = {}  # (module id, signature) -> the forward FLOPs of one call
        self._hooked: dict[int, tuple[torch.nn.Module, list[Any]]] = {}
        self._depth = 0  # > 0 inside a hooked call: a hooked module called by another is part of that call
        self._counting: Any = None  # the FlopCounterMode of the call being counted
        self._last_counted: dict[int, tuple[int, int]] = {}  # module id -> (numel of its first input, FLOPs)
        self.counted_signatures = 0  # calls that ran under the counter (one per distinct signature)
        self.reset()
        self.attach()

    def reset(self) -> None:
        self.calls = self.forward_rows = self.backward_rows = 0
        self.forward_flops = self.backward_flops = 0

    def attach(self) -> None:
        for top in self.modules():
            for module in module_chain(top):
                if id(module) not in self._hooked:
                    handles = [
                        module.register_forward_pre_hook(self._before, with_kwargs=True),
                        module.register_forward_hook(self._after, with_kwargs=True, always_call=True),
                    ]
                    self._hooked[id(module)] = (module, handles)

    def close(self) -> None:
        for _, handles in self._hooked.values():
            for handle in handles:
                handle.remove()
        self._hooked.clear()

    def start(self) -> None:
        """A new iteration: hook what is new, zero the counts."""
        self.attach()
        self.reset()

    # -- the hooks -------------------------------------------------------------------------------------------------
    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        key = (id(module), _signature(args), _signature(kwargs))
        self._key = key
        if key not in self.cache and len(self.cache) < MAX_COUNTED_SIGNATURES:
            self._counting = flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
            self._counting.__enter__()
        self._numel = _first_numel(args, kwargs)

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        key, mode, self._counting = self._key, self._counting, None
        if mode is not None:
            mode.__exit__(None, None, None)
            self.cache[key] = int(mode.get_total_flops())
            self.counted_signatures += 1
            self._last_counted[id(module)] = (self._numel, self.cache[key])
        if out is None:  # the call raised (the hook runs anyway, to leave the counter)
            return
        flops = self.cache.get(key)
        if flops is None:  # past the cap: the module's last counted call, scaled by the first input's size
            numel, counted = self._last_counted.get(id(module), (1, 0))
            flops = round(counted * self._numel / max(numel, 1))
        self.calls += 1
        rows = _rows(args, kwargs, out)
        self.forward_rows += rows
        self.forward_flops += flops
        y = _output_tensor(out)
        if y is not None and y.requires_grad:
            y.register_hook(lambda grad, flops=flops, rows=rows: self._backward(flops, rows))

    def _backward(self, flops: int, rows: int) -> None:
        self.backward_rows += rows
        self.backward_flops += 2 * flops

    # -- what an iteration reports -----------------------------------------------------------------------------------
    @property
    def flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def counts(self) -> dict[str, int]:
        return {
            "perf/model_flops": self.flops,
            "perf/model_flops_forward": self.forward_flops,
            "perf/model_flops_backward": self.backward_flops,
            "perf/model_calls": self.calls,
            "perf/model_forward_rows": self.forward_rows,
            "perf/model_backward_rows": self.backward_rows,
        }

    def metrics(self, seconds: float, world: int = 1) -> dict[str, float]:
        """The iteration's counts summed over the ``world`` processes, its achieved FLOP/s over ``seconds`` (the
        iteration's wall time), and its MFU when a peak is known (per device: the run's FLOP/s over world x peak)."""
        counts = self.counts()
        if world > 1:
            from accelerate.utils import gather_object

            gathered = gather_object([counts])
            counts = {k: sum(c[k] for c in gathered) for k in counts}
        out: dict[str, float] = {**counts, "perf/iteration_s": seconds}
        out["perf/achieved_flops_per_s"] = counts["perf/model_flops"] / seconds if seconds > 0 else float("nan")
        if self.peak:
            out["perf/mfu"] = out["perf/achieved_flops_per_s"] / (world * self.peak)
        return out


def run_modules(roles: Any, pipeline: Any, objective: Any) -> list[torch.nn.Module]:
    """The models a run's FLOPs are counted on: every trained role's module (the policy first), a pipeline's frozen
    reference copy (full fine-tuning with a KL reference), an objective's own frozen modules (``FrozenRole.attribute``)."""
    modules = [role.module for role in roles.trained]
    reference = getattr(pipeline, "_reference", None)
    if isinstance(reference, torch.nn.Module):
        modules.append(reference)
    for role in roles.frozen:
        attribute = getattr(role, "attribute", None)
        module = getattr(objective, attribute, None) if attribute else None
        if isinstance(module, torch.nn.Module):
            modules.append(module)
    return modules


def throughput_summary(records: list[dict[str, Any]], device: str, peak: float | None, world: int = 1) -> dict[str, Any]:
    """summary.json's ``throughput``: the logged iterations' model FLOPs and seconds, their ratio, the MFU (None
    without a peak)."""
    rows = [r for r in records if r.get("perf/model_flops") is not None and r.get("perf/iteration_s") is not None]
    flops = sum(int(r["perf/model_flops"]) for r in rows)
    seconds = sum(float(r["perf/iteration_s"]) for r in rows)
    achieved = flops / seconds if seconds > 0 else None
    return {
        "iterations": len(rows),
        "model_flops": flops,
        "model_flops_forward": sum(int(r.get("perf/model_flops_forward", 0)) for r in rows),
        "model_flops_backward": sum(int(r.get("perf/model_flops_backward", 0)) for r in rows),
        "model_calls": sum(int(r.get("perf/model_calls", 0)) for r in rows),
        "iteration_seconds": round(seconds, 3),
        "achieved_flops_per_s": achieved,
        "device": device,
        "processes": world,
        "peak_flops_per_s": peak,
        "mfu": achieved / (world * peak) if achieved is not None and peak else None,
    }


__all__ = [
    "PEAK_FLOPS",
    "ModelFlops",
    "count_flops",
    "device_name",
    "module_chain",
    "peak_flops_per_s",
    "run_modules",
    "throughput_summary",
]
