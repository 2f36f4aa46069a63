"""The one Gaussian transition log-density every stochastic sampler uses, and the two helpers every sampler's
``step`` shares: reading sigma (a scalar, or one per sample) and finishing a step (sample, then score)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..seeding import RowGenerators
from ..types import StepOutput

Reduction = Literal["mean", "sum"]
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_log_prob(x_next: Tensor, mean: Tensor, std: Tensor, reduction: Reduction = "mean") -> Tensor:
    """log N(x_next; mean, std^2 I), reduced over all non-batch dims.

    ``mean`` is the field's convention (Flow-GRPO, DanceGRPO, DDPO all average over C,H,W / C,T,H,W /
    tokens), so published clip ranges carry over; ``sum`` is the true log-density of the whole state.
    Computed in float32 whatever the inputs' dtype, or in float64 when ``mean`` is float64 (the DDIM step,
    whose mean is float64 until the end); returned as float32, (B,).
    """
    dtype = torch.float64 if mean.dtype == torch.float64 else torch.float32
    x_next, mean = x_next.to(dtype), mean.to(dtype)
    std = torch.as_tensor(std, dtype=dtype, device=mean.device)
    elem = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    dims = tuple(range(1, elem.ndim))
    return (elem.mean(dims) if reduction == "mean" else elem.sum(dims)).float()


def standard_noise(like: Tensor, generator: torch.Generator | RowGenerators | None) -> Tensor:
    """float32 N(0, I) noise shaped like ``like``, drawn from ``generator`` (on its device); from
    :class:`~flowrl.seeding.RowGenerators`, row b from its own stream (what training rollouts use)."""
    if isinstance(generator, RowGenerators):
        return generator.randn(tuple(like.shape)).to(like.device)
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, device=device, dtype=torch.float32).to(like.device)


def as_sigma(sigma, x: Tensor, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> Tensor:
    """sigma as a tensor that broadcasts against the state ``x`` (B, *S): 0-dim for a scalar (a float or a
    0-dim / one-element tensor), (B, 1, ..., 1) for a per-sample (B,) sigma, as objectives that draw a
    timestep per sample pass it. ``dtype`` float64 keeps the caller's precision (the DDIM table lookup);
    ``device`` (default x's) lets that lookup run on the CPU for a device without float64 (Apple MPS)."""
    t = torch.as_tensor(sigma, dtype=dtype, device=x.device if device is None else device)
    if t.ndim == 0 or (t.shape == (1,) and x.shape[0] != 1):
        return t.reshape(())
    if t.ndim == 1 and t.shape[0] == x.shape[0]:
        return t.reshape(-1, *([1] * (x.ndim - 1)))
    raise FlowRLError(f"sigma must be a scalar or one value per sample, shape ({x.shape[0]},); got shape {tuple(t.shape)}.")


def finish_step(mean: Tensor, std: Tensor, x_next: Tensor | None, generator, reduction: Reduction) -> StepOutput:
    """Sample x_next ~ N(mean, std^2) if not given, then score it; everything returned is float32.

    ``mean`` / ``std`` are float32 (flow samplers) or float64 (DDIM): a float64 step is rounded once, at the
    end, and its log-prob is the float64 density of the float32 x_next. ``std`` is 0-dim or (B, 1, ..., 1).
    A row whose std is 0 is a deterministic step: with a scalar std the
    log-prob is None (as before); with per-sample stds the rows with std 0 get NaN (the trajectory's mark
    for "not stochastic") and the log-prob is None only when every row is deterministic.
    """
    if x_next is None:
        x_next = mean + std * standard_noise(mean, generator)
    x_next = x_next.float()
    mean_out, std_out = mean.float(), std.float()
    positive = std > 0
    if not bool(positive.any()):
        log_prob = None
    elif bool(positive.all()):
        log_prob = gaussian_log_prob(x_next, mean, std, reduction)
    else:  # scored with std 1 where it is 0, then masked: no inf / NaN arithmetic on those rows
        log_prob = gaussian_log_prob(x_next, mean, torch.where(positive, std, torch.ones_like(std)), reduction)
        log_prob = torch.where(positive.reshape(-1), log_prob, torch.full_like(log_prob, float("nan")))
    return StepOutput(x_next=x_next, log_prob=log_prob, mean=mean_out, std=std_out)
