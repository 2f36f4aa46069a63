"""Flow-DPPO (Ping et al. 2026, arXiv:2606.11025): GRPO's per-step ratio surrogate with a divergence trust region.

Each stochastic denoising step is a Gaussian transition whose std does not depend on the model output (a function
of sigma and sigma_next only), so the rollout (old) policy and the current one differ only in their means and the
KL between them is exact and deterministic:

    D_k = KL( N(mu_old, s^2 I) || N(mu_theta, s^2 I) ) = mean over dims of (mu_theta - mu_old)^2 / (2 s^2)

reduced like the sampler's log-prob (``sampler.reduction``, "mean" by default: the per-dimension mean, as the
authors' code reduces it, so the threshold is a per-dimension KL). The surrogate is GRPO's without the clip,

    loss_k = mean_B [ M_k (-A r_k) ],   r_k = exp(log p_theta(x_{k+1} | x_k) - log p_old(x_{k+1} | x_k)),

and a sample-step is dropped (M = 0) only when it is outside the trust region AND the ratio already moved the
way the advantage pushes it (further from the old policy):

    M = 0  iff  D_k > kl_threshold  and  ( (r > 1 and A > 0) or (r < 1 and A < 0) ),  else 1.

A step that moves back towards the old policy is never dropped, however far it is. The dropped rows stay in the
mean's denominator with 0 (as the authors' code). The loss over the trained steps is averaged; optional
``beta`` adds the true Gaussian KL to the frozen initial model, like GRPO's ``kl_form: gaussian``.

mu_old: flowrl's trajectories record states and log-probs, not the rollout's transition means, so the objective
keeps a copy of the trainable tensors taken at the first minibatch after each rollout (the weights that produced
it: the loop rolls out, scores, calls ``prepare``, then trains) and computes mu_old with a no-grad forward of that
copy, swapped in by pointer (as DiffusionNFT's old policy). Cost: one extra no-grad forward per trained step, except
in the minibatch that takes the copy (no optimizer step since: mu_old is that forward's own mean). At unchanged weights mu_theta == mu_old bit for bit and r == 1, so nothing is dropped (tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .advantages import GroupAdvantages, MultiRewardOption, clip_advantages, std_eps_option, std_option
from .diffusion_nft import swapped_weights
from .functional import StdConvention, gaussian_kl, masked_mean
from .policy_gradient import TimestepOrder, choose_train_steps, step_ratio_stats, timestep_fraction_option, timestep_order_option


def trust_region_drop(ratio: Tensor, advantages: Tensor, kl: Tensor, threshold: float) -> Tensor:
    """Flow-DPPO's mask (paper Eq. 18), True where a sample-step is dropped: its KL to the old policy exceeds
    ``threshold`` and its ratio moved in the direction its advantage pushes (r > 1 with A > 0, r < 1 with A < 0).
    Any shape (broadcasting); r == 1 and A == 0 are never dropped."""
    pushed = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    return (kl > threshold) & pushed


def divergence_masked_surrogate(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, kl: Tensor, threshold: float, mask: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO's loss for one denoising step: ``mean_B where(drop, 0, -A r)``, r = exp(log_prob - old_log_prob),
    no clip; the mean over the samples where ``mask`` (B,) is True (a dropped sample counts with 0). ``kl`` (B,) is
    the exact KL between the old and current transitions. Returns the loss and detached statistics: the ratio's
    mean, DDPO's approx_kl (0.5 mean (log r)^2), the exact KL's mean and max, the fraction over the threshold and
    the fraction dropped."""
    mask_f = None if mask is None else mask.float()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    drop = trust_region_drop(ratio.detach(), advantages, kl.detach(), threshold)
    terms = torch.where(drop, torch.zeros_like(ratio), -advantages * ratio)  # where, not a product: no inf * 0
    loss = masked_mean(terms, mask_f)
    with torch.no_grad():
        kept_kl = kl if mask is None else kl[mask.to(kl.device)]
        stats = {
            "policy/ratio_mean": masked_mean(ratio, mask_f),
            "policy/approx_kl": masked_mean(0.5 * log_ratio**2, mask_f),
            "dppo/kl_mean": masked_mean(kl.float(), mask_f),
            "dppo/kl_max": kept_kl.max() if kept_kl.numel() else kl.new_zeros(()),
            "dppo/over_threshold": masked_mean((kl > threshold).float(), mask_f),
            "dppo/dropped": masked_mean(drop.float(), mask_f),
        }
    return loss, stats


