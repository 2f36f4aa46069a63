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
- Several reward components: ``multi_reward`` (weighted_sum, per_reward, gdpo; objectives/advantages.py).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from ..sections import BuildContext
from .advantages import GroupAdvantages as GroupAdvantages  # re-exported: its home was this module
from .advantages import MultiRewardOption
from .functional import StdConvention
from .policy_gradient import PolicyGradientConfig, PolicyGradientObjective, StepWeighting


class GRPOConfig(PolicyGradientConfig, MultiRewardOption):
    """``objective.name: grpo``."""

    name: str = "grpo"
    std: StdConvention = Field(
        "unbiased",
        description="Advantage normaliser: the group std with N - 1 (unbiased, DanceGRPO) or N (biased, Flow-GRPO: std_eps 1e-4), "
        "global: the batch std, none: r - mean.",
    )
    std_eps: float = Field(1e-8, gt=0, description="Added to the std before the advantage is divided by it.")
    per_reward_advantages: bool = Field(False, description="The older spelling of multi_reward: per_reward (kept for existing presets).")
    adv_clip_max: float | None = Field(None, description="Clip advantages to +-value; None: no clipping.")
    best_worst_k: int | None = Field(
        None, ge=2, description="DanceGRPO's subset: train only the top k/2 and bottom k/2 of each group; None: all."
    )
    # normalised to mean 1 over the trained steps (docs/objectives/grpo.md)
    step_weighting: StepWeighting = Field(
        "none",
        description="Per-step credit: noise_level (TempFlow-GRPO, by transition std), inverse_dt (GRPO-Guard, by 1/|dt|); none: equal.",
    )

    @model_validator(mode="after")
    def _one_multi_reward(self) -> GRPOConfig:
        if self.per_reward_advantages and self.multi_reward not in ("weighted_sum", "per_reward"):
            raise ValueError(
                f"objective.per_reward_advantages is the older spelling of multi_reward: per_reward; drop it to use multi_reward: {self.multi_reward}."
            )
        return self

    def build(self, context: BuildContext | None = None) -> PolicyGradientObjective:
        estimator = self.group_advantages(context, "per_reward" if self.per_reward_advantages else None)
        return self.policy_gradient(estimator, self.adv_clip_max, self.best_worst_k, self.step_weighting)
