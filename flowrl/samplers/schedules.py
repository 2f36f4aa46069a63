"""Noise schedules as pure functions of sigma, and the sampling grids of the reference pipelines.

Public time is ``sigma`` in [0, 1] with 1 = noise. For a rectified flow, sigma *is* the interpolation
coefficient: ``x_sigma = (1 - sigma) * x0 + sigma * noise``. For a discrete-time diffusion model
(DDPM/DDIM) sigma is the normalised training time ``(t + 1) / T`` of the integer timestep t, and
``sigma = 0`` means clean data (alpha-bar = ``final_alpha_cumprod``). The mapping lives here and
nowhere else; a pipeline adapter calls :meth:`DiscreteSchedule.timestep` to feed its model.

A schedule's ``sigmas(K)`` is the (K + 1,) grid the rollout samples on. Each grid below reproduces one
diffusers ``set_timesteps`` with its default arguments, number for number (the same float32 / float64
steps in the same order, so the float32 grids are equal, not merely close; tests/test_family_*.py check
every family for K = 1..50 against the diffusers pipelines themselves). Which grid a family uses by
default, and why, is in docs/samplers.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
from torch import Tensor

from ..errors import FlowRLError

FlowGrid = Literal["linspace", "flux", "flow_match", "unipc"]
Spacing = Literal["trailing", "leading", "linspace"]
FLOW_GRIDS: tuple[str, ...] = get_args(FlowGrid)
SPACINGS: tuple[str, ...] = get_args(Spacing)
# pipeline.sampling_grid: "default" (the family's diffusers pipeline grid for the checkpoint), a flow grid or a spacing
SamplingGrid = Literal["default", FlowGrid, Spacing]


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """SD3 resolution shift: ``shift * s / (1 + (shift - 1) * s)`` (identity for shift = 1)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _check_steps(num_steps: int) -> None:
    if int(num_steps) != num_steps or num_steps < 1:
        raise FlowRLError(f"the number of sampling steps must be a positive integer, got {num_steps!r}.")


