"""Adapter for the embedded text-to-digit generators (pixel space, 1x8x8).

Components use the diffusers/transformers layout: ``unet/`` (UNet2DConditionModel), ``text_encoder/``
(CLIPTextModel), ``tokenizer/``, ``scheduler/`` (FlowMatchEulerDiscreteScheduler -> rectified flow,
DDPMScheduler -> epsilon/v diffusion). They are loaded with ``from_pretrained`` from the shipped assets
(``digits_flow``, ``digits_ddpm``) or any local directory of the same layout. LoRA, the KL reference,
checkpoints and the diffusers LoRA export (Stable Diffusion's format: the UNet is SD's class) come from
:class:`~flowrl.pipelines.diffusers_base.DiffusersAdapter`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..data.digits import MAX_PROMPT_TOKENS
from ..samplers.schedules import DiscreteSchedule, FlowSchedule
from ..types import Condition
from .embedded_adapter import EmbeddedAdapter, EmbeddedPipelineConfig


class DigitsPipeline(EmbeddedAdapter):
    """Pixel-space UNet2DConditionModel + CLIP text encoder, with classifier-free guidance."""

    embedded = ("digits_flow", "digits_ddpm", "digits_flow_2step")
    required = ("unet", "text_encoder", "tokenizer", "scheduler")
    max_prompt_tokens = MAX_PROMPT_TOKENS
    denoiser_subfolder = "unet"
    lora_pipeline_class = "StableDiffusionPipeline"
    convert_lora_keys = True

    def _load_components(self) -> None:
        from diffusers import DDPMScheduler, UNet2DConditionModel

        self._load_text_encoder()
        self.denoiser = self._load(UNet2DConditionModel, "unet")
        self.in_channels = self.denoiser.config.in_channels  # read here: under DDP the denoiser is wrapped later
        size = self.denoiser.config.sample_size
        self.default_size = (size, size) if isinstance(size, int) else tuple(size)
        config = self._scheduler_config()
        self.num_train_timesteps = int(config.get("num_train_timesteps", 1000))
        if config.get("_class_name", "").startswith("FlowMatch"):
            self.prediction_type = "flow"
            self.schedule = FlowSchedule(shift=float(config.get("shift", 1.0)))
        else:
            self.prediction_type = config.get("prediction_type", "epsilon")
            self.schedule = DiscreteSchedule.from_diffusers(DDPMScheduler.from_config(config))

    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> model-timestep conversion of this model family."""
        if self.prediction_type == "flow":
            return sigma.float() * self.num_train_timesteps
        return self.schedule.timestep(sigma)

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        t = self.timestep(sigma).to(self.device).expand(x.shape[0])
        return model(x.to(self.model_dtype), t, cond["prompt_embeds"].to(self.model_dtype)).sample

    def latent_shape(self) -> tuple[int, ...]:
        return (self.in_channels, *self.sample_size())


class DigitsConfig(EmbeddedPipelineConfig):
    """``pipeline.name: digits`` (the embedded 8x8 digit generators digits_flow / digits_ddpm / digits_flow_2step, the 2-step student)."""

    name: str = "digits"
    adapter: ClassVar[Any] = DigitsPipeline

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(0))
