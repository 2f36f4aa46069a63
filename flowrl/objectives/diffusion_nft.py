"""DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117): online RL on the forward process, no likelihoods.

Conventions: sigma in [0, 1], 1 = noise, 0 = data. For a rectified flow ``x_sigma = (1 - sigma) x0 + sigma eps``
and the velocity target is ``v = eps - x0``; the data estimate of a prediction ``u`` is ``x0_hat = x_sigma - sigma u``.

The rollout policy pi_old generates clean samples x0 with any sampler (SDE, DDIM, or the deterministic ODE:
only x0 is used, never a transition density). Each sample gets an optimality probability r in [0, 1].
With the old velocity ``v_old`` (frozen, no gradient) and the trained ``v_theta``, the implicit policies are

    v_plus  = (1 - beta) v_old + beta v_theta          (positive: pi_old tilted towards high reward)
    v_minus = (1 + beta) v_old - beta v_theta          (negative: the mirror image)

and the loss is plain flow matching of both against the sample's forward-process target, weighted by r:

    L(theta) = E_{x0 ~ pi_old, sigma, eps} [ r l(v_plus) + (1 - r) l(v_minus) ] / beta.

At the optimum ``v_theta = v_old + (2 / beta) Delta`` with ``Delta`` the reward-induced direction
(E[(2r - 1) v | x_sigma] / 2 when x0 ~ pi_old); for r = 1/2 everywhere the minimiser is v_old itself.
Sampling afterwards uses v_theta alone, so there is no guidance term to train (CFG-free).

Choices the paper leaves open or states only in its code, as flowrl makes them:
- Optimality probability: ``r = clip(1/2 + A / (2 A_max), 0, 1)`` with A the group advantage of the reward
  (``std="global"``: (R - mean of the prompt's group) / (std over the whole batch + eps), the authors'
  setting; other conventions as GRPO's) and A_max = ``adv_clip_max`` (5); several rewards combine as
  ``multi_reward`` says (objectives/advantages.py). Samples with a non-finite reward are left out of the loss.
- beta = 1 by default (the authors' GenEval / PickScore / HPSv2 setting; 0.1 for OCR).
- Times: each sample is trained at ``timestep_fraction`` (0.99 -> 9 of 10) of the rollout's own time grid
  points sigma_0..sigma_{K-1} (sigma = 0 excluded), a random subset per sample, with fresh noise eps per
  time. One backward per time, so memory does not grow with the number of times.
- Loss weighting: the paper's adaptive weight. ``l(u) = mean((x0_hat(u) - x0)^2) / sg(max(mean|x0_hat(u) - x0|,
  1e-5))``, means over every non-batch dimension, computed in x0 space. (The authors' code also multiplies the
  loss by A_max, a constant that Adam ignores except through gradient clipping; flowrl does not.)
- Old policy: a copy of the trained weights kept by the objective and soft-updated once per iteration,
  ``theta_old <- eta theta_old + (1 - eta) theta`` with ``eta = min(old_decay_rate * optimizer_steps,
  old_decay_max)``. flowrl's default ``old_decay_rate = 0`` makes theta_old exactly the weights that produced
  the iteration's rollouts (fully on-policy). With a positive rate (the authors use 0.001 up to 0.5 on SD3.5)
  theta_old trails theta; flowrl's loop still rolls out with theta (the authors sample with theta_old), so
  theta_old then acts as a slowly moving anchor, and a resumed run restarts theta_old from the checkpoint.
- KL-free: no term towards the initial model (the authors' code adds a 1e-4 velocity-MSE to it; not here).
- Diffusion (DDPM) models work too: the mixture is taken in model-output space (epsilon or v), which is
  affine in x0_hat at fixed (x_sigma, sigma), and the loss is the same x0-space weighting with
  ``x0_hat - x0 = -c(sigma) (u - target)``, c = sigma (flow), sqrt((1 - a)/a) (epsilon), sqrt(1 - a) (v).
  Grid times where an epsilon model has no x0 estimate (alpha-bar = 0, zero-terminal-SNR) are not trained.
"""

from __future__ import annotations

import contextlib
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
from .advantages import GroupAdvantages, MultiRewardOption, std_eps_option, std_option
from .functional import StdConvention, masked_mean


def optimality_probability(advantages: Tensor, adv_clip_max: float) -> Tensor:
    """r = clip(1/2 + A / (2 A_max), 0, 1): the advantage clipped to [-A_max, A_max] mapped onto [0, 1]."""
    return (0.5 + 0.5 * advantages.float() / adv_clip_max).clamp(0.0, 1.0)


