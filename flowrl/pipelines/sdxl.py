"""Stable Diffusion XL: UNet2DConditionModel with "text_time" added conditioning, two CLIP text
encoders (CLIPTextModel + CLIPTextModelWithProjection) and an AutoencoderKL.

Conditioning follows ``StableDiffusionXLPipeline.encode_prompt`` exactly: ``prompt_embeds`` is the
concatenation (feature axis) of both encoders' penultimate hidden states, the pooled embedding is
text_encoder_2's projected ``text_embeds``, and the UNet's ``added_cond_kwargs`` carry it with
``time_ids = (original_size, crops_coords_top_left, target_size) = (H, W, 0, 0, H, W)`` of the sample
size. The unconditional CFG branch is all zeros when the checkpoint's ``force_zeros_for_empty_prompt``
is set (SDXL base; diffusers' default when no negative prompt is given), otherwise the encoding of "".
Epsilon and v-prediction come from the scheduler config; the VAE decodes in float32 when its config
says ``force_upcast`` (SDXL's VAE overflows in fp16). Load any diffusers-layout checkpoint:
``pipeline.name=sdxl pipeline.pretrained=stabilityai/stable-diffusion-xl-base-1.0``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..types import Condition
from .diffusers_base import PipelineConfig, prompt_token_ids
from .stable_diffusion import StableDiffusionAdapter, discrete_schedule


class SDXLAdapter(StableDiffusionAdapter):
    lora_pipeline_class = "StableDiffusionXLPipeline"
    default_size = (1024, 1024)

    def _load_components(self) -> None:
        from diffusers import (
            AutoencoderKL,
            DDPMScheduler,
            DiffusionPipeline,
            UNet2DConditionModel,
        )
        from transformers import (
            AutoTokenizer,
            CLIPTextModel,
            CLIPTextModelWithProjection,
        )

        index = self._read_config(DiffusionPipeline, None, "model_index.json")
        if "text_encoder_2" not in index or "unet" not in index:
            raise FlowRLError(f"'{self.source}' is not an SDXL base checkpoint (its model_index.json has no unet and text_encoder_2).")
        self.force_zeros_for_empty_prompt = bool(index.get("force_zeros_for_empty_prompt", True))
        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.tokenizer_2 = self._load(AutoTokenizer, "tokenizer_2")
        self.text_encoder = self._load(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = self._load(CLIPTextModelWithProjection, "text_encoder_2")
        # SDXL's VAE overflows in fp16: its config's force_upcast keeps it (and the decode) in float32
        self.vae = self._load(
            AutoencoderKL,
            "vae",
            torch_dtype=torch.float32 if self._read_config(AutoencoderKL, "vae", "the vae config").get("force_upcast") else self.dtype,
        )
        self.denoiser = self._load(UNet2DConditionModel, "unet")
        scheduler = self._load(DDPMScheduler, "scheduler")
        self.prediction_type = scheduler.config.prediction_type  # "epsilon" or "v_prediction"
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise FlowRLError(f"SDXL scheduler prediction_type {self.prediction_type!r} is not supported (epsilon or v_prediction).")
        self.schedule = discrete_schedule(self, scheduler)  # SDXL base: "leading" + 1, as its EulerDiscreteScheduler

        unet = self.denoiser.config
        if unet.addition_embed_type != "text_time":
            raise FlowRLError(f"the UNet in '{self.source}' has addition_embed_type={unet.addition_embed_type!r}, not SDXL's 'text_time'.")
        expected = self.denoiser.add_embedding.linear_1.in_features
        passed = unet.addition_time_embed_dim * 6 + self.text_encoder_2.config.projection_dim
        if passed != expected:
            raise FlowRLError(f"the UNet expects an added embedding of {expected} features but time_ids and text_encoder_2 give {passed}.")
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        size = unet.sample_size * self.vae_scale_factor
        self.default_size = (size, size)

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        """``StableDiffusionXLPipeline.encode_prompt`` (prompt_2 = prompt, no clip_skip), in float32."""
        hidden, pooled = [], None
        with self._frozen_on_device(self.text_encoder, self.text_encoder_2):
            for tokenizer, encoder in ((self.tokenizer, self.text_encoder), (self.tokenizer_2, self.text_encoder_2)):
                ids = prompt_token_ids(tokenizer, prompts, tokenizer.model_max_length)
                out = encoder(ids.to(encoder.device), output_hidden_states=True)
                hidden.append(out.hidden_states[-2])
            pooled = out.text_embeds  # text_encoder_2's projection of the EOS token
        return {"prompt_embeds": torch.cat(hidden, dim=-1).float(), "pooled_prompt_embeds": pooled.float()}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """Zeros (``force_zeros_for_empty_prompt``, diffusers' default with no negative prompt) or the encoding of ""."""
        empty = self.encode([""])
        if self.force_zeros_for_empty_prompt:
            empty = {k: torch.zeros_like(v) for k, v in empty.items()}
        return {k: v.expand(batch, *v.shape[1:]) for k, v in empty.items()}

    def time_ids(self, batch: int) -> Tensor:
        """``_get_add_time_ids``: original size, crop top-left (0, 0) and target size, all from the sample size."""
        h, w = self.sample_size()
        return torch.tensor([[h, w, 0, 0, h, w]], dtype=torch.float32, device=self.device).expand(batch, 6)

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        t = self.timestep(sigma).to(self.device).expand(x.shape[0])
        added = {
            "text_embeds": cond["pooled_prompt_embeds"].to(self.model_dtype),
            "time_ids": self.time_ids(x.shape[0]).to(self.model_dtype),
        }
        return model(
            x.to(self.model_dtype), t, encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype), added_cond_kwargs=added
        ).sample

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        vae = self.vae
        with self._frozen_on_device(vae):
            latents = x.float().to(vae.device)
            mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
            if mean is not None and std is not None:
                shape = (1, -1) + (1,) * (latents.ndim - 2)
                latents = latents * torch.tensor(std).view(shape).to(latents) / vae.config.scaling_factor + torch.tensor(mean).view(
                    shape
                ).to(latents)
            else:
                latents = latents / vae.config.scaling_factor
            images = vae.decode(latents.to(vae.dtype)).sample.float()
        return ((images + 1) / 2).clamp(0, 1).to(self.device)


class SDXLConfig(PipelineConfig):
    """``pipeline.name: sdxl`` (Stable Diffusion XL base)."""

    name: str = "sdxl"
    adapter: ClassVar[Any] = SDXLAdapter
