"""What Flash-GRPO, TreeGRPO and stepwise GRPO share: the clipped surrogate of one denoising step on chosen rows,
and the refusals of rollout settings their own rollout layouts replace (samplers/step_credit.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .functional import clipped_surrogate_terms
from .policy_gradient import step_ratio_stats


def step_log_probs(pipeline: Pipeline, sampler: Sampler, batch: Trajectory, k: int, rows: Tensor) -> tuple[Tensor, Tensor]:
    """(log-prob under the current weights, the rollout's) of step ``k``'s stored transition for ``rows``: one
    denoiser call on those rows alone."""
    sub = batch[rows]
    x, x_next = sub.latents[:, k], sub.latents[:, k + 1]
    model_output = pipeline.predict(x, sub.sigmas[k], sub.cond, sub.guidance_scale)
    out = sampler.step(model_output, x, sub.sigmas[k], sub.sigmas[k + 1], x_next=x_next)
    return out.log_prob, sub.log_probs[:, k].to(out.log_prob.device)


def weighted_step_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, weights: Tensor, clip_range: float, denominator: float, k: int
) -> LossOutput:
    """sum_rows w_r max(-A_r r_r, -A_r clip(r_r)) / ``denominator`` for one step's rows (a row with weight 0 is
    masked out), with the step's ratio statistics; ``loss/policy`` is the unweighted mean over the rows that count."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    terms = clipped_surrogate_terms(ratio, advantages.to(ratio.device), clip_range)
    w = weights.to(ratio.device)
    counted = w > 0
    n = counted.sum().clamp(min=1)
    with torch.no_grad():
        metrics = {
            "loss/policy": (terms * counted).sum() / n,
            "policy/ratio_mean": (ratio * counted).sum() / n,
            "policy/clipfrac": (((ratio - 1).abs() > clip_range).float() * counted).sum() / n,
            "policy/approx_kl": (0.5 * log_ratio**2 * counted).sum() / n,
            **step_ratio_stats(log_ratio.detach(), counted, k),
        }
    return LossOutput(loss=(w * terms).sum() / max(denominator, 1.0), metrics=metrics)


@dataclass
class StepCreditBase:
    """The declarations these objectives share: on-policy rollouts laid out by ``rollout_layout``, per-step log-probs,
    no reference model, the policy alone."""

    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=True, init=False)
    needs_step_means: bool = field(default=False, init=False)
    reference: ReferenceModel = field(default="none", init=False)
    roles: tuple[Role, ...] = field(default=(), init=False)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def refuse_rollout_settings(config: Any, objective: str, window: bool = True) -> None:
    """The rollout settings an objective with its own rollout layout cannot take, refused in one sentence."""
    rc = config.rollout
    if rc.overlap_reward:
        raise ValueError(f"objective {objective} lays out its own rollouts, scored as one batch; set rollout.overlap_reward=false")
    if window and rc.sde_window_size is not None:
        raise ValueError(f"objective {objective} chooses its stochastic steps itself; leave rollout.sde_window_size unset")
