"""The one Gaussian transition log-density every stochastic sampler uses."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Reduction = Literal["mean", "sum"]
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_log_prob(x_next: Tensor, mean: Tensor, std: Tensor, reduction: Reduction = "mean") -> Tensor:
    """log N(x_next; mean, std^2 I), reduced over all non-batch dims.

    ``mean`` is the field's convention (Flow-GRPO, DanceGRPO, DDPO all average over C,H,W / C,T,H,W /
    tokens), so published clip ranges carry over; ``sum`` is the true log-density of the whole state.
    Computed in float32 whatever the inputs' dtype. Returns (B,).
    """
    x_next, mean = x_next.float(), mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    elem = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    dims = tuple(range(1, elem.ndim))
    return elem.mean(dims) if reduction == "mean" else elem.sum(dims)


def standard_noise(like: Tensor, generator: torch.Generator | None) -> Tensor:
    """float32 N(0, I) noise shaped like ``like``, drawn from ``generator`` (on its device)."""
    device = generator.device if generator is not None else like.device
    return torch.randn(like.shape, generator=generator, device=device, dtype=torch.float32).to(like.device)
