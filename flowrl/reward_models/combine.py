"""A weighted sum of rewards, the usual way to trade prompt alignment against an aesthetic term."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import Reward, RewardOutput


class WeightedSum:
    """Score = sum of ``weights[name] * component(samples)``; every component is logged under its name.

    A component with weight 0 is evaluated and logged but left out of the sum, so it can be watched
    without being optimised. A NaN from any weighted component makes that sample's total NaN
    ("not applicable"), so the trainer drops the sample rather than scoring it on a partial sum.
    """

    name = "weighted"

    def __init__(self, components: Mapping[str, Reward], weights: Mapping[str, float]) -> None:
        if not components:
            raise FlowRLError("a weighted reward needs at least one component.")
        if set(components) != set(weights):
            raise FlowRLError(
                f"reward weights name {sorted(weights)} but the components are {sorted(components)}; "
                "give one weight per component."
            )
        self.components = dict(components)
        self.weights = {k: float(v) for k, v in weights.items()}
        self.differentiable = all(c.differentiable for c in self.components.values())

    def __call__(
        self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        total = torch.zeros(samples.shape[0], dtype=torch.float32, device=samples.device)
        extras: dict[str, Tensor] = {}
        for key, reward in self.components.items():
            out = reward(samples, prompts, metadata)
            scores = out.scores.to(device=samples.device, dtype=torch.float32)
            if self.weights[key] != 0.0:
                total = total + self.weights[key] * scores
            # Logged copies must not keep the autograd graph of a differentiable component alive.
            extras[key] = scores.detach()
            extras.update({f"{key}/{k}": v.detach() for k, v in out.extras.items()})
        return RewardOutput(scores=total, extras=extras)