def implicit_policies(out: Tensor, out_old: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """(positive, negative) = ((1 - beta) old + beta theta, (1 + beta) old - beta theta)."""
    return (1 - beta) * out_old + beta * out, (1 + beta) * out_old - beta * out


def adaptive_x0_loss(x0_error: Tensor, min_weight: float = 1e-5) -> Tensor:
    """Per-sample mean(e^2) / sg(max(mean|e|, min_weight)) over every non-batch dimension (the paper's weighting)."""
    e = x0_error.flatten(1)
    return e.pow(2).mean(1) / e.detach().abs().mean(1).clamp(min=min_weight)


def x0_error_scale(pipeline: Pipeline, sigma: Tensor) -> Tensor:
    """c(sigma) with x0_hat - x0 = -c (u - target) for a model output u: sigma (flow), sqrt((1 - a) / a)
    (epsilon), sqrt(1 - a) (v-prediction), a = alpha-bar(sigma)."""
    if pipeline.prediction_type == "flow":
        return sigma.float()
    a = pipeline.schedule.alpha_bar64(sigma)
    return ((1 - a) / a).sqrt().float() if pipeline.prediction_type == "epsilon" else (1 - a).sqrt().float()


def nft_loss(out: Tensor, out_old: Tensor, target: Tensor, scale: Tensor, r: Tensor, beta: float) -> Tensor:
    """Per-sample [r l(plus) + (1 - r) l(minus)] / beta, with l the adaptive x0-space loss."""
    plus, minus = implicit_policies(out, out_old, beta)
    c = scale.view((-1,) + (1,) * (out.ndim - 1))
    return (r * adaptive_x0_loss(c * (plus - target)) + (1 - r) * adaptive_x0_loss(c * (minus - target))) / beta


@contextlib.contextmanager
def swapped_weights(params: list[torch.nn.Parameter], values: list[Tensor]):
    """Inside, every parameter holds the given tensor (a pointer swap, no copy); restored on exit."""
    saved = [p.data for p in params]
    try:
        for p, v in zip(params, values):
            p.data = v
        yield
    finally:
        for p, s in zip(params, saved):
            p.data = s


@dataclass
class DiffusionNFTObjective:
    beta: float
    advantage_estimator: GroupAdvantages
    adv_clip_max: float
    timestep_fraction: float
    old_decay_rate: float
    old_decay_max: float
    name: str = field(default="diffusion_nft", init=False)
    trains_on: TrainingData = field(default="rollouts", init=False)
    needs_log_probs: bool = field(default=False, init=False)  # any sampler, the ODE included
    reference: ReferenceModel = field(default="none", init=False)  # the old policy is the objective's own copy
    minibatch_unit: int = field(default=1, init=False)
    roles: tuple[Role, ...] = field(default=(), init=False)  # the policy alone

    def __post_init__(self) -> None:
        self._old: list[Tensor] | None = None
        self._refresh = True
        self.optimizer_steps = 0

    def prepare(self, batch: Trajectory) -> Trajectory:
        adv = self.advantage_estimator(batch)
        batch.advantages = optimality_probability(adv, self.adv_clip_max)
        self._refresh = True  # a new rollout: the next losses() soft-updates the old policy first
        return batch

    def _update_old(self, params: list[torch.nn.Parameter]) -> None:
        eta = min(self.old_decay_rate * self.optimizer_steps, self.old_decay_max)
        if self._old is None or eta == 0:
            self._old = [p.detach().clone() for p in params]
            return
        for old, p in zip(self._old, params):
            old.mul_(eta).add_(p.detach(), alpha=1 - eta)

    def _times(self, pipeline: Pipeline, sigmas: Tensor) -> Tensor:
        grid = sigmas[:-1].float()
        if pipeline.prediction_type == "epsilon":
            grid = grid[torch.isfinite(x0_error_scale(pipeline, grid))]
        if grid.numel() == 0:
            raise FlowRLError("objective 'diffusion_nft' has no time of the rollout grid to train on; use more rollout steps.")
        return grid

    def losses(self, pipeline: Pipeline, sampler: Sampler, batch: Trajectory, generator: torch.Generator) -> Iterator[LossOutput]:
        params = pipeline.trainable_parameters()
        with torch.no_grad():
            if self._refresh:
                self._update_old(params)
                self._refresh = False
        x0 = batch.latents[:, -1].float()
        device, n = x0.device, len(batch)
        grid = self._times(pipeline, batch.sigmas.cpu())
        count = max(1, int(self.timestep_fraction * grid.numel()))
        chosen = torch.stack([torch.randperm(grid.numel(), generator=generator)[:count] for _ in range(n)])  # (B, count)
        valid = torch.isfinite(batch.rewards).to(device) if batch.rewards is not None else None
        r = batch.advantages.to(device).float()
        for j in range(count):
            sigma = grid[chosen[:, j]].to(device)
            noise = torch.randn(x0.shape, generator=generator).to(device)
            x_t, target = noised_and_target(pipeline, x0, noise, sigma)
            with torch.no_grad(), swapped_weights(params, self._old):
                out_old = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
            out = pipeline.predict(x_t, sigma, batch.cond, batch.guidance_scale).float()
            per_sample = nft_loss(out, out_old, target, x0_error_scale(pipeline, sigma), r, self.beta)
            loss = masked_mean(per_sample, valid) / count
            yield LossOutput(
                loss,
                {
                    "loss/policy": loss.detach() * count,
                    "nft/r_mean": masked_mean(r, valid).detach(),
                    "nft/old_deviation": (out - out_old).detach().pow(2).mean(),
                },
            )
        self.optimizer_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps}  # theta_old itself restarts from the checkpoint's weights

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self._old, self._refresh = None, True


class DiffusionNFTConfig(ObjectiveSection, MultiRewardOption):
    """DiffusionNFT: flow matching of implicit positive / negative policies on the rollouts' clean samples (no log-probs)."""

    name: str = "diffusion_nft"
    beta: float = Field(1.0, gt=0, description="Implicit-policy mixing strength (the authors: 1; 0.1 for OCR).")
    std: StdConvention = std_option("global", "the authors: global")
    std_eps: float = std_eps_option(1e-4)
    adv_clip_max: float = Field(5.0, gt=0, description="A_max of the optimality probability r = clip(1/2 + A / (2 A_max), 0, 1).")
    timestep_fraction: float = Field(
        0.99, gt=0, le=1, description="Fraction of the rollout grid's times each sample is trained at (a random subset)."
    )
    old_decay_rate: float = Field(
        0.0, ge=0, description="Old-policy soft update eta = min(rate * optimizer steps, old_decay_max); 0: the rollout weights."
    )
    old_decay_max: float = Field(0.5, ge=0, lt=1, description="The largest eta of the old policy's soft update.")

    def build(self, context: BuildContext | None = None) -> DiffusionNFTObjective:
        return self.with_group_advantages(DiffusionNFTObjective, context)
