"""Rewards that are plain statistics of the pixels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from flowrl.types import RewardOutput


class InkReward:
    """Score each image by its mean pixel intensity, in [0, 1].

    The embedded digits are white ink on black (mean about 0.3), so this rewards bolder strokes: an
    objective with plenty of headroom whose progress is easy to see, and which is differentiable.
    """

    name = "ink"
    differentiable = True

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        return RewardOutput(scores=samples.float().flatten(1).mean(1))  # images (B, C, H, W) and videos (B, C, T, H, W)
