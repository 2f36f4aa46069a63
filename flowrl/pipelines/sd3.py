"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel (MMDiT) + two CLIPs + T5 + AutoencoderKL (16 channels).

Rectified flow (``prediction_type="flow"``): the transformer predicts the velocity ``noise - x0``, the
convention of diffusers' FlowMatchEulerDiscreteScheduler. The default sampling grid is the pipeline's:
``FlowMatchEulerDiscreteScheduler.set_timesteps(K)`` with the checkpoint's shift (3.0 for SD3.5), whose last
nonzero sigma is 0.0089 at K = 10 (``pipeline.sampling_grid=linspace`` gives ``shift(linspace(1, 0, K + 1))``,
last nonzero sigma 0.25 at K = 10). The text encoding follows
``StableDiffusion3Pipeline.encode_prompt`` exactly (two CLIP penultimate hidden states concatenated on
the feature axis, padded to the T5 width and concatenated with the T5 tokens on the sequence axis;
pooled = both CLIP projections concatenated; a checkpoint saved without T5 gets zeros in its place).
``pipeline.name=sd3 pipeline.pretrained=stabilityai/stable-diffusion-3.5-medium``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import FLOW_GRIDS, FlowGrid, FlowSchedule, sampling_grid
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig, prompt_token_ids

# The joint attention of an MMDiT block, image stream (to_q/k/v, to_out) and text stream (add_*_proj, to_add_out):
# Flow-GRPO's LoRA targets for SD3.5 and FLUX.1, Flow-Factory's for Qwen-Image (without the feed-forward layers).
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


def modules_ending_with(model: torch.nn.Module, suffixes: tuple[str, ...], exclude: set[str]) -> tuple[str, ...]:
    """Full names of ``model``'s modules whose name ends in one of ``suffixes`` (after a dot), less ``exclude``: the
    LoRA targets of a model whose output cannot depend on some of them (a LoRA there would never train)."""
    endings = tuple("." + t for t in suffixes)
    return tuple(name for name, _ in model.named_modules() if name.endswith(endings) and name not in exclude)


def flow_shift(scheduler_config, image_seq_len: int, default_max_shift: float = 1.16) -> float:
    """The resolution shift a FlowMatchEulerDiscreteScheduler applies, as FlowSchedule's ``shift``.

    Static: ``config.shift``. Dynamic (``use_dynamic_shifting``, FLUX): ``exp(mu)`` with mu linear in the
    image token count between (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), computed
    as the pipelines' ``calculate_shift`` does; diffusers' exponential ``time_shift`` with that mu is
    FlowSchedule's shift with ``dynamic=True`` (its "linear" time shift is the same with shift = mu). Options
    that change the sigma grid in other ways (terminal stretch, Karras / exponential / beta sigmas, inverted
    sigmas) are refused.
    """
    get = scheduler_config.get
    for option in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"):
        if get(option, None):
            raise FlowRLError(
                f"the scheduler option {option}={get(option)!r} is not supported (flowrl samples on its own shifted sigma grid)."
            )
    if not get("use_dynamic_shifting", False):
        return float(get("shift", 1.0))
    kind = get("time_shift_type", "exponential")
    if kind not in ("exponential", "linear"):
        raise FlowRLError(f"the scheduler's time_shift_type {kind!r} is not supported (only 'exponential' or 'linear').")
    base_len, max_len = get("base_image_seq_len", 256), get("max_image_seq_len", 4096)
    base_shift, max_shift = get("base_shift", 0.5), get("max_shift", default_max_shift)
    m = (max_shift - base_shift) / (max_len - base_len)
    mu = image_seq_len * m + (base_shift - m * base_len)
    return math.exp(mu) if kind == "exponential" else mu


def flow_schedule(scheduler_config, image_seq_len: int, grid: FlowGrid, default_max_shift: float = 1.16) -> FlowSchedule:
    """The checkpoint scheduler's shift (static or from the image size) on the sampling grid ``grid``."""
    return FlowSchedule(
        shift=flow_shift(scheduler_config, image_seq_len, default_max_shift),
        grid=grid,
        dynamic=bool(scheduler_config.get("use_dynamic_shifting", False)),
        num_train_timesteps=int(scheduler_config.get("num_train_timesteps", 1000)),
    )


def batch_timestep(sigma: Tensor, batch: int, device: torch.device) -> Tensor:
    """sigma (scalar or (B,)) as a (B,) float32 tensor."""
    return torch.broadcast_to(sigma.reshape(-1).float(), (batch,)).to(device)


def model_index(adapter: DiffusersAdapter) -> dict:
    """The checkpoint's model_index.json (which components it holds)."""
    from diffusers import DiffusionPipeline

    return adapter._read_config(DiffusionPipeline, None, "model_index.json")


