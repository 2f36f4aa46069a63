"""Rectified-flow reverse SDE samplers (Flow-GRPO, DanceGRPO, CPS, memoryless).

Notation (docs/math.md section 1): the model predicts velocity ``v``; ``x0_hat = x - sigma v`` and
``x1_hat = x + (1 - sigma) v``; ``dt = sigma_next - sigma < 0``. The marginal-preserving reverse SDE
with diffusion coefficient g has the Euler-Maruyama step

    score = -(x + (1 - sigma) v) / sigma
    mean  = x + dt (v - g^2 score / 2),   std = g sqrt(-dt)

Flow-GRPO: g = a sqrt(sigma / (1 - sigma)) (at sigma = 1 the denominator uses 1 - sigma_next, the
reference's ``sigma_max`` trick, written statelessly); DanceGRPO: g = eta, constant.
CPS (coefficient-preserving): std = sigma_next sin(a pi / 2),
mean = x0_hat (1 - sigma_next) + x1_hat sqrt(sigma_next^2 - std^2). flowrl scores CPS with the true
normalised Gaussian density (Flow-GRPO's CPS "log-prob" drops 1/(2 std^2) and the constants).
All step math runs in float32 whatever the model's dtype. ``sigma`` / ``sigma_next`` are scalars or one value
per sample, shape (B,) (objectives that draw a timestep per sample); a per-sample step equals, row by row,
the scalar step on that row, and its ``std`` is (B, 1, ..., 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..sections import SamplerSection
from ..types import StepOutput
from .log_prob import Reduction, as_sigma, finish_step


def flow_euler_step(v: Tensor, x: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """Deterministic probability-flow ODE step (sigma, sigma_next: scalars or one per sample)."""
    sigma, sigma_next = as_sigma(sigma, x), as_sigma(sigma_next, x)
    return x.float() + (sigma_next - sigma) * v.float()


@dataclass
class FlowSDESampler:
    """Euler-Maruyama on the marginal-preserving reverse SDE.

    noise_level: ``a`` of Flow-GRPO (0.7 for SD3.5-M) or the constant ``eta`` of DanceGRPO (0.3 FLUX).
    diffusion:   "flow_grpo" (g = a sqrt(sigma / (1 - sigma))) or "dance_grpo" (g = eta).
    """

    noise_level: float
    diffusion: Literal["flow_grpo", "dance_grpo"]
    reduction: Reduction
    name = "flow_sde"
    prediction_types = ("flow",)
    stochastic = True

    def diffusion_coefficient(self, sigma: Tensor, sigma_next: Tensor) -> Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        if self.diffusion == "dance_grpo":
            return torch.full_like(sigma, self.noise_level)
        one_minus = torch.where(sigma >= 1, 1 - torch.as_tensor(sigma_next, dtype=torch.float32), 1 - sigma)
        return self.noise_level * torch.sqrt(sigma / one_minus)

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        v, x = model_output.float(), x.float()
        sigma, sigma_next = as_sigma(sigma, x), as_sigma(sigma_next, x)
        dt = sigma_next - sigma
        g = self.diffusion_coefficient(sigma, sigma_next)
        score = -(x + (1 - sigma) * v) / sigma
        mean = x + dt * (v - 0.5 * g**2 * score)
        std = g * torch.sqrt(-dt)
        return finish_step(mean, std, x_next, generator, self.reduction)

    def deterministic_step(self, model_output, x, sigma, sigma_next) -> Tensor:
        return flow_euler_step(model_output, x, sigma, sigma_next)


def _bridge_step(model_output, x, sigma, sigma_next, std_of, x_next, generator, reduction: Reduction) -> StepOutput:
    """x_next = (1 - s') x0_hat + sqrt(s'^2 - std^2) x1_hat + std z (x0_hat = x - s v, x1_hat = x + (1 - s) v):
    the noise coefficient of x_next is exactly s'. CPS and the memoryless posterior differ only in
    ``std_of(sigma, sigma_next)``."""
    v, x = model_output.float(), x.float()
    sigma, sigma_next = as_sigma(sigma, x), as_sigma(sigma_next, x)
    x0_hat = x - sigma * v
    x1_hat = x + (1 - sigma) * v
    std = torch.as_tensor(std_of(sigma, sigma_next), dtype=torch.float32, device=x.device)
    mean = x0_hat * (1 - sigma_next) + x1_hat * torch.sqrt((sigma_next**2 - std**2).clamp(min=0))
    return finish_step(mean, std, x_next, generator, reduction)


def _memoryless_std(sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """s' sqrt(1 - r^2), r = (1 - s) s' / ((1 - s') s); then sqrt(s'^2 - std^2) = s' r."""
    r = ((1 - sigma) * sigma_next) / ((1 - sigma_next) * sigma)
    return sigma_next * torch.sqrt((1 - r**2).clamp(min=0))


@dataclass
class FlowCPSSampler:
    """Coefficient-preserving sampling: the noise added is exactly the noise the mean removes."""

    noise_level: float
    reduction: Reduction
    name = "flow_cps"
    prediction_types = ("flow",)
    stochastic = True

    def _std(self, sigma: Tensor, sigma_next: Tensor) -> Tensor:
        return sigma_next * math.sin(self.noise_level * math.pi / 2)

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        return _bridge_step(model_output, x, sigma, sigma_next, self._std, x_next, generator, self.reduction)

    def deterministic_step(self, model_output, x, sigma, sigma_next) -> Tensor:
        return flow_euler_step(model_output, x, sigma, sigma_next)


@dataclass
class FlowMemorylessSampler:
    """The memoryless reverse process of a rectified flow (Adjoint Matching's noise schedule), stepped exactly.

    Each step samples the Gaussian posterior q(x_{s'} | x_s, x0 = x0_hat) of the forward Markov chain whose
    marginals are the flow's x_sigma = (1 - sigma) x0 + sigma noise (DDPM's ancestral step, written for
    a flow). With r = (1 - s) s' / ((1 - s') s) in [0, 1]:

        std = s' sqrt(1 - r^2),   mean = (1 - s') x0_hat + s' r x1_hat

    Its continuous limit is the reverse SDE with g^2 = 2 sigma / (1 - sigma) (Flow-GRPO's g with a = sqrt 2),
    the schedule under which the start noise and the sample are independent (tested: std^2 / (g^2 |dt|) -> 1).
    Euler-Maruyama with that g is singular at sigma = 1 (its first step has std sqrt 2 and a mean that
    still depends on x); here the first step from sigma = 1 keeps nothing of x but x0_hat(x), which at
    sigma = 1 is the data mean: the start noise is forgotten exactly. The step into sigma = 0 is
    deterministic (x0_hat) and has no log-prob.
    """

    reduction: Reduction
    name = "flow_memoryless"
    prediction_types = ("flow",)
    stochastic = True

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        return _bridge_step(model_output, x, sigma, sigma_next, _memoryless_std, x_next, generator, self.reduction)

    def deterministic_step(self, model_output, x, sigma, sigma_next) -> Tensor:
        return flow_euler_step(model_output, x, sigma, sigma_next)


# -- config sections (sampler.name) ---------------------------------------------------------------------------
class FlowSDEConfig(SamplerSection):
    """Euler-Maruyama on the rectified flow's marginal-preserving reverse SDE (Flow-GRPO, DanceGRPO)."""

    name: str = "flow_sde"
    noise_level: float = Field(0.7, ge=0, description="Scale of the SDE's injected noise: Flow-GRPO's a, or DanceGRPO's eta.")
    diffusion: Literal["flow_grpo", "dance_grpo"] = Field(
        "flow_grpo", description="The diffusion coefficient: flow_grpo g = a sqrt(sigma / (1 - sigma)), dance_grpo g = eta."
    )
    reduction: Reduction = Field(
        "mean", description="How a step's log-prob is reduced over the non-batch dimensions: mean (every reference) or sum."
    )
    prediction_types: ClassVar[tuple[str, ...]] = ("flow",)

    def build(self, pipeline: Any = None) -> FlowSDESampler:
        return FlowSDESampler(noise_level=self.noise_level, diffusion=self.diffusion, reduction=self.reduction)


class FlowCPSConfig(SamplerSection):
    """Coefficient-preserving sampling (CPS)."""

    name: str = "flow_cps"
    noise_level: float = Field(0.7, ge=0, le=1, description="CPS's a: the step's noise std is sigma_next * sin(a * pi / 2).")
    reduction: Reduction = Field(
        "mean", description="How a step's log-prob is reduced over the non-batch dimensions: mean (every reference) or sum."
    )
    prediction_types: ClassVar[tuple[str, ...]] = ("flow",)

    def build(self, pipeline: Any = None) -> FlowCPSSampler:
        return FlowCPSSampler(noise_level=self.noise_level, reduction=self.reduction)


class FlowMemorylessConfig(SamplerSection):
    """The memoryless reverse process of a rectified flow (Adjoint Matching's schedule), exact posterior steps."""

    name: str = "flow_memoryless"
    reduction: Reduction = Field(
        "mean", description="How a step's log-prob is reduced over the non-batch dimensions: mean (every reference) or sum."
    )
    prediction_types: ClassVar[tuple[str, ...]] = ("flow",)

    @property
    def memoryless(self) -> bool:
        return True

    def build(self, pipeline: Any = None) -> FlowMemorylessSampler:
        return FlowMemorylessSampler(reduction=self.reduction)