@dataclass(frozen=True)
class FlowSchedule:
    """Rectified-flow time grid: ``sigmas(K)`` runs from 1 to 0 in K steps.

    shift:   the resolution shift (``config.shift``; for dynamic shifting ``exp(mu)`` of the image size).
    dynamic: the shift came from diffusers' ``use_dynamic_shifting``. Then, as in diffusers, the scheduler's
             training table is not pre-shifted (this moves the "flow_match" grid's last nonzero sigma) and
             the shift is evaluated in its ``time_shift`` form ``e / (e + 1/s - 1)``, which rounds differently.
    grid:    which ``set_timesteps`` default to reproduce:

             * ``"linspace"``: ``shift(linspace(1, 0, K + 1))`` in float64, cast once. DanceGRPO's
               ``sd3_time_shift`` grid, and flowrl's own grid for its embedded models (the default here, so
               their published results keep their grid);
             * ``"flux"``: ``FluxPipeline``'s default, ``sigmas = linspace(1, 1/K, K)`` handed to the scheduler,
               which casts them to float32 before shifting: the same numbers as "linspace" up to float32 rounding;
             * ``"flow_match"``: ``FlowMatchEulerDiscreteScheduler.set_timesteps(K)`` (``StableDiffusion3Pipeline``,
               hence Flow-GRPO): linspace *in training time* from the table's sigma_max to its sigma_min, then
               shifted. For a static shift the table is already shifted, so the shift acts twice at the low end:
               the last nonzero sigma is ``shift(shift(1/T))``-ish (0.0089 at K = 10, shift 3), not ``shift(1/K)``;
             * ``"unipc"``: ``UniPCMultistepScheduler(use_flow_sigmas=True).set_timesteps(K)`` (the scheduler
               Wan's hub checkpoints ship): ``shift(linspace(1, 1/T, K + 1)[:-1])``. UniPC then lowers its first
               sigma by 1e-6 (its multistep update takes log(1 - sigma)); flowrl keeps 1, where every sampler
               treats the start as pure noise (at 1 - 1e-6 the Flow-GRPO diffusion coefficient would be ~1000 a).
    num_train_timesteps: T of the scheduler config (the "flow_match" and "unipc" grids depend on it).
    """

    shift: float = 1.0
    grid: FlowGrid = "linspace"
    dynamic: bool = False
    num_train_timesteps: int = 1000

    def __post_init__(self) -> None:
        if self.grid not in FLOW_GRIDS:
            raise FlowRLError(f"unknown flow sampling grid '{self.grid}' (one of {', '.join(FLOW_GRIDS)}).")

    def _shift(self, s):
        """The scheduler's shift of float64 or float32 numpy sigmas, written as diffusers writes it."""
        if self.dynamic:  # diffusers' time_shift(mu, 1.0, s) = e / (e + (1 / s - 1) ** 1.0), e = exp(mu)
            return self.shift / (self.shift + (1 / s - 1) ** 1.0)
        return self.shift * s / (1 + (self.shift - 1) * s)

    def sigmas(self, num_steps: int) -> Tensor:
        _check_steps(num_steps)
        K, T = int(num_steps), self.num_train_timesteps
        if self.grid == "linspace":
            return shift_sigmas(torch.linspace(1.0, 0.0, K + 1, dtype=torch.float64), self.shift).float()
        if self.grid == "flux":
            # FluxPipeline: np.linspace(1, 1/K, K); set_timesteps casts the given sigmas to float32 and shifts them
            # in float32 (numpy keeps float32 against Python scalars), then appends 0
            s = self._shift(np.linspace(1.0, 1 / K, K).astype(np.float32))
        elif self.grid == "flow_match":
            # the scheduler's __init__ table in float32 torch arithmetic: t = T..1, s = t / T, shifted unless dynamic
            table = torch.from_numpy(np.linspace(1, T, T, dtype=np.float32)[::-1].copy()) / T
            if not self.dynamic:
                table = self.shift * table / (1 + (self.shift - 1) * table)
            sigma_max, sigma_min = table[0].item(), table[-1].item()
            s = self._shift(np.linspace(sigma_max * T, sigma_min * T, K) / T)  # float64, as set_timesteps
        else:  # "unipc"
            s = self._shift(np.linspace(1, 1 / T, K + 1)[:-1])
            if abs(s[0] - 1) < 1e-6:  # where UniPC subtracts 1e-6 (see the class docstring), flowrl starts at 1
                s[0] = 1.0
        grid = torch.from_numpy(np.asarray(s)).to(torch.float32)
        return torch.cat([grid, grid.new_zeros(1)])


