"""Direct Group Preference Optimization (Luo, Hu, Tang; ICLR 2026, arXiv:2510.08425): DPO between the better and the
worse half of each prompt group, on the denoising loss; no per-step likelihoods, so any sampler rolls out (the ODE).

Conventions: sigma in [0, 1], 1 = noise, 0 = data. For a rectified flow ``x_sigma = (1 - sigma) x0 + sigma eps``
and the target is the velocity ``eps - x0``; a diffusion model regresses its own target (epsilon or v) at
``x_sigma = sqrt(a) x0 + sqrt(1 - a) eps`` (``diffusion_dpo.noised_and_target``).

The paper's idea: GRPO works because it compares the samples of one prompt, not because of the policy gradient. Split
a group into the samples that beat the group mean (G+) and those that do not (G-), and fit a Bradley-Terry
preference of G+ over G- with DPO's implicit reward. Weighting each sample by its group advantage A (A > 0 in G+,
A < 0 in G-; the weights of G+ and G- match because the advantages of a group sum to zero) and using Diffusion-DPO's
estimate of the log-likelihood ratio, ``log p_theta(x) / p_ref(x) ~ -(l_theta(x) - l_ref(x))`` with l the denoising
loss at a drawn (sigma, eps), the group's preference margin is ``-S_g`` with

    S_g = beta * (1 / n_g) * sum_{i in g} A_i (l_theta(x_i) - l_ref(x_i)),

and the loss of a group is ``-log sigmoid(-S_g)``. flowrl divides it by beta, as the authors' code does in effect
(their surrogate ``mean_B sg(sigmoid(S_g)) A_i l_i`` has exactly this gradient), so beta sets how soon a group counts
as learnt (its weight sigmoid(S_g) falls from 1/2 towards 0) without scaling the step:

    L = mean over groups of -log sigmoid(-S_g) / beta,     dL/dl_i = sigmoid(S_g) A_i / B   (equal groups).

So DGPO is AWM's advantage-weighted denoising loss with a per-group weight that switches a group off once the model
prefers its good samples over the reference by a margin: a built-in trust region towards the frozen initial model.

Choices, as flowrl makes them (docs/objectives/dgpo.md compares them with the authors' code):
- Advantages: group mean, std over the whole batch + 1e-4 (``std: global``), clipped to +-adv_clip_max (5); any
  ``multi_reward`` form (objectives/advantages.py).
- Times: the rollout's own grid sigma_0 .. sigma_{K-1} (sigma = 0, the data itself, excluded), only those
  >= ``min_sigma`` (the paper's timestep clip: the low-noise end is where ODE samples differ least from the model's
  own fit, and fitting it adds nothing), ``num_times`` distinct times per group, one backward each. Every sample of a
  group is noised at the same time with the same noise (``shared_noise``, the authors'), so the l_theta - l_ref of
  a group are compared at one (sigma, eps).
- Whole groups per minibatch (``minibatch_unit`` = the group size), since S_g sums over the group.
- ``kl_weight`` > 0 adds kl_weight * mean((u_theta - u_ref)^2), the prediction-space MSE to the frozen reference at
  the same (x_sigma, sigma) (the authors' ``train.beta``); the reference forward is already there for S_g.
- ``clip_range``: the authors' later PPO-style clip (not in the paper): with the denoising-loss "ratio"
  ``r = exp(l_old - l_theta)``, a sample whose r left [1 - c, 1 + c] in the direction of its advantage stops
  contributing a gradient. The old weights are those that produced the rollout (copied at the first minibatch after
  it, as Flow-DPPO's); one extra no-grad forward per time, except in that first minibatch. None: the paper's loss.
- Non-finite rewards get advantage 0, so they drop out of S_g and of the gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.forward_process import noised_and_target
from ..sections import BuildContext, ObjectiveSection
from ..types import LossOutput, Pipeline, ReferenceModel, Role, Sampler, TrainingData, Trajectory
from .advantages import GroupAdvantages, MultiRewardOption, clip_advantages, std_eps_option, std_option
from .diffusion_nft import swapped_weights
from .functional import StdConvention, masked_mean


def group_margins(err: Tensor, ref_err: Tensor, advantages: Tensor, group_ids: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """``S_g = beta * (1 / n_g) * sum_{i in g} A_i (err_i - ref_err_i)`` for each group present (n_g its rows), and
    each row's group index into them. Returns ((G,), (B,))."""
    groups, row_group = torch.unique(group_ids.to(err.device), return_inverse=True)
    counts = torch.bincount(row_group, minlength=len(groups)).to(err.dtype)
    terms = advantages.to(err.device, err.dtype) * (err - ref_err)
    sums = torch.zeros(len(groups), dtype=err.dtype, device=err.device).index_add(0, row_group, terms)
    return beta * sums / counts, row_group


