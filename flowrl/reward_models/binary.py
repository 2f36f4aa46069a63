"""Binary (thresholded) rewards, as DanceGRPO's "binary reward": 1 if the inner score > threshold, else 0.

``ThresholdReward`` wraps another reward, so it is built in code rather than by name, e.g.
``ThresholdReward(build_reward("digit_classifier"), threshold=0.5)``; it has no registry entry.
``AllOfReward`` (1 when every inner score passes its threshold) is what a config declares under
``reward.binary`` (docs/rewards.md), e.g. the sparse reward of configs/digits/b2_diffurl.yaml.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from flowrl.sections import Section
from flowrl.types import Reward, RewardOutput


class BinaryRewardConfig(Section):
    """``reward.binary.<new name>``: a sparse binary reward: 1 when every named reward's score is strictly above its
    threshold, else 0."""

    all_of: dict[str, float] = Field(
        min_length=1, description="Reward name -> threshold its score must be strictly above for the binary reward to be 1."
    )


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

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        out = self.inner(samples, prompts, metadata)
        raw = out.scores.detach().float()
        scores = torch.where(raw > self.threshold, torch.full_like(raw, self.above), torch.full_like(raw, self.below))
        scores = torch.where(torch.isnan(raw), raw, scores)
        extras = {k: v.detach() for k, v in out.extras.items()}
        extras["raw"] = raw
        return RewardOutput(scores=scores, extras=extras)


class AllOfReward:
    """A sparse binary reward: ``above`` where every inner score passes its threshold (strictly greater),
    ``below`` otherwise; NaN where any inner score is NaN (a failed scorer must not read as a miss).

    Declared in a config as ``reward.binary.<new name>.all_of: {inner reward name: threshold}``, e.g.
    "1 when the ink passes 0.34 and the classifier still gives the prompted digit more than 0.5". Each
    inner raw score is logged as the extra ``<inner>`` and its pass (0/1) as ``<inner>/pass``.
    """

    differentiable = False

    def __init__(
        self, inners: Mapping[str, Reward], thresholds: Mapping[str, float], above: float = 1.0, below: float = 0.0, name: str = "all_of"
    ) -> None:
        self.parts = {n: ThresholdReward(inners[n], thresholds[n]) for n in inners}  # each thresholded to 1/0/NaN
        self.above, self.below, self.name = float(above), float(below), name

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        extras: dict[str, Tensor] = {}
        passed = None
        for n, part in self.parts.items():
            out = part(samples, prompts, metadata)
            extras[n], extras[f"{n}/pass"] = out.extras["raw"], out.scores
            passed = out.scores if passed is None else passed * out.scores  # 1 only when all pass; NaN propagates
        scores = torch.where(passed > 0.5, torch.full_like(passed, self.above), torch.full_like(passed, self.below))
        scores = torch.where(torch.isnan(passed), passed, scores)
        return RewardOutput(scores=scores, extras=extras)
