"""Stable Diffusion 1.x / 2.x: UNet2DConditionModel + CLIP text encoder + AutoencoderKL.

Epsilon- and v-prediction checkpoints both work (the scheduler config says which); the DDIM/DDPM
sampler does the step math from the scheduler's alpha-bar table, on the grid of the checkpoint's scheduler
config (``timestep_spacing`` and ``steps_offset``: 981, 961, ..., 1 at 50 steps for SD1.5, as diffusers' DDIM
gives it and DDPO samples on it). Load any diffusers-layout checkpoint:
``pipeline.name=stable_diffusion pipeline.pretrained=stable-diffusion-v1-5/stable-diffusion-v1-5``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import SPACINGS, DiscreteSchedule, config_default, sampling_grid
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig, prompt_token_ids


def discrete_schedule(adapter: DiffusersAdapter, scheduler) -> DiscreteSchedule:
    """``scheduler``'s alpha-bar table on the grid the checkpoint's pipeline samples on: the ``timestep_spacing``
    and ``steps_offset`` of its scheduler_config.json as its own scheduler class reads them (a missing key takes
    that class's default). Stable Diffusion 1.x/2.x and SDXL say "leading" with offset 1: 981, 961, ..., 1 at
    K = 50, what DDPO samples on; CogVideoX says "trailing". ``pipeline.sampling_grid`` (trailing, leading,
    linspace) picks another spacing, keeping the checkpoint's offset."""
    from diffusers import DDPMScheduler

    written = adapter._read_config(DDPMScheduler, "scheduler", "the scheduler config")  # the file as written: only the keys it sets
    spacing = sampling_grid(adapter.config, config_default(written, "timestep_spacing", "leading"), SPACINGS)
    if spacing not in SPACINGS:
        raise FlowRLError(f"the scheduler's timestep_spacing {spacing!r} is not supported (one of {', '.join(SPACINGS)}).")
    return DiscreteSchedule.from_diffusers(scheduler, spacing=spacing, steps_offset=int(config_default(written, "steps_offset", 0)))


class StableDiffusionAdapter(DiffusersAdapter):
    denoiser_subfolder = "unet"
    lora_pipeline_class = "StableDiffusionPipeline"
    convert_lora_keys = True
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' train_text_to_image_lora default

    def _load_components(self) -> None:
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel

        self._load_single_encoder(CLIPTextModel, AutoencoderKL, UNet2DConditionModel)
        scheduler = self._load(DDPMScheduler, "scheduler")
        self.prediction_type = scheduler.config.prediction_type  # "epsilon" or "v_prediction"
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"unsupported prediction_type {self.prediction_type!r}")
        self.schedule = discrete_schedule(self, scheduler)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        size = self.denoiser.config.sample_size * self.vae_scale_factor
        self.default_size = (size, size)

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        ids = prompt_token_ids(self.tokenizer, prompts, self.tokenizer.model_max_length)
        with self._frozen_on_device(self.text_encoder):
            hidden = self.text_encoder(ids.to(self.text_encoder.device))[0]
        return {"prompt_embeds": hidden.float()}

    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> UNet timestep conversion of this family (integer DDPM step)."""
        return self.schedule.timestep(sigma)

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        t = self.timestep(sigma).to(self.device).expand(x.shape[0])
        return model(x.to(self.model_dtype), t, encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype)).sample

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.sample_size()
        return (self.denoiser.config.in_channels, h // self.vae_scale_factor, w // self.vae_scale_factor)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        with self._frozen_on_device(self.vae):
            latents = x.to(self.vae.dtype).to(self.vae.device) / self.vae.config.scaling_factor
            images = self.vae.decode(latents).sample.float()
        return ((images + 1) / 2).clamp(0, 1).to(self.device)


class StableDiffusionConfig(PipelineConfig):
    """``pipeline.name: stable_diffusion`` (Stable Diffusion 1.x / 2.x)."""

    name: str = "stable_diffusion"
    adapter: ClassVar[Any] = StableDiffusionAdapter
