"""The forward (noising) process, written once: how clean data x0 becomes the noisy state at a noise level, and what
a model of each prediction type was trained to predict there. Stateless, beside the samplers that run it backwards.

Rectified flow (``prediction_type="flow"``): ``x_sigma = (1 - sigma) x0 + sigma noise``, target the velocity
``noise - x0``. Variance preserving (DDPM / DDIM families): ``x_t = sqrt(a) x0 + sqrt(1 - a) noise`` with
``a = alpha_bar``, target the noise (``epsilon``) or ``sqrt(a) noise - sqrt(1 - a) x0`` (``v_prediction``).
Used by the objectives that regress on the denoising loss (Diffusion-DPO, SePPO, DiffusionNFT, AWM, DGPO) and by the
scripts that train the embedded models.
"""

from __future__ import annotations

import torch
from torch import Tensor


def flow_noised(x0: Tensor, noise: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """The rectified-flow state at ``sigma`` (broadcast against x0) and its velocity target."""
    return (1 - sigma) * x0 + sigma * noise, noise - x0


def vp_noised(x0: Tensor, noise: Tensor, alpha_bar: Tensor, prediction_type: str = "epsilon") -> tuple[Tensor, Tensor]:
    """The variance-preserving state at ``alpha_bar`` (broadcast against x0) and the target of ``prediction_type``."""
    x_t = alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise
    return x_t, (noise if prediction_type == "epsilon" else alpha_bar.sqrt() * noise - (1 - alpha_bar).sqrt() * x0)


def noised_and_target(pipeline, x0: Tensor, noise: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """The noisy input at ``sigma`` (B,) and the regression target the pipeline's model was trained on."""
    shape = (-1,) + (1,) * (x0.ndim - 1)
    if pipeline.prediction_type == "flow":
        return flow_noised(x0, noise, sigma.view(shape))
    return vp_noised(x0, noise, pipeline.schedule.alpha_bar(sigma).view(shape), pipeline.prediction_type)


def training_sigmas(pipeline, n: int, generator: torch.Generator) -> Tensor:
    """n noise levels drawn uniformly over the model's training times: sigma in (0, 1] for a flow, the integer DDPM
    steps (as sigma = (t + 1) / T) otherwise."""
    if pipeline.prediction_type == "flow":
        return 1.0 - torch.rand(n, generator=generator)  # (0, 1]
    steps = pipeline.schedule.num_train_timesteps
    return (torch.randint(0, steps, (n,), generator=generator) + 1).float() / steps


def denoising_errors(pipeline, x_t: Tensor, sigma: Tensor, cond, target: Tensor, guidance_scale: float) -> Tensor:
    """Per-sample mean squared error of the model's prediction against its regression target (B,)."""
    pred = pipeline.predict(x_t, sigma, cond, guidance_scale).float()
    return (pred - target).pow(2).flatten(1).mean(1)
