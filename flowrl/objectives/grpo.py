"""GRPO for diffusion and flow models (DanceGRPO, arXiv:2505.07818; Flow-GRPO, arXiv:2505.05470).

Group-relative advantages over the samples of one prompt, PPO-clipped ratio per denoising step,
timestep subsampling, optional KL to the frozen initial model, optional best/worst training subset.

Differences from the reference implementations:
- The std convention is a config choice (``std``): DanceGRPO's unbiased std + 1e-8, Flow-GRPO's biased
  std + 1e-4, Flow-GRPO's global std, or none; the references hard-code one each.
- KL is the true Gaussian KL between the two transition kernels unless ``kl_form=flow_grpo`` asks for
  Flow-GRPO's scaling (which is the true KL times |dt|).
- One LossOutput per trained step: the trainer backpropagates each before the next forward, so memory
  does not grow with the number of trained steps.
- Samples with a non-finite reward are dropped by the trainer before advantages are computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..sections import BuildContext
from ..types import Trajectory
from .functional import StdConvention, group_advantages
from .policy_gradient import PolicyGradientConfig, PolicyGradientObjective, StepWeighting


@dataclass
class GroupAdvantages:
    """Group-normalised advantages of the combined reward, or, with ``component_weights``, the weighted
    sum of each component's own group-normalised advantage (so a reward with a large scale or spread
    cannot drown the others; Flow-GRPO's multi-reward setting)."""

    std: StdConvention
    eps: float
    component_weights: dict[str, float] | None = None

    def __call__(self, batch: Trajectory) -> Tensor:
        if not self.component_weights:
            return group_advantages(batch.rewards, batch.group_ids, self.std, self.eps)
        total = torch.zeros_like(batch.rewards, dtype=torch.float32)
        for name, weight in self.component_weights.items():
            if weight != 0:
                component = torch.where(torch.isfinite(batch.rewards), batch.reward_components[name], float("nan"))
                total = total + weight * group_advantages(component, batch.group_ids, self.std, self.eps)
        return total

    def state_dict(self) -> dict[str, Any]:
        return {}  # stateless: each batch's groups are normalised on their own

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class GRPOConfig(PolicyGradientConfig):
    """``objective.name: grpo``."""

    name: str = "grpo"
    std: StdConvention = "unbiased"
    std_eps: float = Field(1e-8, gt=0)
    per_reward_advantages: bool = False  # normalise each reward component in its group, then weight and sum
    adv_clip_max: float | None = None
    best_worst_k: int | None = Field(None, ge=2)
    # TempFlow-GRPO's noise-aware step credit: each trained step's policy term weighted by its transition std,
    # normalised to mean 1 over the trained steps (docs/objectives/grpo.md); none: every step alike
    step_weighting: StepWeighting = "none"

    def build(self, context: BuildContext | None = None) -> PolicyGradientObjective:
        weights = dict(context.reward_weights) if self.per_reward_advantages and context is not None else None
        estimator = GroupAdvantages(self.std, self.std_eps, weights)
        return self.policy_gradient(estimator, self.adv_clip_max, self.best_worst_k, self.step_weighting)
