"""Stepwise-Flow-GRPO's dense credit (arXiv:2603.28718): the reward of step k is the change in the reward of the
flow's x0 (Tweedie) estimate across the step,

    r_k = R(x0_hat_{k+1}) - R(x0_hat_k),   x0_hat_k = x_k - sigma_k v(x_k),   x0_hat_K = x_K (the sample),

so the step rewards of a trajectory sum to R(x_K) - R(x0_hat_0). Chosen over DenseGRPO (arXiv:2601.20218, a step's
reward from an ODE completion to the end from that step) because it costs no denoiser call: x0_hat_k comes from the
model output the rollout already computed (read back from the recorded step mean, samplers/step_credit.py
``x0_estimates``); it costs K more reward calls per sample, which DenseGRPO pays too, on top of its
sum_k (K - k) ~ K^2 / 2 extra denoiser rows per sample.

Advantages are normalised per prompt group and per step: A_{b,k} = (r_{b,k} - mean_g r_k) / (std_g r_k + eps)
(``credit: step_gain``), or of the reward to go R(x_K) - R(x0_hat_k) (``credit: to_go``). The loss is the
PPO-clipped ratio of each trained step with its own advantage, averaged over the trained steps as GRPO's.
docs/objectives/stepwise_grpo.md lists what the paper leaves open and flowrl's choices.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.step_credit import X0_REWARD, StepwiseLayout
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, Sampler, Trajectory
from .advantages import clip_advantages, std_eps_option, std_option
from .functional import StdConvention, group_advantages
from .policy_gradient import TimestepOrder, choose_train_steps, timestep_fraction_option, timestep_order_option
from .step_credit import StepCreditBase, refuse_rollout_settings, step_log_probs, weighted_step_loss

Credit = Literal["step_gain", "to_go"]


def x0_rewards(batch: Trajectory) -> Tensor:
    """(B, K + 1): the reward of every step's x0 estimate (the score phase's ``stepwise/x0_reward_kk`` components),
    then the final reward."""
    missing = [k for k in range(batch.num_steps) if X0_REWARD.format(k) not in batch.reward_components]
    if missing:
        raise FlowRLError(
            "objective stepwise_grpo needs the reward of every step's x0 estimate, scored with the rollouts by its layout; "
            f"this batch lacks steps {missing}."
        )
    per_step = [batch.reward_components[X0_REWARD.format(k)].float().cpu() for k in range(batch.num_steps)]
    return torch.stack([*per_step, batch.rewards.float().cpu()], dim=1)


def step_credits(rewards: Tensor, credit: Credit) -> Tensor:
    """(B, K) from the x0 rewards (B, K + 1): step_gain r_k = R_{k+1} - R_k; to_go R_K - R_k."""
    return rewards[:, 1:] - rewards[:, :-1] if credit == "step_gain" else rewards[:, -1:] - rewards[:, :-1]


def stepwise_advantages(credits: Tensor, valid: Tensor, group_ids: Tensor, steps: list[int], std: StdConvention, eps: float) -> Tensor:
    """(B, K): each listed step's credits normalised in their prompt group (``group_advantages``), 0 elsewhere and on
    rows whose reward is not finite."""
    adv = torch.zeros_like(credits, dtype=torch.float32)
    for k in steps:
        adv[:, k] = group_advantages(torch.where(valid, credits[:, k], float("nan")), group_ids.cpu(), std, eps)
    return adv


@dataclass
class StepwiseGRPOObjective(StepCreditBase):
    name: str
    std: StdConvention
    std_eps: float
    clip_range: float
    adv_clip_max: float | None
    credit: Credit
    timestep_fraction: float
    timestep_order: TimestepOrder
    minibatch_unit: int = field(default=1, init=False)
    needs_step_means: bool = field(default=True, init=False)  # the x0 estimates are read back from the rollout's step means

    @property
    def rollout_layout(self) -> StepwiseLayout:
        return StepwiseLayout()

    def prepare(self, batch: Trajectory) -> Trajectory:
        credits = step_credits(x0_rewards(batch), self.credit)
        valid = torch.isfinite(batch.rewards).cpu() & torch.isfinite(credits).all(1)
        steps = torch.nonzero(batch.stochastic.cpu()).flatten().tolist()
        adv = stepwise_advantages(torch.nan_to_num(credits), valid, batch.group_ids, steps, self.std, self.std_eps)
        batch.advantages = clip_advantages(adv, self.adv_clip_max).to(batch.latents.device)
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        steps = choose_train_steps(batch.stochastic.cpu(), self.timestep_fraction, self.timestep_order, generator)
        counted = torch.isfinite(batch.rewards).float().cpu()
        rows = torch.arange(len(batch))
        for k in steps:
            log_prob, old = step_log_probs(pipeline, sampler, batch, k, rows)
            out = weighted_step_loss(log_prob, old, batch.advantages[:, k], counted, self.clip_range, float(counted.sum()), k)
            out.loss = out.loss / len(steps)
            yield out


class StepwiseGRPOConfig(ObjectiveSection):
    """``objective.name: stepwise_grpo``: dense per-step credit from the x0 estimate's reward (docs/objectives/stepwise_grpo.md)."""

    name: str = "stepwise_grpo"
    std: StdConvention = std_option("biased", "Flow-GRPO's, applied to each step's credits")
    std_eps: float = std_eps_option(1e-4)
    clip_range: float = Field(1e-3, gt=0, description="PPO's clip epsilon of each step's ratio.")
    adv_clip_max: float | None = Field(5.0, description="Clip the per-step advantages to +-value; None: no clipping.")
    credit: Credit = Field(
        "step_gain",
        description="A step's credit: step_gain, the change of the x0 estimate's reward across the step (the paper's); "
        "to_go, the final reward minus the reward of the x0 estimate at the step's input.",
    )
    timestep_fraction: float = timestep_fraction_option()
    timestep_order: TimestepOrder = timestep_order_option()

    def check_run(self, config: Any) -> None:
        refuse_rollout_settings(config, "stepwise_grpo", window=False)
        if config.rollout.branching is not None:
            raise ValueError("objective stepwise_grpo lays out its own rollouts; leave rollout.branching unset")

    def build(self, context: BuildContext | None = None) -> StepwiseGRPOObjective:
        pipeline = getattr(context, "pipeline", None)
        if pipeline is not None and getattr(pipeline, "prediction_type", "flow") != "flow":
            raise FlowRLError(
                f"objective stepwise_grpo reads the x0 estimate of a rectified flow (x - sigma v); this model predicts "
                f"{pipeline.prediction_type}. Use a flow family."
            )
        return StepwiseGRPOObjective(name=self.name, **self.target_kwargs())
