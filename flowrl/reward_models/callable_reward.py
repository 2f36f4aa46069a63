"""A user's reward, as flowrl's :class:`~flowrl.types.Reward`: any callable ``fn(samples, prompts, metadata)``.

A reward from outside flowrl (an import path in the config, an installed package's entry point, an object given
to ``flowrl.Trainer(reward=...)`` or ``flowrl.register_reward``) may return scores in any of the usual forms: a
torch tensor, a numpy array or a list of numbers (one per sample), or a full :class:`RewardOutput`. It may set
``differentiable`` (default False) and ``required_metadata`` like flowrl's own rewards. Wrapped in
:class:`CallableReward`, its answer is checked on every call, so a wrong shape or a non-number is one sentence
naming the reward, not a broadcasting error three functions later; and :func:`probe` calls it once on a small
batch shaped like the model's samples before any model loads, so a reward that cannot score them stops the run
before minutes of loading.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput


def check_call_signature(fn: Any, name: str) -> None:
    """Refuse, in one sentence, a callable that cannot be called as ``fn(samples, prompts, metadata)``."""
    if not callable(fn):
        raise FlowRLError(f"reward '{name}' is a {type(fn).__name__}, not a callable fn(samples, prompts, metadata).")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check before calling it
    try:
        signature.bind(None, None, None)
    except TypeError as e:
        raise FlowRLError(
            f"reward '{name}' cannot be called as fn(samples, prompts, metadata): its signature is {signature} ({e})."
        ) from None


def as_scores(out: Any, batch: int, name: str, device: torch.device) -> RewardOutput:
    """A user's answer as a :class:`RewardOutput` with ``scores`` of shape (batch,) (the autograd graph of a
    differentiable reward is kept); anything else is one sentence naming the reward and what came back."""
    extras: dict[str, Tensor] = {}
    if isinstance(out, RewardOutput):
        out, extras = out.scores, dict(out.extras)
    if isinstance(out, (list, tuple)) or isinstance(out, np.ndarray) or np.isscalar(out):
        _refuse_text(out, name)
        try:
            out = torch.as_tensor(np.asarray(out, dtype=np.float64), dtype=torch.float32)
        except (TypeError, ValueError):
            raise FlowRLError(
                f"reward '{name}' returned {_describe(out)}, which is not a list of numbers (one score per sample)."
            ) from None
    if not isinstance(out, Tensor):
        raise FlowRLError(
            f"reward '{name}' returned {_describe(out)}; it must return one score per sample (a tensor, an array or "
            f"a list of {batch} numbers) or a RewardOutput."
        )
    if not (out.is_floating_point() or out.dtype in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool)):
        raise FlowRLError(f"reward '{name}' returned a tensor of {out.dtype}, not numbers.")
    if tuple(out.shape) != (batch,):
        raise FlowRLError(
            f"reward '{name}' returned scores of shape {tuple(out.shape)} for {batch} samples; it must return one "
            f"score per sample, shape ({batch},)."
        )
    scores = out.to(device=device, dtype=torch.float32)
    for key, value in extras.items():
        if not isinstance(value, Tensor) or tuple(value.shape) != (batch,):
            raise FlowRLError(f"reward '{name}' returned an extra '{key}' that is not a tensor of shape ({batch},).")
    return RewardOutput(scores=scores, extras=extras)


def _refuse_text(out: Any, name: str) -> None:
    """numpy reads the string '0.7' as the number 0.7: a reward that answers in text (a judge's raw reply, a parse
    left undone) would be trained on silently. Text is refused, in one sentence quoting the first one."""
    text = next((v for v in np.asarray(out, dtype=object).ravel().tolist() if isinstance(v, (str, bytes))), None)
    if text is not None:
        raise FlowRLError(f"reward '{name}' returned text ({text!r}), not numbers; convert its answer to float scores, one per sample.")


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a {type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def _device_of(samples: Any) -> torch.device:
    return samples.device if isinstance(samples, Tensor) else torch.device("cpu")


class CallableReward:
    """``fn`` (a function, or an instance of a user's reward class) as a flowrl Reward named ``name``.

    ``probe``: whether the run tries it on a probe batch before loading the model (rewards a config names; an
    object handed to ``flowrl.Trainer`` is the caller's own and may keep state, so it is only checked per call)."""

    def __init__(self, fn: Any, name: str, probe: bool = True) -> None:
        check_call_signature(fn, name)
        self.inner, self.name, self.probe = fn, name, probe  # ``inner``: what walkers of the reward tree look into
        self.differentiable = bool(getattr(fn, "differentiable", False))
        self.required_metadata = tuple(getattr(fn, "required_metadata", ()))

    def __call__(self, samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        return as_scores(self.inner(samples, prompts, metadata), len(samples), self.name, _device_of(samples))

    def __repr__(self) -> str:
        return f"CallableReward({self.name!r}, {self.inner!r})"


def probe(reward: Any, samples: Any, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]], name: str) -> None:
    """Score a small batch shaped like the model's samples, before training: an exception or a malformed answer
    is one sentence naming the reward."""
    shape = tuple(samples.shape) if isinstance(samples, Tensor) else f"{len(samples)} texts"
    try:
        out = reward(samples, prompts, metadata)
    except FlowRLError as e:
        raise FlowRLError(f"reward '{name}' failed on a probe batch of {shape} before training: {str(e).rstrip('.')}.") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise FlowRLError(
            f"reward '{name}' failed on a probe batch of {shape} before training ({type(e).__name__}{': ' + first if first else ''})."
        ) from None
    as_scores(out, len(samples), name, _device_of(samples))
