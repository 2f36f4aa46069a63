"""Z-Image and Z-Image-Turbo: ZImageTransformer2DModel (single-stream DiT) + Qwen3 + AutoencoderKL (FLUX's VAE).

Rectified flow (``prediction_type="flow"``): flowrl's prediction is the velocity ``noise - x0``. Three
conventions of ``ZImagePipeline`` differ from the other flow families and are all handled in
:meth:`ZImageAdapter._forward`, the only place where flowrl's sigma meets the transformer:

* Time runs the other way: the transformer takes ``(1000 - sigma * T) / 1000`` (i.e. ``1 - sigma``, written as
  the pipeline computes it in float32) and multiplies it by its own ``t_scale`` (1000) inside.
* The transformer predicts ``x0 - noise``: the pipeline negates its output before the Euler step; so does flowrl.
* Inputs are lists: one ``(C, 1, H, W)`` latent per image and one caption of its own length per image
  (the Qwen3 hidden states of the real tokens only). A caption's length moves the image tokens' RoPE
  positions, so captions cannot be padded to a common length: the condition stores them padded with a mask,
  and ``_forward`` cuts each back to its real tokens.

Text encoding is ``ZImagePipeline._encode_prompt``: the prompt goes through the tokenizer's chat template as a
user message (``add_generation_prompt=True, enable_thinking=True``), padded to ``max_sequence_length`` (512),
and the Qwen3 penultimate hidden state of the real tokens is the caption.

Guidance, as the pipeline runs it: Z-Image-Turbo is distilled to run without guidance (``guidance_scale=0`` in
diffusers, ~8 steps): ``rollout.guidance_scale: 1``, one forward per step. The base Z-Image uses true CFG against
a negative prompt (``pipeline.negative_prompt``, default ``""`` as diffusers). diffusers writes its CFG as
``c + s (c - u)``, flowrl as ``u + w (c - u)``: the same prediction with ``w = s + 1`` (diffusers' 4.0 is flowrl's
5.0). The pipeline's optional ``cfg_normalization`` / ``cfg_truncation`` (off by default) are not implemented.

Default grid: ``ZImagePipeline``'s ``sigmas = torch.linspace(1, 1/K, K)`` (float32) handed to the scheduler, which
shifts them (static ``shift``, 3.0 for Z-Image-Turbo, or ``exp(mu)`` with mu from the image token count when the
config shifts dynamically), then 0.

``pipeline.name=z_image pipeline.pretrained=Tongyi-MAI/Z-Image-Turbo`` (or ``Tongyi-MAI/Z-Image``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import FLOW_GRIDS, FlowSchedule, sampling_grid
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig
from .sd3 import batch_timestep, decode_latents, flow_schedule, model_index


@dataclasses.dataclass(frozen=True)
class ZImageSchedule(FlowSchedule):
    """FlowSchedule whose "flux" grid is ZImagePipeline's default: ``torch.linspace(1, 1/K, K)`` in float32.

    FluxPipeline builds the same line with numpy in float64 before the scheduler casts it to float32; the two
    roundings differ by one float32 ulp in some entries for most K > 2, so the Z-Image grid is its own.
    """

    def sigmas(self, num_steps: int) -> Tensor:
        if self.grid != "flux":
            return super().sigmas(num_steps)
        K = int(num_steps)
        if K != num_steps or K < 1:
            return super().sigmas(num_steps)  # the base class raises its one-sentence error
        # get_default_z_image_sigmas: torch.linspace(...).tolist(); set_timesteps: np.array(...).astype(float32), shifted
        s = self._shift(np.array(torch.linspace(1.0, 1 / K, K).tolist()).astype(np.float32))
        grid = torch.from_numpy(np.asarray(s)).to(torch.float32)
        return torch.cat([grid, grid.new_zeros(1)])


class ZImageAdapter(DiffusersAdapter):
    denoiser_subfolder = "transformer"
    lora_pipeline_class = "ZImagePipeline"
    # Flow-Factory's Z-Image targets (models/z_image/z_image.py, default_target_modules): the attention
    # projections and the SwiGLU feed-forward of every block (main layers and both refiners)
    default_lora_targets = (
        "attention.to_q",
        "attention.to_k",
        "attention.to_v",
        "attention.to_out.0",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    )
    default_size = (1024, 1024)  # ZImagePipeline.__call__'s defaults
    default_max_sequence_length = 512  # ZImagePipeline.__call__'s default
    patch_size = 2  # the transformer's default patch_size, which the pipeline uses

    # (called by DiffusersAdapter.guidance_mode's setter; Z-Image has no guidance embedding)
    def check_guidance_mode(self, mode: str) -> None:
        if mode == "embedded":
            raise FlowRLError(
                "rollout.guidance_mode 'embedded' needs a guidance-distilled model with a guidance embedding; Z-Image has none: "
                "use 'cfg' (guidance_scale 1 for Z-Image-Turbo, true CFG for the base Z-Image)."
            )

    # -- loading --------------------------------------------------------------------------------
    def _load_components(self) -> None:
        import transformers
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
        from transformers import AutoTokenizer

        entry = model_index(self).get("text_encoder")
        name = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] else "Qwen3Model"
        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        if not getattr(self.tokenizer, "chat_template", None):
            raise FlowRLError(f"the tokenizer of '{self.source}' has no chat template, which Z-Image's prompt encoding goes through.")
        self.text_encoder = self._load(getattr(transformers, name, transformers.Qwen3Model), "text_encoder")
        self.vae = self._load(AutoencoderKL, "vae")
        self.denoiser = self._load(ZImageTransformer2DModel, "transformer")
        if self.patch_size not in tuple(self.denoiser.config.all_patch_size):
            raise FlowRLError(
                f"the Z-Image transformer of '{self.source}' has no {self.patch_size}x{self.patch_size} patch embedding "
                f"(all_patch_size={list(self.denoiser.config.all_patch_size)}), which ZImagePipeline uses."
            )
        scheduler = self._load(FlowMatchEulerDiscreteScheduler, "scheduler")
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        self.latent_channels = int(self.denoiser.config.in_channels)
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.max_sequence_length = self.config.max_sequence_length or self.default_max_sequence_length
        h, w = self.latent_shape()[1:]
        # ZImagePipeline's default: its own linspace sigmas, shifted by the scheduler; mu (used only with dynamic
        # shifting) from the token count with FLUX's defaults for the keys a config lacks
        grid = sampling_grid(self.config, "flux", FLOW_GRIDS)
        schedule = flow_schedule(scheduler.config, (h // 2) * (w // 2), grid, default_max_shift=1.15)
        default = self.config.sampling_grid == "default"  # an explicit "flux" is FLUX's grid, as for every family
        self.schedule = ZImageSchedule(**dataclasses.asdict(schedule)) if default else schedule

    # -- conditioning ---------------------------------------------------------------------------
    def _encode_prompts(self, prompts: list[str]) -> Condition:
        """Qwen3 penultimate hidden states of the chat-templated prompts, zero after the real tokens, and the mask."""
        texts = [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for p in prompts
        ]
        inputs = self.tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt")
        with self._frozen_on_device(self.text_encoder):
            device = self.text_encoder.device
            mask = inputs.attention_mask.to(device).bool()
            hidden = self.text_encoder(input_ids=inputs.input_ids.to(device), attention_mask=mask, output_hidden_states=True).hidden_states[
                -2
            ]
        hidden = torch.where(mask[..., None], hidden.float(), torch.zeros((), device=hidden.device))
        return {"prompt_embeds": hidden, "prompt_mask": mask}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """CFG's other branch: the encoding of ``pipeline.negative_prompt`` (``""`` unless set, as diffusers)."""
        return {k: v.expand(batch, *v.shape[1:]) for k, v in self.encode([self.config.negative_prompt]).items()}

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer time conversion of this family: ``(1000 - sigma * T) / 1000``, the
        pipeline's float32 expression for ``1 - sigma`` (its scheduler timestep is ``sigma * T``)."""
        return (1000 - sigma.float() * self.num_train_timesteps) / 1000

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        t = self.timestep(batch_timestep(sigma, x.shape[0], x.device))
        latents = list(x.to(self.model_dtype).unsqueeze(2).unbind(0))  # one (C, 1, H, W) frame per image
        embeds = cond["prompt_embeds"].to(self.model_dtype)
        captions = [e[m] for e, m in zip(embeds, cond["prompt_mask"].to(embeds.device))]  # each its real tokens
        out = model(latents, t, captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)  # the transformer predicts x0 - noise

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.sample_size()
        multiple = self.vae_scale_factor * self.patch_size
        if h % multiple or w % multiple:
            raise FlowRLError(f"pipeline.height and pipeline.width ({h}x{w}) must be multiples of {multiple} for Z-Image.")
        return (self.latent_channels, h // self.vae_scale_factor, w // self.vae_scale_factor)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        return decode_latents(self, x)


class ZImageConfig(PipelineConfig):
    """``pipeline.name: z_image`` (Z-Image, Z-Image-Turbo)."""

    name: str = "z_image"
    negative_prompt: str = Field(
        "", description="The prompt of CFG's unconditional branch (base Z-Image); unused at guidance_scale 1 (Turbo)."
    )
    adapter: ClassVar[Any] = ZImageAdapter