def dgpo_loss(err: Tensor, ref_err: Tensor, advantages: Tensor, group_ids: Tensor, beta: float) -> Tensor:
    """DGPO's per-group loss ``-log sigmoid(-S_g) / beta`` (``group_margins``); ``err`` and ``ref_err`` (B,) are the
    model's and the reference's denoising losses at the same (x_sigma, sigma). log(2) / beta while the model is the
    reference; below it exactly when the model fits the group's better samples better than the reference does,
    relative to its worse ones. Returns (G,), one per group in ``torch.unique(group_ids)`` order."""
    margins, _ = group_margins(err, ref_err, advantages, group_ids, beta)
    return -torch.nn.functional.logsigmoid(-margins) / beta


def clipped_denoising_loss(err: Tensor, old_err: Tensor, advantages: Tensor, clip_range: float) -> tuple[Tensor, Tensor]:
    """The authors' PPO-style clip on the denoising loss: with ``r = exp(old_err - err)``, a sample whose r is above
    1 + c with A > 0, or below 1 - c with A <= 0, keeps its value but loses its gradient. Returns (err, clipped mask)."""
    ratio = torch.exp(old_err - err.detach())
    clipped = torch.where(advantages.to(err.device) > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(clipped, err.detach(), err), clipped


@dataclass
class DGPOObjective:
    advantage_estimator: GroupAdvantages
    beta: float
    adv_clip_max: float | None
    num_times: int
    min_sigma: float
    shared_noise: bool
    kl_weight: float
    clip_range: float | None
    minibatch_unit: int  # the group size: S_g sums over a whole group, so groups are never split across minibatches
    name: str = field(default="dgpo", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=False, init=False)  # any sampler, the ODE included
    reference: ReferenceModel = field(default="initial", init=False)  # the DPO reference: the frozen initial model
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    def __post_init__(self) -> None:
        self._old: list[Tensor] | None = None  # clip_range: the rollout policy's trainable tensors
        self._refresh = True

    def prepare(self, batch: Trajectory) -> Trajectory:
        batch.advantages = clip_advantages(self.advantage_estimator(batch), self.adv_clip_max)
        self._refresh = True  # a new rollout: the next losses() copies the weights that produced it
        return batch

    def _grid(self, sigmas: Tensor) -> Tensor:
        grid = sigmas[:-1].float()
        grid = grid[grid >= self.min_sigma]
        if grid.numel() == 0:
            raise FlowRLError(
                f"objective 'dgpo' has no rollout time at or above objective.min_sigma={self.min_sigma}; lower it or use more rollout steps."
            )
        return grid

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        params = pipeline.trainable_parameters()
        fresh = self._refresh or self._old is None
        if self.clip_range is not None and fresh:
            self._old = [p.detach().clone() for p in params]
        self._refresh = False
        x0 = batch.latents[:, -1].float()
        device = x0.device
        grid = self._grid(batch.sigmas.cpu())
        groups, row_group = torch.unique(batch.group_ids.cpu(), return_inverse=True)
        count = min(self.num_times, grid.numel())
        chosen = torch.stack([torch.randperm(grid.numel(), generator=generator)[:count] for _ in range(len(groups))])  # (G, count)
        advantages = batch.advantages.to(device).float()
        valid = torch.isfinite(batch.rewards).to(device).float() if batch.rewards is not None else None
        for j in range(count):
            sigma = grid[chosen[row_group, j]].to(device)  # one time per group
            noise = torch.randn((len(groups) if self.shared_noise else len(batch), *x0.shape[1:]), generator=generator)
            noise = (noise[row_group] if self.shared_noise else noise).to(device)
            x_t, target = noised_and_target(pipeline, x0, noise, sigma)
            with torch.no_grad(), pipeline.reference():
                ref_pred = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
            pred = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
            err = (pred - target).pow(2).flatten(1).mean(1)
            ref_err = (ref_pred - target).pow(2).flatten(1).mean(1)
            metrics: dict[str, Tensor] = {}
            if self.clip_range is not None:
                if fresh:  # no optimizer step since the copy: the old loss is this very forward's
                    old_err = err.detach()
                else:
                    with torch.no_grad(), swapped_weights(params, self._old):
                        old_pred = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
                    old_err = (old_pred - target).pow(2).flatten(1).mean(1)
                err, clipped = clipped_denoising_loss(err, old_err, advantages, self.clip_range)
                metrics["dgpo/clipped"] = masked_mean(clipped.float(), valid)
            per_group = dgpo_loss(err, ref_err, advantages, batch.group_ids, self.beta)
            loss = per_group.mean()
            with torch.no_grad():
                margins, _ = group_margins(err, ref_err, advantages, batch.group_ids, self.beta)
                metrics |= {
                    "loss/policy": loss.detach(),
                    "dgpo/group_weight": torch.sigmoid(margins).mean(),  # 1/2 at the reference, -> 0 once a group is learnt
                    "dgpo/margin": (-margins).mean(),  # the groups' mean preference margin R(G+) - R(G-)
                    "dgpo/matching_mse": masked_mean(err.detach(), valid),
                }
            if self.kl_weight > 0:
                kl = masked_mean((pred - ref_pred).pow(2).flatten(1).mean(1), valid)
                loss = loss + self.kl_weight * kl
                metrics["loss/kl"] = kl.detach()
            yield LossOutput(loss / count, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}  # the reference is the initial model; the clip's old weights are the iteration's rollout weights

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._old, self._refresh = None, True


class DGPOConfig(ObjectiveSection, MultiRewardOption):
    """DGPO: a group-level DPO of each prompt group's better samples over its worse ones, on the denoising loss
    (docs/objectives/dgpo.md)."""

    name: str = "dgpo"
    beta: float = Field(100.0, gt=0, description="DPO temperature of the group margin (the authors: 100; 10 to 100).")
    std: StdConvention = std_option("global", "the authors: global")
    std_eps: float = std_eps_option(1e-4)
    adv_clip_max: float | None = Field(5.0, gt=0, description="Clip advantages to +-value (the authors: 5); None: no clipping.")
    num_times: int = Field(4, ge=1, description="Rollout grid times per group and minibatch, one backward each (the authors: 4).")
    min_sigma: float = Field(0.0, ge=0, le=1, description="Timestep clip: train only at grid times with sigma >= this (the authors: 0.82).")
    shared_noise: bool = Field(True, description="One noise per group at each time (the authors'); false: one per sample.")
    kl_weight: float = Field(0.0, ge=0, description="Weight of the prediction MSE to the frozen reference (the authors: 0 to 0.02).")
    clip_range: float | None = Field(
        None, gt=0, description="The authors' PPO-style clip of the denoising loss (1e-2); None: the paper's loss."
    )

    def check_run(self, config: Any) -> None:
        tc = config.train
        if tc.batch_size % tc.num_generations:
            raise ValueError(
                f"objective dgpo compares whole prompt groups: train.batch_size ({tc.batch_size}) must be a multiple of "
                f"train.num_generations ({tc.num_generations})"
            )

    def build(self, context: BuildContext | None = None) -> DGPOObjective:
        return self.with_group_advantages(DGPOObjective, context, minibatch_unit=context.group_size if context is not None else 1)
