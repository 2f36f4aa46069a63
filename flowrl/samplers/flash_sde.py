"""Flash-GRPO's SDE step (Flash-GRPO, arXiv:2605.15980; Shredded-Pork/Flash-GRPO,
``flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob2.py::sde_step_with_logprob``).

The Euler-Maruyama step of the rectified flow's marginal-preserving reverse SDE, as Flow-GRPO's
(``flow_sde.FlowSDESampler``), with a diffusion coefficient that grows linearly with sigma between a floor and a
ceiling:

    g(sigma) = floor + (ceiling - floor) sigma
    mean     = x + dt (v + g^2 / (2 sigma) (x + (1 - sigma) v)),   std = g sqrt(-dt)

The released code takes the floor and the ceiling from its scheduler's grid (``sigmas[-1]`` and ``sigmas[1]``: 0 and
the second sigma of its 20-step shifted grid); a sampler here is stateless, so they are config numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator

from ..sections import SamplerSection
from ..types import StepOutput
from .flow_sde import flow_euler_step
from .log_prob import Reduction, as_sigma, finish_step


@dataclass
class FlashSDESampler:
    """Flow-GRPO's SDE step with g(sigma) = noise_floor + (noise_ceiling - noise_floor) * sigma."""

    noise_floor: float
    noise_ceiling: float
    reduction: Reduction
    name = "flash_sde"
    prediction_types = ("flow",)
    stochastic = True

    def diffusion_coefficient(self, sigma: torch.Tensor) -> torch.Tensor:
        return self.noise_floor + (self.noise_ceiling - self.noise_floor) * torch.as_tensor(sigma, dtype=torch.float32)

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        v, x = model_output.float(), x.float()
        sigma, sigma_next = as_sigma(sigma, x), as_sigma(sigma_next, x)
        dt = sigma_next - sigma
        g = self.diffusion_coefficient(sigma)
        mean = x + dt * (v + g**2 / (2 * sigma) * (x + (1 - sigma) * v))
        std = g * torch.sqrt(-dt)
        return finish_step(mean, std, x_next, generator, self.reduction)

    def deterministic_step(self, model_output, x, sigma, sigma_next) -> torch.Tensor:
        return flow_euler_step(model_output, x, sigma, sigma_next)


class FlashSDEConfig(SamplerSection):
    """``sampler.name: flash_sde``: Flash-GRPO's SDE (docs/objectives/flash_grpo.md), noise growing linearly with sigma."""

    name: str = "flash_sde"
    noise_floor: float = Field(0.0, ge=0, description="g at sigma = 0 (the released code: its grid's last sigma, 0).")
    noise_ceiling: float = Field(
        0.7, gt=0, description="g at sigma = 1 (the released code: its grid's second sigma, about 0.99 on Wan's shifted 20-step grid)."
    )
    reduction: Reduction = Field(
        "mean", description="How a step's log-prob is reduced over the non-batch dimensions: mean (every reference) or sum."
    )
    prediction_types: ClassVar[tuple[str, ...]] = ("flow",)

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> FlashSDEConfig:
        if self.noise_floor > self.noise_ceiling:
            raise ValueError(f"sampler.noise_floor ({self.noise_floor}) must not exceed sampler.noise_ceiling ({self.noise_ceiling})")
        return self

    def build(self, pipeline: Any = None) -> FlashSDESampler:
        return FlashSDESampler(noise_floor=self.noise_floor, noise_ceiling=self.noise_ceiling, reduction=self.reduction)
