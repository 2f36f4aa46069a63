"""Closed-form rewards on 2-D points, for the toy model whose tilted targets are known exactly.

Samples are (B, 2) points (``flowrl.pipelines.toy2d`` decodes to the latent itself). Both rewards are
differentiable, so Adjoint Matching can use them, and both keep the tilt ``p_base(x) exp(lambda r(x))``
of a Gaussian mixture a Gaussian mixture (``flowrl.pipelines.toy2d.tilted_target``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput


def _points(samples: Tensor, dim: int, name: str) -> Tensor:
    if samples.ndim != 2 or samples.shape[1] != dim:
        raise FlowRLError(f"the {name} reward reads (B, {dim}) points, got shape {tuple(samples.shape)}.")
    return samples.float()


class LinearReward2D:
    """r(x) = w . x (``weights`` = w).

    Args:
        weights: the vector w, one entry per coordinate of a point.
    """

    name = "linear2d"
    differentiable = True

    def __init__(self, weights: Sequence[float] = (0.5, 0.5)) -> None:
        self.weights = tuple(float(w) for w in weights)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        x = _points(samples, len(self.weights), self.name)
        return RewardOutput(scores=x @ torch.tensor(self.weights, dtype=x.dtype, device=x.device))


class QuadraticReward2D:
    """r(x) = -0.5 * scale * ||x - center||^2.

    Args:
        center: the point of highest reward.
        scale: the curvature (> 0): larger is a narrower peak.
    """

    name = "quadratic2d"
    differentiable = True

    def __init__(self, center: Sequence[float] = (0.0, 1.0), scale: float = 1.0) -> None:
        if scale <= 0:
            raise FlowRLError(f"the quadratic2d reward needs scale > 0, got {scale}.")
        self.center = tuple(float(c) for c in center)
        self.scale = float(scale)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        x = _points(samples, len(self.center), self.name)
        c = torch.tensor(self.center, dtype=x.dtype, device=x.device)
        return RewardOutput(scores=-0.5 * self.scale * ((x - c) ** 2).sum(dim=1))
