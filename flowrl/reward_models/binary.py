"""Binary (thresholded) rewards, as DanceGRPO's "binary reward": 1 if the inner score > threshold, else 0.

``ThresholdReward`` wraps another reward, so it is built in code rather than by name, e.g.
``ThresholdReward(build_reward("digit_classifier"), threshold=0.5)``; it has no registry entry.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from flowrl.types import Reward, RewardOutput


class ThresholdReward:
    """score = ``above`` where inner > threshold (strictly), ``below`` otherwise, NaN where inner is NaN.

    The inner score is logged as the extra ``raw`` and the inner extras are passed through. Never
    differentiable (a step function has no useful gradient).
    """

    differentiable = False

    def __init__(self, inner: Reward, threshold: float, above: float = 1.0, below: float = 0.0) -> None:
        self.inner = inner
        self.threshold = float(threshold)
        self.above = float(above)
        self.below = float(below)
        self.name = f"binary/{inner.name}"

    def __call__(
        self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> RewardOutput:
        out = self.inner(samples, prompts, metadata)
        raw = out.scores.detach().float()
        scores = torch.where(raw > self.threshold, torch.full_like(raw, self.above), torch.full_like(raw, self.below))
        scores = torch.where(torch.isnan(raw), raw, scores)
        extras = {k: v.detach() for k, v in out.extras.items()}
        extras["raw"] = raw
        return RewardOutput(scores=scores, extras=extras)
