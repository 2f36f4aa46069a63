"""DDIM / DDPM step with log-prob (DDPO, D3PO), for epsilon- and v-prediction models.

docs/math.md section 2, with a_t = alpha_bar(sigma), a_prev = alpha_bar(sigma_next):

    x0_hat = (x - sqrt(1 - a_t) eps) / sqrt(a_t)          (optionally clipped)
    var    = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std    = eta sqrt(var)
    mean   = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - std^2) eps

eta = 1 is DDPM-equivalent (the DDPO default), eta = 0 deterministic DDIM. A v-prediction output is
converted first: eps = sqrt(a_t) v + sqrt(1 - a_t) x. With ``final_alpha_cumprod = 1`` the last step
(to sigma = 0) has var = 0 and is deterministic, so it carries no log-prob.

Precision: the coefficients (sqrt a_t, sqrt(1 - a_t), sqrt a_prev, sqrt(1 - a_prev - std^2), std) come from
the float64 alpha-bar table in float64, and the step itself (x0_hat, mean, the sampled x_next and its
log-prob) runs in float64 on the float32 inputs; x_next, mean, std and log-prob are rounded to float32 once,
at the end. Near t = 0, 1 - a_t and 1 - a_t / a_prev are differences of numbers within 1e-3 of 1: from a
float32 alpha-bar they lost up to 1e-4 of the std and 1e-5 of the log-prob; and with a float32 mean the
log-prob of a step whose std is ~1e-2 still moves by ~1e-6 (the mean's rounding over the std).
tests/test_sampler_math.py holds std and log-prob within 1e-6 of a float64 reference at every timestep.
The cost is float64 arithmetic on the latents, small next to one denoiser call. Apple's MPS has no float64:
there the coefficients still come from the float64 table (on the CPU) and the step runs in float32.

``sigma`` / ``sigma_next`` are scalars or one value per sample, shape (B,); a per-sample step equals, row by
row, the scalar step on that row.

The step goes from one grid point to the next (sigma -> sigma_next). diffusers' DDIMScheduler.step instead
steps to ``t - T // K``, which is the next grid point for "leading" spacing (Stable Diffusion) and for
"trailing" spacing when K divides T, but not for trailing grids with K not dividing T (CogVideoX at K = 3:
999 -> 666 -> 333, then the model is called at 332); flowrl keeps the state and the model's timestep on the
same grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from ..sections import SamplerSection
from ..types import StepOutput
from .log_prob import Reduction, as_sigma, finish_step
from .schedules import DiscreteSchedule


@dataclass
class DDIMSampler:
    schedule: DiscreteSchedule
    prediction_type: Literal["epsilon", "v_prediction"]
    eta: float
    clip_sample: float | None
    reduction: Reduction
    name = "ddim"
    prediction_types = ("epsilon", "v_prediction")

    @property
    def stochastic(self) -> bool:
        return self.eta > 0

    @staticmethod
    def step_dtype(x: Tensor) -> torch.dtype:
        return torch.float32 if x.device.type == "mps" else torch.float64  # MPS has no float64

    def coefficients(self, sigma, sigma_next, eta: float, x: Tensor) -> dict[str, Tensor]:
        """The step's coefficients from the float64 table, shaped to broadcast against x (0-dim, or (B, 1, ..., 1)
        per sample), in ``step_dtype(x)`` on x's device."""
        dtype = self.step_dtype(x)
        where = x.device if dtype == torch.float64 else torch.device("cpu")
        a_t = self.schedule.alpha_bar64(as_sigma(sigma, x, torch.float64, where))
        a_prev = self.schedule.alpha_bar64(as_sigma(sigma_next, x, torch.float64, where))
        var = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
        std = eta * var.clamp(min=0).sqrt()
        coefficients = {
            "sqrt_a": a_t.sqrt(),
            "sqrt_one_minus_a": (1 - a_t).sqrt(),
            "sqrt_a_prev": a_prev.sqrt(),
            "direction": (1 - a_prev - std**2).clamp(min=0).sqrt(),
            "std": std,
        }
        return {k: v.to(device=x.device, dtype=dtype) for k, v in coefficients.items()}

    def _x0_eps(self, out: Tensor, x: Tensor, c: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The model output as (x0_hat, eps), with ``c`` = :meth:`coefficients` at the step's sigma (x0_hat clipped if asked)."""
        if self.prediction_type == "v_prediction":
            eps = c["sqrt_a"] * out + c["sqrt_one_minus_a"] * x
            x0 = c["sqrt_a"] * x - c["sqrt_one_minus_a"] * out
        else:
            eps = out
            x0 = (x - c["sqrt_one_minus_a"] * eps) / c["sqrt_a"]
        if self.clip_sample is not None:
            x0 = x0.clamp(-self.clip_sample, self.clip_sample)
        return x0, eps

    def predicted_x0(self, model_output: Tensor, x: Tensor, sigma) -> Tensor:
        """x0_hat of the model output at ``sigma``, as the step computes it (float64; float32 on MPS)."""
        dtype = self.step_dtype(x)
        out, x = model_output.to(dtype), x.to(dtype)
        return self._x0_eps(out, x, self.coefficients(sigma, sigma, 0.0, x))[0]

    def _mean_std(self, model_output, x, sigma, sigma_next, eta: float) -> tuple[Tensor, Tensor]:
        """float64 mean and std (bf16 / fp32 inputs are upcast exactly; float32 on MPS)."""
        dtype = self.step_dtype(x)
        out, x = model_output.to(dtype), x.to(dtype)
        c = self.coefficients(sigma, sigma_next, eta, x)
        x0, eps = self._x0_eps(out, x, c)
        return c["sqrt_a_prev"] * x0 + c["direction"] * eps, c["std"]

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        mean, std = self._mean_std(model_output, x, sigma, sigma_next, self.eta)
        return finish_step(mean, std, x_next, generator, self.reduction)

    def deterministic_step(self, model_output, x, sigma, sigma_next) -> Tensor:
        return self._mean_std(model_output, x, sigma, sigma_next, 0.0)[0].float()


class DDIMConfig(SamplerSection):
    """DDIM with eta (eta = 1: DDPM-equivalent, DDPO's default; eta = 0: deterministic) for epsilon / v models."""

    name: str = "ddim"
    eta: float = Field(1.0, ge=0, description="DDIM's eta: 1 is DDPM-equivalent (DDPO's default), 0 deterministic.")
    clip_sample: float | None = Field(None, description="Clip the predicted clean sample x0_hat to [-c, c]; None: no clipping.")
    reduction: Reduction = Field(
        "mean", description="How a step's log-prob is reduced over the non-batch dimensions: mean (every reference) or sum."
    )
    prediction_types: ClassVar[tuple[str, ...]] = ("epsilon", "v_prediction")

    @property
    def memoryless(self) -> bool:
        return self.eta == 1.0  # DDPM's ancestral sampling

    def build(self, pipeline: Any) -> DDIMSampler:
        return DDIMSampler(
            schedule=pipeline.schedule,
            prediction_type=pipeline.prediction_type,
            eta=self.eta,
            clip_sample=self.clip_sample,
            reduction=self.reduction,
        )
