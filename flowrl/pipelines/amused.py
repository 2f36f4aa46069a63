"""Adapter for masked-token image models: aMUSEd (``AmusedPipeline``: ``VQModel`` + ``UVit2DModel``) and the embedded
``digits_masked``, which is the same classes at 8x8.

An image is a grid of VQ codebook tokens; generation starts from every token masked and unmasks them in N steps
(``samplers/masked_image.py``, AmusedScheduler's step with exact per-step log-probs). The adapter supplies what the
sampler and the loop need, the way every family does:

* ``predict(x, sigma, cond, guidance_scale)``: the codebook logits (B, L, V) of every position of the token state x
  (B, L) (float token ids), with classifier-free guidance u + s (c - u) as AmusedPipeline applies it. The
  transformer takes no time input (the mask tokens say how far generation is), so sigma is not read;
* ``initial_noise``: the all-masked state (no random draw); ``decode``: the VQ decoder on the tokens, clipped to
  [0, 1] as AmusedPipeline's output, so every image reward, the held-out evaluation and the sample grids read
  decoded images like any image model's;
* the text condition as AmusedPipeline builds it: the CLIP text encoder's projected pooled output
  (``pooled_text_emb``) and its penultimate hidden states (``encoder_hidden_states``), prompts padded to the
  tokenizer's ``model_max_length``; the unconditional branch is the empty prompt (its negative prompt default).

The transformer is what trains (full or LoRA on its attention projections, peft through diffusers'
``PeftAdapterMixin``); the VQ model and the text encoder are frozen. A LoRA checkpoint also holds the adapter in
diffusers' format (``UVit2DModel.save_lora_adapter``; ``load_lora_adapter`` reads it back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from ..samplers.masked_image import MaskSchedule
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig, prompt_token_ids, resolve_source
from .embedded_adapter import ASSETS

EMBEDDED = ("digits_masked",)
# AmusedPipeline's defaults for the micro-conditioning it appends to the pooled text embedding
CROP_COORD = (0, 0)
AESTHETIC_SCORE = 6


class AmusedAdapter(DiffusersAdapter):
    """aMUSEd-style masked-token text-to-image model (see the module docstring)."""

    denoiser_subfolder = "transformer"
    prediction_type = "masked_tokens"

    def _resolve_source(self, pretrained: str) -> str:
        return str(ASSETS / pretrained) if pretrained in EMBEDDED else resolve_source(pretrained)

    def _load_components(self) -> None:
        from diffusers import AmusedScheduler, UVit2DModel, VQModel
        from transformers import CLIPTextModelWithProjection

        self._load_single_encoder(CLIPTextModelWithProjection, VQModel, UVit2DModel, vae_subfolder="vqvae")
        scheduler = self._load(AmusedScheduler, "scheduler")
        self.mask_token_id = int(scheduler.config.mask_token_id)
        self.schedule = MaskSchedule(scheduler.config.masking_schedule)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.latent_channels = self.vae.config.latent_channels
        grid = self.denoiser.config.sample_size  # read here: under DDP the denoiser is wrapped later
        self.default_size = (grid * self.vae_scale_factor, grid * self.vae_scale_factor)

    def token_grid(self) -> tuple[int, int]:
        h, w = self.sample_size()
        return h // self.vae_scale_factor, w // self.vae_scale_factor

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        ids = prompt_token_ids(self.tokenizer, prompts, self.tokenizer.model_max_length)
        with self._frozen_on_device(self.text_encoder):
            out = self.text_encoder(ids.to(self.text_encoder.device), return_dict=True, output_hidden_states=True)
        return {"pooled_text_emb": out.text_embeds.float(), "encoder_hidden_states": out.hidden_states[-2].float()}

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        h, w = self.token_grid()
        b = x.shape[0]
        height, width = self.sample_size()
        # the order AmusedPipeline writes them in: width, height (the original size), crop coordinates, aesthetic score
        micro_conds = torch.tensor([[width, height, *CROP_COORD, AESTHETIC_SCORE]], device=self.device, dtype=self.model_dtype)
        logits = model(
            x.long().view(b, h, w).to(self.device),
            micro_conds=micro_conds.expand(b, -1),
            pooled_text_emb=cond["pooled_text_emb"].to(self.model_dtype),
            encoder_hidden_states=cond["encoder_hidden_states"].to(self.model_dtype),
        )
        # (B, V, h, w) -> (B, L, V) with AmusedScheduler's own reshape, so the sampler's softmax sees its layout
        return logits.reshape(b, logits.shape[1], h * w).permute(0, 2, 1)

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.token_grid()
        return (h * w,)

    def initial_noise(self, batch: int, generator: torch.Generator) -> Tensor:
        """Every token masked: generation starts from no randomness (the sampler's steps draw it all)."""
        return torch.full((batch, *self.latent_shape()), float(self.mask_token_id), device=self.device)

    def decode(self, x: Tensor) -> Tensor:
        """Token ids (B, L) -> images (B, C, H, W) in [0, 1], the VQ decoder's output clipped as AmusedPipeline's."""
        h, w = self.token_grid()
        b = x.shape[0]
        with self._frozen_on_device(self.vae):
            image = self.vae.decode(
                x.long().view(b, h, w).to(self.vae.device),
                force_not_quantize=True,
                shape=(b, h, w, self.latent_channels),
            ).sample
        return image.float().clip(0, 1).to(self.device)

    def save_lora(self, directory: str | Path, state_dict: dict[str, Tensor] | None = None) -> Path:
        """The transformer's LoRA in diffusers' format, the file ``UVit2DModel.save_lora_adapter`` writes (so
        ``load_lora_adapter(directory)`` reads it back); ``state_dict``: the weights gathered whole under FSDP."""
        import json

        from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        from ..errors import FlowRLError

        if not self.has_lora:
            raise FlowRLError("save_lora needs a LoRA run (pipeline.lora is not set).")
        model = getattr(self.denoiser, "module", self.denoiser)
        layers = {k: v.contiguous() for k, v in get_peft_model_state_dict(model, state_dict=state_dict).items()}
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config["default"].to_dict().items()}
        path = Path(directory) / LORA_WEIGHT_NAME_SAFE
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(layers, str(path), metadata={"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True)})
        return path


class AmusedConfig(PipelineConfig):
    """``pipeline.name: amused``: aMUSEd (``amused/amused-256``, ``amused/amused-512``, or a local AmusedPipeline
    directory) and the embedded masked-token digits model ``digits_masked``; sampled with ``sampler.name:
    masked_image``."""

    name: str = "amused"
    pretrained: str = Field(
        "digits_masked", description="aMUSEd's hub id (amused/amused-256, -512), a local AmusedPipeline directory or digits_masked."
    )
    adapter: ClassVar[Any] = AmusedAdapter

    def default_num_threads(self) -> int | None:
        return 1 if self.pretrained in EMBEDDED else None  # the embedded model is too small to share among threads

    def probe_samples(self, n: int) -> Any:
        if self.pretrained in EMBEDDED:
            return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(0))
        return super().probe_samples(n)