@dataclass
class FlowDPPOObjective:
    advantage_estimator: GroupAdvantages
    kl_threshold: float
    adv_clip_max: float | None
    beta: float
    timestep_fraction: float
    timestep_order: TimestepOrder
    name: str = field(default="flow_dppo", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=True, init=False)  # the ratio's old log-prob is the rollout's
    minibatch_unit: int = field(default=1, init=False)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    def __post_init__(self) -> None:
        self._old: list[Tensor] | None = None  # the rollout policy's trainable tensors (mu_old's weights)
        self._refresh = True

    @property
    def reference(self) -> ReferenceModel:
        return "initial" if self.beta > 0 else "none"

    def prepare(self, batch: Trajectory) -> Trajectory:
        batch.advantages = clip_advantages(self.advantage_estimator(batch), self.adv_clip_max)
        self._refresh = True  # a new rollout: the next losses() copies the weights that produced it
        return batch

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        params = pipeline.trainable_parameters()
        fresh = self._refresh or self._old is None  # the first minibatch after a rollout: the weights are the old ones
        if fresh:
            self._old = [p.detach().clone() for p in params]
            self._refresh = False
        steps = choose_train_steps(batch.stochastic, self.timestep_fraction, self.timestep_order, generator)
        advantages = batch.advantages.to(batch.latents.device)
        valid = torch.isfinite(batch.rewards) if batch.rewards is not None else None
        for k in steps:
            x, x_next = batch.latents[:, k], batch.latents[:, k + 1]
            sigma, sigma_next = batch.sigmas[k], batch.sigmas[k + 1]
            out = sampler.step(pipeline.predict(x, sigma, batch.cond, batch.guidance_scale), x, sigma, sigma_next, x_next=x_next)
            if fresh:  # no optimizer step since the copy was taken: mu_old is this very forward's mean
                old_mean = out.mean.detach()
            else:
                with torch.no_grad(), swapped_weights(params, self._old):
                    old_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
                old_mean = sampler.step(old_output, x, sigma, sigma_next, x_next=x_next).mean
            kl = gaussian_kl(out.mean.detach(), old_mean, out.std, sampler.reduction)  # the std is the same for both
            old_log_prob = batch.log_probs[:, k].to(out.log_prob.device)
            loss, stats = divergence_masked_surrogate(out.log_prob, old_log_prob, advantages, kl, self.kl_threshold, valid)
            metrics = {"loss/policy": loss.detach(), **stats, **step_ratio_stats(out.log_prob.detach() - old_log_prob, valid, k)}
            if self.beta > 0:
                with torch.no_grad(), pipeline.reference():
                    ref_output = pipeline.predict(x, sigma, batch.cond, batch.guidance_scale)
                ref_mean = sampler.step(ref_output, x, sigma, sigma_next, x_next=x_next).mean
                ref_kl = masked_mean(gaussian_kl(out.mean, ref_mean, out.std, sampler.reduction), None if valid is None else valid.float())
                loss = loss + self.beta * ref_kl
                metrics["loss/kl"] = ref_kl.detach()
            yield LossOutput(loss=loss / len(steps), metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}  # the old policy is the weights of the iteration's rollout: a resumed run copies them again

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._old, self._refresh = None, True


class FlowDPPOConfig(ObjectiveSection, MultiRewardOption):
    """Flow-DPPO: GRPO's per-step ratio surrogate, no clip, with an exact-KL trust-region mask (docs/objectives/flow_dppo.md)."""

    name: str = "flow_dppo"
    # the authors' released code and recipe (UniRL: FlowDPPOConfig.kl_mask_threshold, sd3_flowdppo.yaml) and verl-omni:
    # 1e-5; every default's source is tabled in docs/objectives/flow_dppo.md ("Defaults and where they come from")
    kl_threshold: float = Field(
        1e-5,
        ge=0,
        description="Per-dimension KL(old || current) of a step above which a step that moved with its advantage is dropped "
        "(default: the authors' released code and recipe).",
    )
    std: StdConvention = std_option("global", "the authors: global")
    std_eps: float = std_eps_option(1e-4)
    adv_clip_max: float | None = Field(None, gt=0, description="Clip advantages to +-value; None: no clipping (the authors').")
    beta: float = Field(0.0, ge=0, description="Weight of the Gaussian KL to the frozen initial model (paper Eq. 17).")
    timestep_fraction: float = timestep_fraction_option()
    timestep_order: TimestepOrder = timestep_order_option()

    def build(self, context: BuildContext | None = None) -> FlowDPPOObjective:
        return self.with_group_advantages(FlowDPPOObjective, context)
