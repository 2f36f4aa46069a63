"""DDIM / DDPM step with log-prob (DDPO, D3PO), for epsilon- and v-prediction models.

MATH.md section 2, with a_t = alpha_bar(sigma), a_prev = alpha_bar(sigma_next):

    x0_hat = (x - sqrt(1 - a_t) eps) / sqrt(a_t)          (optionally clipped)
    var    = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
    std    = eta sqrt(var)
    mean   = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - std^2) eps

eta = 1 is DDPM-equivalent (the DDPO default), eta = 0 deterministic DDIM. A v-prediction output is
converted first: eps = sqrt(a_t) v + sqrt(1 - a_t) x. With ``final_alpha_cumprod = 1`` the last step
(to sigma = 0) has var = 0 and is deterministic, so it carries no log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..types import StepOutput
from .flow_sde import _finish
from .schedules import DiscreteSchedule
from .log_prob import Reduction


@dataclass
class DDIMSampler:
    schedule: DiscreteSchedule
    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    eta: float = 1.0
    clip_sample: float | None = None
    reduction: Reduction = "mean"
    name = "ddim"
    prediction_types = ("epsilon", "v_prediction")

    @property
    def stochastic(self) -> bool:
        return self.eta > 0

    def _x0_eps(self, model_output: Tensor, x: Tensor, a_t: Tensor) -> tuple[Tensor, Tensor]:
        out, x = model_output.float(), x.float()
        if self.prediction_type == "v_prediction":
            eps = a_t.sqrt() * out + (1 - a_t).sqrt() * x
            x0 = a_t.sqrt() * x - (1 - a_t).sqrt() * out
        else:
            eps = out
            x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        if self.clip_sample is not None:
            x0 = x0.clamp(-self.clip_sample, self.clip_sample)
        return x0, eps

    def _mean_std(self, model_output, x, sigma, sigma_next, eta: float) -> tuple[Tensor, Tensor]:
        a_t = self.schedule.alpha_bar(torch.as_tensor(sigma)).to(x.device)
        a_prev = self.schedule.alpha_bar(torch.as_tensor(sigma_next)).to(x.device)
        x0, eps = self._x0_eps(model_output, x, a_t)
        var = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
        std = eta * var.clamp(min=0).sqrt()
        mean = a_prev.sqrt() * x0 + (1 - a_prev - std**2).clamp(min=0).sqrt() * eps
        return mean, std

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        mean, std = self._mean_std(model_output, x, sigma, sigma_next, self.eta)
        return _finish(mean, std, x_next, generator, self.reduction)

    def deterministic_step(self, model_output, x, sigma, sigma_next) -> Tensor:
        return self._mean_std(model_output, x, sigma, sigma_next, 0.0)[0]