@dataclass(frozen=True)
class DiscreteSchedule:
    """A DDPM alpha-bar table, indexed through sigma = (t + 1) / T.

    alphas_cumprod: (T,) float64 alpha-bar of each training timestep.
    final_alpha_cumprod: alpha-bar used "below step 0" (1.0 = diffusers' set_alpha_to_one).
    spacing / steps_offset: the integer timesteps of ``sigmas(K)``, exactly as diffusers' DDIM / DDPM
    ``set_timesteps`` computes them for that ``timestep_spacing``: "trailing" starts at t = T - 1 (pure noise
    for a zero-terminal-SNR table), "leading" at (K - 1) * (T // K) + steps_offset (Stable Diffusion's
    configs: 981, 961, ..., 1 at K = 50), "linspace" rounds linspace(T - 1, 0, K).
    """

    alphas_cumprod: Tensor
    final_alpha_cumprod: float = 1.0
    spacing: Spacing = "trailing"
    steps_offset: int = 0

    def __post_init__(self) -> None:
        if self.spacing not in SPACINGS:
            raise FlowRLError(f"unknown timestep spacing '{self.spacing}' (one of {', '.join(SPACINGS)}).")

    @property
    def num_train_timesteps(self) -> int:
        return self.alphas_cumprod.shape[0]

    def timestep(self, sigma: Tensor) -> Tensor:
        """Integer training timestep of sigma (-1 for sigma = 0, i.e. clean data); any shape."""
        return torch.round(torch.as_tensor(sigma).double() * self.num_train_timesteps).long() - 1

    def alpha_bar64(self, sigma: Tensor) -> Tensor:
        """float64 alpha-bar of sigma (any shape), straight from the table: the step coefficients are computed
        from this and cast once, because 1 - alpha_bar and 1 - a_t / a_prev cancel near t = 0."""
        t = self.timestep(sigma)
        table = self.alphas_cumprod.to(device=t.device, dtype=torch.float64)
        final = torch.tensor(self.final_alpha_cumprod, dtype=torch.float64, device=t.device)
        return torch.where(t >= 0, table[t.clamp(min=0)], final)

    def alpha_bar(self, sigma: Tensor) -> Tensor:
        """float32 alpha-bar of sigma (for callers that mix it with float32 tensors)."""
        return self.alpha_bar64(sigma).float()

    def timesteps(self, num_steps: int) -> Tensor:
        """(K,) int64 timesteps of the grid: diffusers' DDIMScheduler / DDPMScheduler ``set_timesteps(K)``."""
        _check_steps(num_steps)
        K, T = int(num_steps), self.num_train_timesteps
        if K > T:
            raise FlowRLError(f"{K} sampling steps exceed the model's {T} training timesteps.")
        if self.spacing == "linspace":
            t = np.linspace(0, T - 1, K).round()[::-1].copy().astype(np.int64)
        elif self.spacing == "leading":
            t = (np.arange(0, K) * (T // K)).round()[::-1].copy().astype(np.int64) + self.steps_offset
        else:
            t = np.round(np.arange(T, 0, -T / K)).astype(np.int64) - 1
        return torch.from_numpy(t)

    def sigmas(self, num_steps: int) -> Tensor:
        sig = (self.timesteps(num_steps).double() + 1) / self.num_train_timesteps
        return torch.cat([sig, sig.new_zeros(1)]).float()

    @classmethod
    def from_betas(cls, betas: Tensor, **kwargs) -> DiscreteSchedule:
        return cls(alphas_cumprod=torch.cumprod(1.0 - betas.double(), dim=0), **kwargs)

    @classmethod
    def from_diffusers(cls, scheduler, spacing: Spacing | None = "trailing", steps_offset: int | None = None) -> DiscreteSchedule:
        """Take the alpha-bar table from a diffusers DDPM/DDIM scheduler (never its ``step``).

        ``spacing=None`` reads ``timestep_spacing`` and ``steps_offset`` from the scheduler's config: the grid
        its pipeline samples on. The default stays "trailing" (offset 0) because the embedded digits_ddpm
        model's published results were measured on that grid (its config says "leading").
        """
        final = 1.0 if getattr(scheduler.config, "set_alpha_to_one", True) else float(scheduler.alphas_cumprod[0])
        if spacing is None:
            spacing = scheduler.config.timestep_spacing
            steps_offset = int(getattr(scheduler.config, "steps_offset", 0)) if steps_offset is None else steps_offset
        return cls(
            alphas_cumprod=scheduler.alphas_cumprod.double(),
            final_alpha_cumprod=final,
            spacing=spacing,
            steps_offset=int(steps_offset or 0),
        )


def config_default(config: dict, key: str, fallback):
    """A scheduler-config value as the checkpoint's own scheduler class reads it: the file's value, else that
    class's ``__init__`` default (a missing ``timestep_spacing`` is "leading" for DDIM / DDPM / PNDM but
    "linspace" for EulerDiscreteScheduler, SDXL's), else ``fallback``."""
    if config.get(key) is not None:
        return config[key]
    import inspect

    import diffusers

    cls = getattr(diffusers, str(config.get("_class_name", "")), None)
    if cls is not None:
        parameter = inspect.signature(cls.__init__).parameters.get(key)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return fallback


def sampling_grid(pipeline_config, default, allowed: tuple[str, ...]):
    """``pipeline.sampling_grid`` when set to something other than "default", checked against the family's
    grids (``allowed``); else ``default``, the grid of the family's diffusers pipeline for the checkpoint."""
    requested = pipeline_config.sampling_grid
    if requested == "default":
        return default
    if requested not in allowed:
        raise FlowRLError(
            f"pipeline.sampling_grid '{requested}' does not apply to {getattr(pipeline_config, 'name', 'this model')} "
            f"(use default or one of {', '.join(allowed)})."
        )
    return requested


__all__ = ["DiscreteSchedule", "FlowSchedule", "FLOW_GRIDS", "SPACINGS", "config_default", "sampling_grid", "shift_sigmas"]
