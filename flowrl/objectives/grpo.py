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
from torch import Tensor

from ..types import Trajectory
from .functional import StdConvention, group_advantages
from .policy_gradient import PolicyGradientObjective


@dataclass
class GroupAdvantages:
    """Group-normalised advantages of the combined reward, or, with ``component_weights``, the weighted
    sum of each component's own group-normalised advantage (so a reward with a large scale or spread
    cannot drown the others; Flow-GRPO's multi-reward setting)."""

    std: StdConvention = "unbiased"
    eps: float = 1e-8
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


def build_grpo(std: StdConvention = "unbiased", std_eps: float = 1e-8, per_reward_advantages: bool = False,
               reward_weights: dict[str, float] | None = None, **kwargs: Any) -> PolicyGradientObjective:
    weights = dict(reward_weights or {}) if per_reward_advantages else None
    return PolicyGradientObjective(name="grpo", advantage_estimator=GroupAdvantages(std, std_eps, weights), **kwargs)