class SD3Adapter(DiffusersAdapter):
    denoiser_subfolder = "transformer"
    lora_pipeline_class = "StableDiffusion3Pipeline"
    lora_target_suffixes = JOINT_ATTENTION_LORA_TARGETS  # Flow-GRPO's SD3.5 targets, every MMDiT block's
    default_max_sequence_length = 256  # T5 tokens, diffusers' default for SD3

    def _load_components(self) -> None:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        components = model_index(self)
        self.tokenizer = self._load(AutoTokenizer, "tokenizer")
        self.tokenizer_2 = self._load(AutoTokenizer, "tokenizer_2")
        self.text_encoder = self._load(CLIPTextModelWithProjection, "text_encoder")
        self.text_encoder_2 = self._load(CLIPTextModelWithProjection, "text_encoder_2")
        # SD3 checkpoints may be saved without T5 (text_encoder_3: [null, null]): diffusers then uses zeros
        has_t5 = (components.get("text_encoder_3") or [None])[0] is not None
        self.tokenizer_3 = self._load(AutoTokenizer, "tokenizer_3") if has_t5 else None
        self.text_encoder_3 = self._load(T5EncoderModel, "text_encoder_3") if has_t5 else None
        self.vae = self._load(AutoencoderKL, "vae")
        self.denoiser = self._load(SD3Transformer2DModel, "transformer")
        scheduler = self._load(FlowMatchEulerDiscreteScheduler, "scheduler")
        self.num_train_timesteps = scheduler.config.num_train_timesteps
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.patch_size = self.denoiser.config.patch_size
        self.default_size = (self.denoiser.config.sample_size * self.vae_scale_factor,) * 2
        self.clip_max_length = self.tokenizer.model_max_length  # diffusers' tokenizer_max_length, used for both CLIPs
        self.max_sequence_length = self.config.max_sequence_length or self.default_max_sequence_length
        h, w = self.latent_shape()[1:]
        # StableDiffusion3Pipeline's default: FlowMatchEulerDiscreteScheduler.set_timesteps(K) (mu from the token count
        # when the config shifts dynamically), which is what Flow-GRPO samples on
        grid = sampling_grid(self.config, "flow_match", FLOW_GRIDS)
        self.schedule = flow_schedule(scheduler.config, (h // self.patch_size) * (w // self.patch_size), grid)

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """Flow-GRPO's targets as full module names, less the text-stream query of the last block.

        The last MMDiT block is ``context_pre_only``: its text tokens are dropped after attention, so
        its ``attn.add_q_proj`` cannot change the output (a LoRA there would never train).
        """
        dead = {
            f"transformer_blocks.{i}.attn.add_q_proj" for i, block in enumerate(self.denoiser.transformer_blocks) if block.context_pre_only
        }
        return modules_ending_with(self.denoiser, self.lora_target_suffixes, dead)

    # -- conditioning ---------------------------------------------------------------------------
    def _clip(self, tokenizer, encoder, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = prompt_token_ids(tokenizer, prompts, self.clip_max_length)
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        return out.hidden_states[-2].float(), out.text_embeds.float()  # penultimate layer, pooled projection

    def _t5(self, prompts: list[str]) -> Tensor:
        if self.text_encoder_3 is None:
            return torch.zeros(len(prompts), self.max_sequence_length, self.denoiser.config.joint_attention_dim)
        ids = prompt_token_ids(self.tokenizer_3, prompts, self.max_sequence_length)
        return self.text_encoder_3(ids.to(self.text_encoder_3.device))[0].float()

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        encoders = [m for m in (self.text_encoder, self.text_encoder_2, self.text_encoder_3) if m is not None]
        with self._frozen_on_device(*encoders):
            hidden_1, pooled_1 = self._clip(self.tokenizer, self.text_encoder, prompts)
            hidden_2, pooled_2 = self._clip(self.tokenizer_2, self.text_encoder_2, prompts)
            t5 = self._t5(prompts).to(hidden_1.device)
        clip = torch.cat([hidden_1, hidden_2], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # as diffusers (it truncates if T5 is narrower)
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2), "pooled_prompt_embeds": torch.cat([pooled_1, pooled_2], dim=-1)}

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer timestep conversion of this family: ``sigma * num_train_timesteps``."""
        return sigma * self.num_train_timesteps

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        t = self.timestep(batch_timestep(sigma, x.shape[0], x.device))
        return model(
            hidden_states=x.to(self.model_dtype),
            timestep=t,
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            pooled_projections=cond["pooled_prompt_embeds"].to(self.model_dtype),
            return_dict=False,
        )[0]

    def latent_shape(self) -> tuple[int, ...]:
        h, w = self.sample_size()
        multiple = self.vae_scale_factor * self.patch_size
        if h % multiple or w % multiple:
            raise FlowRLError(f"pipeline.height and pipeline.width ({h}x{w}) must be multiples of {multiple} for this model.")
        return (self.denoiser.config.in_channels, h // self.vae_scale_factor, w // self.vae_scale_factor)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        return decode_latents(self, x)


def decode_latents(adapter: DiffusersAdapter, latents: Tensor) -> Tensor:
    """(B, C, h, w) latents -> float32 images in [0, 1], undoing the VAE's scaling and shift factors."""
    vae = adapter.vae
    with adapter._frozen_on_device(vae):
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = vae.decode(z).sample.float()
    return ((images + 1) / 2).clamp(0, 1).to(adapter.device)


class SD3Config(PipelineConfig):
    """``pipeline.name: sd3`` (Stable Diffusion 3 / 3.5)."""

    name: str = "sd3"
    adapter: ClassVar[Any] = SD3Adapter
