"""Flash-GRPO (arXiv:2605.15980; released code: Shredded-Pork/Flash-GRPO, scripts/train_wanx2_1_flash.py).

One SDE step per trajectory, the same step for every sample of a prompt group (iso-temporal grouping: a group's
reward differences are then not confounded by how hard its step is), ODE steps everywhere else; the step is drawn
uniformly per group from the first ``step_fraction`` of the steps (the noise end). Group-normalised advantages, a
PPO-clipped ratio on that one step, and temporal gradient rectification: row b's term is multiplied by

    w_b = c(k_b) / mean_{b' in minibatch} c(k_b'),   c(k) = std_k / |d mean_k / d v|,

c(k) being the inverse of the scale the step's log-prob gradient has with respect to the model output v (for a flow
SDE with diffusion coefficient g: d log p / d v = eps (sqrt|dt| / g + g sqrt|dt| (1 - sigma) / (2 sigma)), the
released code's ``coe``), so every trained step moves v with the same gradient scale. The noise grows linearly
with sigma with the ``flash_sde`` sampler (samplers/flash_sde.py); any flow sampler can be used.
docs/objectives/flash_grpo.md says where flowrl matches and differs from the released code.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..samplers.step_credit import FlashLayout
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, Sampler, Trajectory
from .advantages import GroupAdvantages, MultiRewardOption, clip_advantages, std_eps_option, std_option
from .functional import StdConvention
from .step_credit import StepCreditBase, refuse_rollout_settings, step_log_probs, weighted_step_loss


def rectification_scale(sampler: Sampler, x: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """c = std / |d mean / d v| of one step of ``sampler`` (a 0-dim float32): the inverse of the scale of the
    step's log-prob gradient with respect to the model output. A flow sampler's mean is affine in v elementwise, so
    d mean / d v is read from the sampler's own step at v = 0 and v = 1 on ``x`` (one row): no denoiser call."""
    x = x[:1].float()
    m0 = sampler.step(torch.zeros_like(x), x, sigma, sigma_next, x_next=x)
    m1 = sampler.step(torch.ones_like(x), x, sigma, sigma_next, x_next=x)
    return (torch.as_tensor(m0.std, dtype=torch.float32).reshape(-1).mean() / (m1.mean - m0.mean).abs().mean()).float()


def trained_step(batch: Trajectory) -> Tensor:
    """(B,) each row's one stochastic step (the one with a finite rollout log-prob); -1 for a row with none."""
    finite = torch.isfinite(batch.log_probs)
    first = finite.float().argmax(1)
    return torch.where(finite.any(1), first, torch.full_like(first, -1))


def rectification_weights(scales: Tensor, counted: Tensor) -> Tensor:
    """w_b = c_b / mean over the counted rows of c; 0 on rows not counted. scales, counted: (B,)."""
    scales = scales.float()
    mean = scales[counted].mean() if bool(counted.any()) else scales.new_tensor(1.0)
    return torch.where(counted, scales / mean, torch.zeros_like(scales))


@dataclass
class FlashGRPOObjective(StepCreditBase):
    name: str
    advantage_estimator: GroupAdvantages
    clip_range: float
    adv_clip_max: float | None
    step_fraction: float
    rectify: bool
    minibatch_unit: int = field(default=1, init=False)

    @property
    def rollout_layout(self) -> FlashLayout:
        return FlashLayout(self.step_fraction)

    def prepare(self, batch: Trajectory) -> Trajectory:
        batch.advantages = clip_advantages(self.advantage_estimator(batch), self.adv_clip_max)
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        steps = trained_step(batch).cpu()
        counted = (steps >= 0) & torch.isfinite(batch.rewards).cpu()
        scales = torch.ones(len(batch))
        for k in torch.unique(steps[steps >= 0]).tolist():
            scales[steps == k] = rectification_scale(sampler, batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1]).cpu()
        weights = rectification_weights(scales, counted) if self.rectify else counted.float()
        total = float(counted.sum())
        for k in torch.unique(steps[steps >= 0]).tolist():
            rows = torch.nonzero(steps == k).flatten()
            log_prob, old = step_log_probs(pipeline, sampler, batch, k, rows)
            out = weighted_step_loss(
                log_prob, old, batch.advantages[rows.to(batch.advantages.device)], weights[rows], self.clip_range, total, k
            )
            out.metrics["flash/trained_step"] = torch.tensor(float(k))
            out.metrics["flash/rectification_weight"] = (
                weights[rows][counted[rows]].mean() if bool(counted[rows].any()) else torch.tensor(0.0)
            )
            yield out


class FlashGRPOConfig(ObjectiveSection, MultiRewardOption):
    """``objective.name: flash_grpo``: Flash-GRPO (docs/objectives/flash_grpo.md)."""

    name: str = "flash_grpo"
    std: StdConvention = std_option("biased", "the released code: Flow-GRPO's per-prompt tracker, N in the std, eps 1e-4")
    std_eps: float = std_eps_option(1e-4)
    clip_range: float = Field(1e-3, gt=0, description="PPO's clip epsilon of the one step's ratio (the released code: 1e-3).")
    adv_clip_max: float | None = Field(5.0, description="Clip advantages to +-value (the released code: 5); None: no clipping.")
    step_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="A group's SDE step is drawn uniformly from the first max(1, int(step_fraction * K)) of the K steps, "
        "the noise end (the released code: the first 10 of 20).",
    )
    rectify: bool = Field(
        True,
        description="Temporal gradient rectification: weigh each row by its step's c = std / |d mean / d v| over the "
        "minibatch's mean c; false: every row alike.",
    )

    def check_run(self, config: Any) -> None:
        refuse_rollout_settings(config, "flash_grpo")

    def build(self, context: BuildContext | None = None) -> FlashGRPOObjective:
        return FlashGRPOObjective(
            name=self.name,
            advantage_estimator=self.group_advantages(context),
            clip_range=self.clip_range,
            adv_clip_max=self.adv_clip_max,
            step_fraction=self.step_fraction,
            rectify=self.rectify,
        )
