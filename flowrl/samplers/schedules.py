"""Noise schedules as pure functions of sigma.

Public time is ``sigma`` in [0, 1] with 1 = noise. For a rectified flow, sigma *is* the interpolation
coefficient: ``x_sigma = (1 - sigma) * x0 + sigma * noise``. For a discrete-time diffusion model
(DDPM/DDIM) sigma is the normalised training time ``(t + 1) / T`` of the integer timestep t, and
``sigma = 0`` means clean data (alpha-bar = ``final_alpha_cumprod``). The mapping lives here and
nowhere else; a pipeline adapter calls :meth:`DiscreteSchedule.timestep` to feed its model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """SD3 resolution shift: ``shift * s / (1 + (shift - 1) * s)`` (identity for shift = 1)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


@dataclass(frozen=True)
class FlowSchedule:
    """Rectified-flow time grid: ``linspace(1, 0, K+1)`` then the SD3 shift (DanceGRPO/Flow-GRPO)."""

    shift: float = 1.0

    def sigmas(self, num_steps: int) -> Tensor:
        return shift_sigmas(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), self.shift).float()


@dataclass(frozen=True)
class DiscreteSchedule:
    """A DDPM alpha-bar table, indexed through sigma = (t + 1) / T.

    alphas_cumprod: (T,) float64 alpha-bar of each training timestep.
    final_alpha_cumprod: alpha-bar used "below step 0" (1.0 = diffusers' set_alpha_to_one).
    spacing: "trailing" starts at t = T-1 (pure noise, recommended), "leading" at (K-1) * T // K.
    """

    alphas_cumprod: Tensor
    final_alpha_cumprod: float = 1.0
    spacing: Literal["trailing", "leading"] = "trailing"

    @property
    def num_train_timesteps(self) -> int:
        return self.alphas_cumprod.shape[0]

    def timestep(self, sigma: Tensor) -> Tensor:
        """Integer training timestep of sigma (-1 for sigma = 0, i.e. clean data)."""
        return torch.round(sigma.double() * self.num_train_timesteps).long() - 1

    def alpha_bar(self, sigma: Tensor) -> Tensor:
        t = self.timestep(sigma)
        table = self.alphas_cumprod.to(t.device)
        final = torch.tensor(self.final_alpha_cumprod, dtype=table.dtype, device=t.device)
        return torch.where(t >= 0, table[t.clamp(min=0)], final).float()

    def sigmas(self, num_steps: int) -> Tensor:
        T = self.num_train_timesteps
        if self.spacing == "trailing":
            t = torch.round(torch.arange(T, 0, -T / num_steps, dtype=torch.float64)).long() - 1
        else:
            t = torch.arange(num_steps - 1, -1, -1, dtype=torch.long) * (T // num_steps)
        sig = (t.double() + 1) / T
        return torch.cat([sig, sig.new_zeros(1)]).float()

    @classmethod
    def from_betas(cls, betas: Tensor, **kwargs) -> "DiscreteSchedule":
        return cls(alphas_cumprod=torch.cumprod(1.0 - betas.double(), dim=0), **kwargs)

    @classmethod
    def from_diffusers(cls, scheduler, spacing: Literal["trailing", "leading"] = "trailing") -> "DiscreteSchedule":
        """Take the alpha-bar table from a diffusers DDPM/DDIM scheduler (never its ``step``)."""
        final = 1.0 if getattr(scheduler.config, "set_alpha_to_one", True) else float(scheduler.alphas_cumprod[0])
        return cls(alphas_cumprod=scheduler.alphas_cumprod.double(), final_alpha_cumprod=final, spacing=spacing)
