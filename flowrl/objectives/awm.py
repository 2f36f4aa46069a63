"""Advantage Weighted Matching (Xue et al. 2025, arXiv:2509.25050): the pretraining loss, weighted by the advantage.

Conventions: sigma in [0, 1], 1 = noise, 0 = data. For a rectified flow ``x_sigma = (1 - sigma) x0 + sigma eps`` and
the regression target is the velocity ``eps - x0``; a diffusion model regresses its own target (epsilon or v) at
``x_sigma = sqrt(a) x0 + sqrt(1 - a) eps`` (``diffusion_dpo.noised_and_target``).

The rollout policy produces clean samples x0 with any sampler (the ODE, an SDE, DDIM: no transition log-probs are
recorded or needed). Each sample gets its group advantage A (as GRPO's). For ``num_times`` draws per sample of a
time sigma and fresh noise eps, the loss is the model's own denoising loss on its own sample, weighted by A:

    L(theta) = mean_B [ A * w(l, sigma) ],   l = mean over dims of (u_theta(x_sigma, sigma) - target)^2

averaged over the draws (one backward per draw). With ``weighting: uniform`` w(l, sigma) = l: a positive advantage
pulls the model towards reproducing the sample (lower loss on it), a negative one pushes it away; the advantages
of a group sum to zero, so the pull of the group's mean sample cancels. The paper shows this is DDPO's policy
gradient with the noisy single-step target replaced by the clean pretraining target (lower variance).

Choices, as flowrl makes them (docs/objectives/awm.md compares them with the authors' code):
- Advantages: group mean, std over the whole batch + 1e-4 (``std: global``, the authors'), clipped to +-adv_clip_max;
  several rewards combine as ``multi_reward`` says (objectives/advantages.py).
- Times: ``uniform``: the model's training times (flow: sigma ~ U(0, 1]); ``grid``: the rollout's own interior grid
  times sigma_1 .. sigma_{K-1} (neither pure noise nor data), a random subset per sample.
- Weighting: ``uniform`` (w = l), ``t`` (w = sigma l) or ``ghuber`` (the authors' default:
  w = sigma ((l + 1e-10)^p - 1e-10^p) / p, a generalised Huber that damps samples the model fits badly).
- ``beta`` > 0 adds beta * mean((u_theta - u_ref)^2), the velocity-space MSE to the frozen initial model at the same
  (x_sigma, sigma) (the authors' "Uniform" KL); no EMA-policy term.
- Non-finite rewards are left out of the loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from ..samplers.forward_process import noised_and_target, training_sigmas
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .advantages import GroupAdvantages, MultiRewardOption, clip_advantages, std_eps_option, std_option
from .functional import StdConvention, masked_mean
from .stateless import Stateless

TimeSampling = Literal["uniform", "grid"]
Weighting = Literal["uniform", "t", "ghuber"]
GHUBER_EPS = 1e-10


def matching_weight(err: Tensor, sigma: Tensor, weighting: Weighting, power: float) -> Tensor:
    """w(l, sigma) of the per-sample matching loss l (B,) at times sigma (B,): ``uniform`` l, ``t`` sigma l,
    ``ghuber`` sigma ((l + 1e-10)^p - 1e-10^p) / p."""
    if weighting == "uniform":
        return err
    sigma = sigma.to(err.device, err.dtype)
    if weighting == "t":
        return sigma * err
    return sigma * ((err + GHUBER_EPS) ** power - GHUBER_EPS**power) / power


def awm_loss(pred: Tensor, target: Tensor, advantages: Tensor, sigma: Tensor, weighting: Weighting, power: float) -> Tensor:
    """Per-sample A * w(l, sigma), l = mean over every non-batch dimension of (pred - target)^2. Returns (B,)."""
    err = (pred.float() - target.float()).pow(2).flatten(1).mean(1)
    return advantages.to(err.device).float() * matching_weight(err, sigma, weighting, power)


@dataclass
class AWMObjective(Stateless):
    advantage_estimator: GroupAdvantages
    adv_clip_max: float | None
    num_times: int
    time_sampling: TimeSampling
    weighting: Weighting
    ghuber_power: float
    beta: float
    name: str = field(default="awm", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=False, init=False)  # any sampler, the ODE included
    minibatch_unit: int = field(default=1, init=False)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    @property
    def reference(self) -> ReferenceModel:
        return "initial" if self.beta > 0 else "none"

    def prepare(self, batch: Trajectory) -> Trajectory:
        batch.advantages = clip_advantages(self.advantage_estimator(batch), self.adv_clip_max)
        return batch

    def _times(self, pipeline: Pipeline, batch: Trajectory, generator: torch.Generator) -> Tensor:
        """(num_times, B) training times, one column per sample."""
        n = len(batch)
        if self.time_sampling == "uniform":
            return torch.stack([training_sigmas(pipeline, n, generator) for _ in range(self.num_times)])
        grid = batch.sigmas.cpu().float()[1:-1]  # interior grid points: neither pure noise nor data
        if grid.numel() == 0:
            grid = batch.sigmas.cpu().float()[:1]  # a one-step rollout: its start time
        count = min(self.num_times, grid.numel())
        chosen = torch.stack([torch.randperm(grid.numel(), generator=generator)[:count] for _ in range(n)])  # (B, count)
        return grid[chosen].T

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        x0 = batch.latents[:, -1].float()
        device = x0.device
        times = self._times(pipeline, batch, generator)
        valid = torch.isfinite(batch.rewards).to(device).float() if batch.rewards is not None else None
        advantages = batch.advantages.to(device)
        for sigma in times:
            sigma = sigma.to(device)
            noise = torch.randn(x0.shape, generator=generator).to(device)
            x_t, target = noised_and_target(pipeline, x0, noise, sigma)
            pred = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
            loss = masked_mean(awm_loss(pred, target, advantages, sigma, self.weighting, self.ghuber_power), valid)
            metrics = {
                "loss/policy": loss.detach(),
                "awm/matching_mse": masked_mean((pred.detach() - target).pow(2).flatten(1).mean(1), valid),
            }
            if self.beta > 0:
                with torch.no_grad(), pipeline.reference():
                    ref = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
                kl = masked_mean((pred - ref).pow(2).flatten(1).mean(1), valid)
                loss = loss + self.beta * kl
                metrics["loss/kl"] = kl.detach()
            yield LossOutput(loss / len(times), metrics)


class AWMConfig(ObjectiveSection, MultiRewardOption):
    """Advantage Weighted Matching: the denoising (flow-matching) loss on the rollouts' clean samples, weighted by the advantage."""

    name: str = "awm"
    std: StdConvention = std_option("global", "the authors: global")
    std_eps: float = std_eps_option(1e-4)
    adv_clip_max: float | None = Field(5.0, gt=0, description="Clip advantages to +-value (the authors: 5); None: no clipping.")
    num_times: int = Field(6, ge=1, description="(time, noise) draws per sample, one backward each (the authors: 6).")
    time_sampling: TimeSampling = Field(
        "uniform", description="uniform: the model's training times; grid: the rollout's interior grid times."
    )
    weighting: Weighting = Field(
        "uniform", description="The loss weight w(l, sigma): uniform l, t sigma l, or ghuber (the authors' default)."
    )
    ghuber_power: float = Field(0.25, gt=0, le=1, description="p of the ghuber weighting.")
    beta: float = Field(0.0, ge=0, description="Weight of the velocity MSE to the frozen initial model (the authors: 1e-3 to 3e-3).")

    def build(self, context: BuildContext | None = None) -> AWMObjective:
        return self.with_group_advantages(AWMObjective, context)
