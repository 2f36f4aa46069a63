"""CogVideoX text-to-video: CogVideoXTransformer3DModel + T5 + AutoencoderKLCogVideoX.

A v-prediction DDPM model with an SNR-shifted, zero-terminal-SNR alpha-bar table: flowrl's
:class:`DiscreteSchedule` takes ``alphas_cumprod`` from the CogVideoXDDIMScheduler object, which already
includes ``snr_shift_scale`` and ``rescale_betas_zero_snr`` (alpha-bar = 0 at the last timestep, where the
v-prediction step needs no division by alpha-bar). Use the ``ddim`` sampler (``ode`` = DDIM eta 0).

flowrl's latents are (B, C, T_lat, H/8, W/8) like every video family; CogVideoX's transformer takes
(B, T, C, H, W), so the permutation happens here and nowhere else. 3D rotary embeddings (CogVideoX-5B,
1.5) are built once per size as in CogVideoXPipeline. CogVideoX 1.5 (``patch_size_t``) pads the latent
frames at the front to a multiple of patch_size_t; decode drops them as the pipeline does.

``pipeline.name=cogvideox pipeline.pretrained=THUDM/CogVideoX-2b``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig, prompt_token_ids
from .stable_diffusion import discrete_schedule


class CogVideoXAdapter(DiffusersAdapter):
    lora_pipeline_class = "CogVideoXPipeline"
    default_lora_targets = ("to_q", "to_k", "to_v", "to_out.0")  # diffusers' CogVideoX LoRA training default

    def _load_components(self) -> None:
        from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXTransformer3DModel
        from transformers import T5EncoderModel

        self._load_single_encoder(T5EncoderModel, AutoencoderKLCogVideoX, CogVideoXTransformer3DModel)
        # the 5B checkpoints ship CogVideoXDPMScheduler: the same alpha-bar table, read through the DDIM class
        scheduler = self._load(CogVideoXDDIMScheduler, "scheduler")
        self.prediction_type = scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise FlowRLError(f"unsupported CogVideoX prediction_type {self.prediction_type!r}.")
        self.schedule = discrete_schedule(self, scheduler)  # CogVideoX's configs: "trailing" (999, ..., from pure noise)
        cfg = self.transformer_config = self.denoiser.config  # kept: the denoiser may be wrapped (DDP) later
        self.vae_scale_factor_spatial = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.vae_scale_factor_temporal = int(self.vae.config.temporal_compression_ratio)
        self.scaling_factor = float(self.vae.config.scaling_factor)
        self.default_size = (cfg.sample_height * self.vae_scale_factor_spatial, cfg.sample_width * self.vae_scale_factor_spatial)
        self.max_sequence_length = self.config.max_sequence_length or cfg.max_text_seq_length
        h, w = self.sample_size()
        multiple = self.vae_scale_factor_spatial * cfg.patch_size
        if h % multiple or w % multiple:
            raise FlowRLError(f"pipeline.height and pipeline.width must be multiples of {multiple} for CogVideoX (got {h}x{w}).")
        # the VAE's temporal upsampling keeps the first frame apart only for an odd number of latent frames
        f, k = self.num_frames(), 2 * self.vae_scale_factor_temporal
        if (f - 1) % k:
            raise FlowRLError(f"pipeline.num_frames must be {k} * n + 1 for CogVideoX (got {f}; e.g. {(f - 1) // k * k + 1} or 49).")
        k = self.vae_scale_factor_temporal
        frames = (f - 1) // k + 1
        # CogVideoX 1.5: pad the latent frames to a multiple of patch_size_t (in front; dropped on decode)
        self.padding_frames = (-frames) % cfg.patch_size_t if cfg.patch_size_t else 0
        self.latent_frames = frames + self.padding_frames
        self._rotary: tuple[Tensor, Tensor] | None = None

    def num_frames(self) -> int:
        return self.config.num_frames or self.transformer_config.sample_frames

    # -- conditioning ---------------------------------------------------------------------------
    def _encode_prompts(self, prompts: list[str]) -> Condition:
        """T5 hidden states over max_sequence_length tokens (CogVideoXPipeline._get_t5_prompt_embeds)."""
        ids = prompt_token_ids(self.tokenizer, prompts, self.max_sequence_length)
        with self._frozen_on_device(self.text_encoder):
            hidden = self.text_encoder(ids.to(self.text_encoder.device))[0]
        return {"prompt_embeds": hidden.float()}

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer timestep conversion of this family (integer DDPM step)."""
        return self.schedule.timestep(sigma)

    def rotary_embeddings(self) -> tuple[Tensor, Tensor] | None:
        """CogVideoXPipeline._prepare_rotary_positional_embeddings for this run's size (built once)."""
        cfg = self.transformer_config
        if not cfg.use_rotary_positional_embeddings:
            return None
        if self._rotary is None:
            from diffusers.models.embeddings import get_3d_rotary_pos_embed
            from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

            h, w = self.sample_size()
            grid_h, grid_w = h // (self.vae_scale_factor_spatial * cfg.patch_size), w // (self.vae_scale_factor_spatial * cfg.patch_size)
            base_w, base_h = cfg.sample_width // cfg.patch_size, cfg.sample_height // cfg.patch_size
            if cfg.patch_size_t is None:  # CogVideoX 1.0
                crops = get_resize_crop_region_for_grid((grid_h, grid_w), base_w, base_h)
                cos, sin = get_3d_rotary_pos_embed(
                    embed_dim=cfg.attention_head_dim,
                    crops_coords=crops,
                    grid_size=(grid_h, grid_w),
                    temporal_size=self.latent_frames,
                    device=self.device,
                )
            else:  # CogVideoX 1.5
                cos, sin = get_3d_rotary_pos_embed(
                    embed_dim=cfg.attention_head_dim,
                    crops_coords=None,
                    grid_size=(grid_h, grid_w),
                    temporal_size=(self.latent_frames + cfg.patch_size_t - 1) // cfg.patch_size_t,
                    grid_type="slice",
                    max_size=(base_h, base_w),
                    device=self.device,
                )
            self._rotary = (cos, sin)
        return self._rotary

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        t = self.timestep(sigma).to(self.device).expand(x.shape[0])
        hidden = x.permute(0, 2, 1, 3, 4).to(self.model_dtype)  # (B, C, T, H, W) -> CogVideoX's (B, T, C, H, W)
        out = model(
            hidden_states=hidden,
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            timestep=t,
            image_rotary_emb=self.rotary_embeddings(),
            return_dict=False,
        )[0]
        return out.permute(0, 2, 1, 3, 4)

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.sample_size()
        return (
            self.transformer_config.in_channels,
            self.latent_frames,
            h // self.vae_scale_factor_spatial,
            w // self.vae_scale_factor_spatial,
        )

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        """(B, C, T_lat, h, w) latents -> (B, 3, T, H, W) float32 video in [0, 1], one sample at a time."""
        videos = []
        with self._frozen_on_device(self.vae):
            for latents in x[:, :, self.padding_frames :].split(1):
                latents = latents.to(self.vae.device, self.vae.dtype) / self.scaling_factor
                videos.append(self.vae.decode(latents).sample.float().to(self.device))
        return ((torch.cat(videos) + 1) / 2).clamp(0, 1)


class CogVideoXConfig(PipelineConfig):
    """``pipeline.name: cogvideox`` (CogVideoX text-to-video)."""

    name: str = "cogvideox"
    adapter: ClassVar[Any] = CogVideoXAdapter

    def probe_samples(self, n: int) -> Any:
        return torch.rand(n, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0))  # (B, C, T, H, W): two small frames
