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

from torch import Tensor

from ..types import Trajectory
from .functional import StdConvention, group_advantages
from .policy_gradient import PolicyGradientObjective


@dataclass
class GroupAdvantages:
    std: StdConvention = "unbiased"
    eps: float = 1e-8

    def __call__(self, batch: Trajectory) -> Tensor:
        return group_advantages(batch.rewards, batch.group_ids, self.std, self.eps)


def build_grpo(std: StdConvention = "unbiased", std_eps: float = 1e-8, **kwargs: Any) -> PolicyGradientObjective:
    return PolicyGradientObjective(name="grpo", advantage_estimator=GroupAdvantages(std, std_eps), **kwargs)
