"""FLUX.1 (dev / schnell): FluxTransformer2DModel + CLIP (pooled) + T5 + AutoencoderKL (16 channels).

Rectified flow (``prediction_type="flow"``, velocity ``noise - x0`` as FlowMatchEulerDiscreteScheduler).

* Latents: flowrl keeps the trajectory in the VAE's unpacked layout ``(B, C, H/8, W/8)``; the 2x2
  patch packing into FLUX's token sequence ``(B, H/16 * W/16, 4C)`` (and the unpacking of the output)
  happens inside :meth:`FluxAdapter._forward`. Packing is a permutation, so log-probs are unchanged.
* Time: the transformer takes sigma itself (diffusers passes ``timestep / 1000``); the resolution
  shift is dynamic: ``shift = exp(mu)``, mu linear in the image token count (scheduler config
  base/max shift), which is FlowSchedule's shift formula. The default grid is FluxPipeline's
  (``sigmas = linspace(1, 1/K, K)``, shifted by the scheduler in float32): FlowSchedule's "flux" grid.
* Guidance: FLUX.1-dev is guidance-distilled (``guidance_embeds=True``): the scale is a model input,
  one forward per step, ``rollout.guidance_mode: embedded`` (the default this adapter sets). FLUX.1-schnell
  has no guidance embedding: no guidance (``guidance_scale: 1``), or true CFG with ``cfg``.

``pipeline.name=flux pipeline.pretrained=black-forest-labs/FLUX.1-dev``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import FLOW_GRIDS, sampling_grid
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig, prompt_token_ids
from .sd3 import JOINT_ATTENTION_LORA_TARGETS, batch_timestep, decode_latents, flow_schedule


def pack_latents(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): diffusers' FluxPipeline._pack_latents."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: Tensor, height: int, width: int) -> Tensor:
    """(B, H/2 * W/2, 4C) -> (B, C, H, W), the inverse of :func:`pack_latents` (H, W in latent pixels)."""
    b, _, d = x.shape
    return x.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, height, width)


def patchable_sample_size(adapter: DiffusersAdapter, family: str) -> tuple[int, int]:
    """The sample size (height, width) in pixels, refused in one sentence unless its latents split into the 2x2
    patches a FLUX-style transformer takes as tokens (FLUX.1, FLUX.2, Qwen-Image): a multiple of twice the VAE's scale
    factor."""
    h, w = adapter.sample_size()
    multiple = adapter.vae_scale_factor * 2
    if h % multiple or w % multiple:
        raise FlowRLError(
            f"pipeline.height and pipeline.width ({h}x{w}) must be multiples of {multiple} for {family} (2x2 latent patches)."
        )
    return h, w


def latent_image_ids(height: int, width: int) -> Tensor:
    """(H/2 * W/2, 3) RoPE positions of the packed image tokens (diffusers' _prepare_latent_image_ids)."""
    ids = torch.zeros(height // 2, width // 2, 3)
    ids[..., 1] += torch.arange(height // 2)[:, None]
    ids[..., 2] += torch.arange(width // 2)[None, :]
    return ids.reshape(-1, 3)


class FluxAdapter(DiffusersAdapter):
    denoiser_subfolder = "transformer"
    lora_pipeline_class = "FluxPipeline"
    # Flow-GRPO's FLUX targets: the joint attention of the double-stream blocks (image + text) and, through the same
    # names, q/k/v of the single-stream blocks
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS
    default_max_sequence_length = 512  # T5 tokens (diffusers' default; FLUX.1-schnell was trained with 256)

    def __init__(self, config, device, loaded=None):
        super().__init__(config, device, loaded=loaded)
        # a guidance-distilled model (FLUX.1-dev) takes the scale as an input; the trainer may override
        self.guidance_mode = "embedded" if self.guidance_embeds else "cfg"

    # (called by DiffusersAdapter.guidance_mode's setter, which the trainer uses after construction)
    def check_guidance_mode(self, mode: str) -> None:
        embeds = getattr(self, "guidance_embeds", None)
        if embeds is True and mode != "embedded":
            raise FlowRLError(
                f"this FLUX model is guidance-distilled (guidance_embeds=True, e.g. FLUX.1-dev): set rollout.guidance_mode "
                f"to 'embedded' (got '{mode}'); the scale is then a model input, one forward per step."
            )
        if embeds is False and mode == "embedded":
            raise FlowRLError(
                "rollout.guidance_mode 'embedded' needs a guidance-distilled model, but this FLUX transformer has no "
                "guidance embedding (guidance_embeds=False, e.g. FLUX.1-schnell): use 'cfg' (with guidance_scale 1 for none)."
            )

    def _load_components(self) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.tokenizer_2 = self._load(AutoTokenizer, "tokenizer_2")
        self.text_encoder = self._load(CLIPTextModel, "text_encoder")
        self.text_encoder_2 = self._load(T5EncoderModel, "text_encoder_2")
        self.vae = self._load(AutoencoderKL, "vae")
        self.denoiser = self._load(FluxTransformer2DModel, "transformer")
        scheduler = self._load(FlowMatchEulerDiscreteScheduler, "scheduler")
        self.guidance_embeds = bool(self.denoiser.config.guidance_embeds)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.default_size = (128 * self.vae_scale_factor,) * 2  # diffusers' default_sample_size (1024 px)
        self.clip_max_length = self.tokenizer.model_max_length
        self.max_sequence_length = self.config.max_sequence_length or self.default_max_sequence_length
        _, h, w = self.latent_shape()
        self.img_ids = latent_image_ids(h, w).to(self.device)
        self.txt_ids = torch.zeros(self.max_sequence_length, 3, device=self.device)
        # FluxPipeline's default: sigmas linspace(1, 1/K, K) given to the scheduler, shifted there (mu from the token
        # count: FluxPipeline computes it for every scheduler, which uses it only with use_dynamic_shifting)
        grid = sampling_grid(self.config, "flux", FLOW_GRIDS)
        self.schedule = flow_schedule(scheduler.config, (h // 2) * (w // 2), grid, default_max_shift=1.15)

    # -- conditioning ---------------------------------------------------------------------------
    def _encode_prompts(self, prompts: list[str]) -> Condition:
        clip_ids = prompt_token_ids(self.tokenizer, prompts, self.clip_max_length)
        t5_ids = prompt_token_ids(self.tokenizer_2, prompts, self.max_sequence_length)
        with self._frozen_on_device(self.text_encoder, self.text_encoder_2):
            pooled = self.text_encoder(clip_ids.to(self.text_encoder.device), output_hidden_states=False).pooler_output.float()
            hidden = self.text_encoder_2(t5_ids.to(self.text_encoder_2.device), output_hidden_states=False)[0].float()
        return {"prompt_embeds": hidden, "pooled_prompt_embeds": pooled.to(hidden.device)}

    # -- denoising ------------------------------------------------------------------------------
    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        b, _, h, w = x.shape
        # the only sigma -> timestep conversion of this family: the transformer takes sigma (it scales by 1000 inside)
        t = batch_timestep(sigma, b, x.device)
        guidance = torch.full((b,), float(guidance_scale), device=x.device) if self.guidance_embeds else None
        out = model(
            hidden_states=pack_latents(x).to(self.model_dtype),
            timestep=t,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(self.model_dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            txt_ids=self.txt_ids,
            img_ids=self.img_ids,
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def latent_shape(self) -> tuple[int, ...]:
        h, w = patchable_sample_size(self, "FLUX")
        return (self.denoiser.config.in_channels // 4, h // self.vae_scale_factor, w // self.vae_scale_factor)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        return decode_latents(self, x)


class FluxConfig(PipelineConfig):
    """``pipeline.name: flux`` (FLUX.1 dev / schnell)."""

    name: str = "flux"
    adapter: ClassVar[Any] = FluxAdapter
