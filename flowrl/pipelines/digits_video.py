"""Adapter for the embedded text-to-video model ("moving digits", pixel space, 1 x 4 x 16 x 16).

Components use the diffusers/transformers layout: ``transformer/`` (CogVideoXTransformer3DModel),
``text_encoder/`` (CLIPTextModel), ``tokenizer/``, ``scheduler/`` (FlowMatchEulerDiscreteScheduler:
rectified flow). They are loaded with ``from_pretrained`` from the shipped asset (``digits_video``,
written by ``python -m flowrl.pipelines.embedded.train_digits_video``) or any local directory of the
same layout. Latents and decoded samples are videos (B, C, T, H, W), the layout of the video rewards.
LoRA, the KL reference, checkpoints and the diffusers LoRA export (CogVideoX's format: the transformer is
CogVideoX's class) come from :class:`~flowrl.pipelines.diffusers_base.DiffusersAdapter`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..data.digits_video import CANVAS, MAX_PROMPT_TOKENS, NUM_FRAMES
from ..errors import FlowRLError
from ..samplers.schedules import FlowSchedule
from ..types import Condition
from .embedded_adapter import EmbeddedAdapter, EmbeddedPipelineConfig


def denoise(transformer: torch.nn.Module, x: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
    """One denoiser call on flowrl's layout: (B, C, T, H, W) in and out (CogVideoX works frames first)."""
    return transformer(x.transpose(1, 2), context, timestep).sample.transpose(1, 2)


class DigitsVideoPipeline(EmbeddedAdapter):
    """Pixel-space CogVideoXTransformer3DModel + CLIP text encoder, rectified flow, classifier-free guidance."""

    embedded = ("digits_video",)
    required = ("transformer", "text_encoder", "tokenizer", "scheduler")
    max_prompt_tokens = MAX_PROMPT_TOKENS
    denoiser_subfolder = "transformer"
    lora_pipeline_class = "CogVideoXPipeline"
    default_size = (CANVAS, CANVAS)

    def _load_components(self) -> None:
        from diffusers import CogVideoXTransformer3DModel

        self._load_text_encoder()
        self.denoiser = self._load(CogVideoXTransformer3DModel, "transformer")
        self.in_channels = self.denoiser.config.in_channels  # read here: under DDP the denoiser is wrapped later
        config = self._scheduler_config()
        if not config.get("_class_name", "").startswith("FlowMatch"):
            raise FlowRLError(
                f"model directory '{self.source}' has a {config.get('_class_name')} scheduler; "
                "the video model is a rectified flow (FlowMatch*)."
            )
        self.num_train_timesteps = int(config.get("num_train_timesteps", 1000))
        self.schedule = FlowSchedule(shift=float(config.get("shift", 1.0)))
        patch = self.denoiser.config.patch_size
        height, width = self.sample_size()
        if height % patch or width % patch:
            raise FlowRLError(f"pipeline height and width ({height}, {width}) must be multiples of the patch size {patch}.")

    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> model-timestep conversion of this model."""
        return sigma.float() * self.num_train_timesteps

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        """The velocity ``noise - x0`` at noise level ``sigma``."""
        t = self.timestep(sigma).to(self.device).expand(x.shape[0])
        return denoise(model, x.to(self.model_dtype), t, cond["prompt_embeds"].to(self.model_dtype))

    def latent_shape(self) -> tuple[int, ...]:
        return (self.in_channels, self.config.num_frames or NUM_FRAMES, *self.sample_size())


class DigitsVideoConfig(EmbeddedPipelineConfig):
    """``pipeline.name: digits_video`` (the embedded text-to-video model of moving digits)."""

    name: str = "digits_video"
    adapter: ClassVar[Any] = DigitsVideoPipeline

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 1, self.num_frames or NUM_FRAMES, CANVAS, CANVAS, generator=torch.Generator().manual_seed(0))
