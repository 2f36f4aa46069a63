"""FLUX.2: Flux2Transformer2DModel + one LLM text encoder + AutoencoderKLFlux2 (32 channels, batch-norm statistics).

One adapter for the two diffusers pipelines of the family, told apart by the checkpoint's model_index.json:

* ``Flux2Pipeline`` (FLUX.2-dev): Mistral-Small-3.1 (``Mistral3ForConditionalGeneration``) text encoder behind
  a chat template with BFL's system message, hidden states of layers (10, 20, 30) stacked on the feature axis.
  Guidance-distilled: the scale is the transformer's ``guidance`` input, one forward per step
  (``rollout.guidance_mode: embedded``, this adapter's default for it).
* ``Flux2KleinPipeline`` (FLUX.2-klein 4B / 9B): a Qwen3 text encoder (chat template, thinking off), layers
  (9, 18, 27). No guidance embedding (the pipeline passes ``guidance=None``). The base checkpoints
  (``is_distilled: false``) use true CFG against the empty prompt when the scale is > 1, flowrl's ``cfg``;
  the step-distilled ones (``is_distilled: true``) run without guidance, and a scale other than 1 is refused
  (diffusers ignores it with a warning).

Rectified flow (velocity ``noise - x0``, the FlowMatchEulerDiscreteScheduler convention).

* Latents: flowrl keeps the trajectory in the layout the pipeline draws its noise in, the 2x2-patchified and
  batch-norm-normalised VAE latents ``(B, 4 * 32, H/16, W/16)``; inside :meth:`Flux2Adapter._forward` they become
  the token sequence ``(B, H/16 * W/16, 128)`` (a reshape: FLUX.2's patch size is 1 on these) with 4-D RoPE ids
  ``(t, h, w, l)``. :meth:`Flux2Adapter.decode` undoes the batch norm with the VAE's running statistics,
  un-patchifies to ``(B, 32, H/8, W/8)`` and decodes.
* Time: the transformer takes ``timestep / 1000`` of the scheduler's ``sigma * 1000`` (it multiplies by 1000
  inside). The default grid is the pipelines': ``sigmas = linspace(1, 1/K, K)`` given to the scheduler, which
  shifts them in float32 with ``mu = compute_empirical_mu(image tokens, K)``, BFL's fit that depends on the
  number of steps as well as on the image size (:class:`Flux2Schedule`).

``pipeline.name=flux2 pipeline.pretrained=black-forest-labs/FLUX.2-dev`` (or ``black-forest-labs/FLUX.2-klein-4B``,
``FLUX.2-klein-base-4B``, the 9B ones). Text-to-image only: reference images (FLUX.2's editing) are not supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import FLOW_GRIDS, FlowSchedule, sampling_grid
from ..types import Condition
from .diffusers_base import DiffusersAdapter, PipelineConfig
from .flux import patchable_sample_size
from .sd3 import batch_timestep, flow_shift, model_index

Variant = Literal["dev", "klein"]
PIPELINES: dict[str, Variant] = {"Flux2Pipeline": "dev", "Flux2KleinPipeline": "klein"}
# the text encoder's hidden states each pipeline stacks (its ``text_encoder_out_layers`` default)
OUT_LAYERS: dict[Variant, tuple[int, ...]] = {"dev": (10, 20, 30), "klein": (9, 18, 27)}
TEXT_ENCODERS: dict[Variant, str] = {"dev": "Mistral3ForConditionalGeneration", "klein": "Qwen3ForCausalLM"}


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL's empirical time-shift parameter (flux2 ``sampling.py``, diffusers' ``compute_empirical_mu``): linear in
    the image token count, and, up to 4300 tokens (about 1024x1056 px), also in the number of steps, interpolated
    between fits for 10 and 200 steps."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


@dataclass(frozen=True)
class Flux2Schedule(FlowSchedule):
    """A FlowSchedule whose dynamic shift depends on the number of steps K as well as on the image size.

    With ``dynamic`` (the scheduler config's ``use_dynamic_shifting``) ``sigmas(K)`` is the ``grid`` shifted by
    ``exp(empirical_mu(image_seq_len, K))`` (``mu`` itself for ``time_shift_type: linear``), as the FLUX.2
    pipelines hand ``mu`` to ``set_timesteps`` on every call; ``shift`` is then unused. Without it the scheduler
    ignores ``mu`` and this is the plain FlowSchedule with the config's static ``shift``.
    """

    image_seq_len: int = 0
    time_shift: Literal["exponential", "linear"] = "exponential"

    def sigmas(self, num_steps: int) -> Tensor:
        if not self.dynamic:
            return super().sigmas(num_steps)
        mu = empirical_mu(self.image_seq_len, num_steps)
        shift = math.exp(mu) if self.time_shift == "exponential" else mu
        return FlowSchedule(shift=shift, grid=self.grid, dynamic=True, num_train_timesteps=self.num_train_timesteps).sigmas(num_steps)


def pack_latents(x: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, h * w, C), row-major tokens: ``Flux2Pipeline._pack_latents``."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_latents(x: Tensor, height: int, width: int) -> Tensor:
    """(B, h * w, C) -> (B, C, h, w), the inverse of :func:`pack_latents` (``_unpack_latents_with_ids`` for the
    row-major ids of :func:`latent_ids`)."""
    b, _, c = x.shape
    return x.permute(0, 2, 1).reshape(b, c, height, width)


def unpatchify(x: Tensor) -> Tensor:
    """(B, 4C, h, w) -> (B, C, 2h, 2w): ``Flux2Pipeline._unpatchify_latents`` (channel c * 4 + 2 * i + j is pixel (i, j)
    of the 2x2 patch)."""
    b, c4, h, w = x.shape
    return x.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)


def latent_ids(height: int, width: int) -> Tensor:
    """(h * w, 4) RoPE positions ``(t, h, w, l)`` of the image tokens: ``Flux2Pipeline._prepare_latent_ids``."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width), torch.arange(1))


def text_ids(length: int) -> Tensor:
    """(L, 4) RoPE positions ``(0, 0, 0, l)`` of the text tokens: ``Flux2Pipeline._prepare_text_ids``."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length))


class Flux2Adapter(DiffusersAdapter):
    denoiser_subfolder = "transformer"
    default_max_sequence_length = 512  # text tokens, both pipelines' default

    def __init__(self, config, device, loaded=None):
        super().__init__(config, device, loaded=loaded)
        # FLUX.2-dev takes the scale as an input; the trainer sets rollout.guidance_mode after construction
        self.guidance_mode = "embedded" if self.guidance_embeds else "cfg"

    # -- loading --------------------------------------------------------------------------------
    def _variant(self, index: dict) -> tuple[Variant, bool]:
        """("dev" | "klein", step-distilled) from model_index.json (or the class of a pipeline given in memory)."""
        name = type(self.loaded).__name__ if self.loaded is not None else index.get("_class_name")
        if name not in PIPELINES:
            raise FlowRLError(
                f"'{self.source}' is a {name or 'model without a pipeline class'} checkpoint; pipeline.name=flux2 reads "
                f"{' and '.join(PIPELINES)} checkpoints (FLUX.2-dev, FLUX.2-klein)."
            )
        return PIPELINES[name], bool(index.get("is_distilled", False))

    def _text_encoder_class(self, index: dict) -> Any:
        """The transformers class model_index.json names for the text encoder, else the pipeline's own."""
        import transformers

        entry = index.get("text_encoder")
        named = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] else None
        return getattr(transformers, named or TEXT_ENCODERS[self.variant], getattr(transformers, TEXT_ENCODERS[self.variant]))

    def _load_components(self) -> None:
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
        from transformers import AutoProcessor, AutoTokenizer

        index = model_index(self)
        self.variant, self.step_distilled = self._variant(index)
        self.lora_pipeline_class = "Flux2Pipeline" if self.variant == "dev" else "Flux2KleinPipeline"
        # FLUX.2-dev's tokenizer is a PixtralProcessor (its chat template takes typed message content), klein's a
        # Qwen2 tokenizer
        self.tokenizer = self._load(AutoProcessor if self.variant == "dev" else AutoTokenizer, "tokenizer")
        self.text_encoder = self._load(self._text_encoder_class(index), "text_encoder")
        self.vae = self._load(AutoencoderKLFlux2, "vae")
        self.denoiser = self._load(Flux2Transformer2DModel, "transformer")
        scheduler = self._load(FlowMatchEulerDiscreteScheduler, "scheduler")
        # the klein pipeline passes guidance=None whatever the transformer has
        self.guidance_embeds = self.variant == "dev" and bool(self.denoiser.config.guidance_embeds)
        self.out_layers = OUT_LAYERS[self.variant]
        text_config = getattr(self.text_encoder.config, "text_config", self.text_encoder.config)
        if max(self.out_layers) > text_config.num_hidden_layers:
            raise FlowRLError(
                f"the text encoder of '{self.source}' has {text_config.num_hidden_layers} layers, but FLUX.2 stacks the hidden "
                f"states of layers {self.out_layers}."
            )
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.default_size = (128 * self.vae_scale_factor,) * 2  # the pipelines' default_sample_size (1024 px)
        self.max_sequence_length = self.config.max_sequence_length or self.default_max_sequence_length
        self.num_train_timesteps = int(scheduler.config.num_train_timesteps)
        _, h, w = self.latent_shape()
        self.img_ids = latent_ids(h, w).to(self.device)
        self.txt_ids = text_ids(self.max_sequence_length).to(self.device)
        self.schedule = self._schedule(scheduler.config, h * w)

    def _schedule(self, scheduler_config, image_seq_len: int) -> Flux2Schedule:
        """The pipelines' default grid (sigmas linspace(1, 1/K, K) handed to the scheduler: FlowSchedule's "flux"
        grid) with the scheduler's shift: the empirical mu of K steps when it shifts dynamically, else static."""
        flow_shift(scheduler_config, image_seq_len)  # refuses the options that reshape the grid (Karras, shift_terminal...)
        return Flux2Schedule(
            shift=float(scheduler_config.get("shift", 1.0)),
            grid=sampling_grid(self.config, "flux", FLOW_GRIDS),
            dynamic=bool(scheduler_config.get("use_dynamic_shifting", False)),
            num_train_timesteps=self.num_train_timesteps,
            image_seq_len=image_seq_len,
            time_shift=scheduler_config.get("time_shift_type", "exponential"),
        )

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """Full module names: the attention projections of both streams of the double-stream blocks (Flow-GRPO's
        FLUX list, as for FLUX.1), and of the single-stream blocks the fused q/k/v + MLP input projection and the
        fused output projection (what diffusers' FLUX.2 LoRA scripts add). The single blocks' ``attn.to_out`` is
        named by index: as a suffix it would also name the double blocks' ``attn.to_out`` ModuleList."""
        double = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
        names = [f"transformer_blocks.{i}.attn.{p}" for i in range(len(self.denoiser.transformer_blocks)) for p in double]
        names += [
            f"single_transformer_blocks.{i}.attn.{p}"
            for i in range(len(self.denoiser.single_transformer_blocks))
            for p in ("to_qkv_mlp_proj", "to_out")
        ]
        return tuple(names)

    # -- guidance -------------------------------------------------------------------------------
    def check_guidance_mode(self, mode: str) -> None:
        embeds = getattr(self, "guidance_embeds", None)
        if embeds is True and mode != "embedded":
            raise FlowRLError(
                f"FLUX.2-dev is guidance-distilled: set rollout.guidance_mode to 'embedded' (got '{mode}'); the scale is "
                "then the transformer's guidance input, one forward per step."
            )
        if embeds is False and mode == "embedded":
            raise FlowRLError(
                "rollout.guidance_mode 'embedded' needs a guidance embedding, which FLUX.2-klein does not use: use 'cfg' "
                "(true CFG against the empty prompt for the base models, guidance_scale 1 for the distilled ones)."
            )

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        if self.step_distilled and guidance_scale != 1.0:
            raise FlowRLError(
                f"this FLUX.2-klein checkpoint is step-distilled (is_distilled: true) and runs without guidance: set "
                f"rollout.guidance_scale to 1 (got {guidance_scale}; diffusers ignores it), or use a klein-base checkpoint."
            )
        return super().predict(x, sigma, cond, guidance_scale)

    # -- conditioning ---------------------------------------------------------------------------
    def _token_ids(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask), padded to max_sequence_length, through each pipeline's chat template."""
        n = self.max_sequence_length
        if self.variant == "dev":  # Flux2Pipeline._get_mistral_3_small_prompt_embeds
            from diffusers.pipelines.flux2.pipeline_flux2 import format_input
            from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

            inputs = self.tokenizer.apply_chat_template(
                format_input(prompts=prompts, system_message=SYSTEM_MESSAGE),
                add_generation_prompt=False,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                padding="max_length",
                truncation=True,
                max_length=n,
            )
            return inputs["input_ids"], inputs["attention_mask"]
        ids, masks = [], []  # Flux2KleinPipeline._get_qwen3_prompt_embeds: one prompt at a time
        for prompt in prompts:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            inputs = self.tokenizer(text, return_tensors="pt", padding="max_length", truncation=True, max_length=n)
            ids.append(inputs["input_ids"])
            masks.append(inputs["attention_mask"])
        return torch.cat(ids), torch.cat(masks)

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        """The stacked hidden states of ``out_layers``, token by token: (B, L, len(out_layers) * hidden)."""
        input_ids, attention_mask = self._token_ids(prompts)
        with self._frozen_on_device(self.text_encoder):
            device = self.text_encoder.device
            out = self.text_encoder(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), output_hidden_states=True, use_cache=False
            )
        stacked = torch.stack([out.hidden_states[k] for k in self.out_layers], dim=1)  # (B, layers, L, D)
        b, layers, length, dim = stacked.shape
        return {"prompt_embeds": stacked.permute(0, 2, 1, 3).reshape(b, length, layers * dim).float()}

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer timestep conversion of this family: the pipelines pass the scheduler's
        timestep ``sigma * num_train_timesteps`` divided by 1000 (float32 both times, as they compute it); the
        transformer multiplies by 1000 again inside."""
        return sigma * self.num_train_timesteps / 1000

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        b, _, h, w = x.shape
        guidance = torch.full((b,), float(guidance_scale), device=x.device) if self.guidance_embeds else None
        out = model(
            hidden_states=pack_latents(x).to(self.model_dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            timestep=self.timestep(batch_timestep(sigma, b, x.device)),
            img_ids=self.img_ids,
            txt_ids=self.txt_ids,
            guidance=guidance,
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def latent_shape(self) -> tuple[int, ...]:
        h, w = patchable_sample_size(self, "FLUX.2")
        multiple = self.vae_scale_factor * 2  # the VAE's latents come 2x2-patched into channels
        return (self.denoiser.config.in_channels, h // multiple, w // multiple)

    def denormalize(self, x: Tensor) -> Tensor:
        """Patchified, normalised latents (B, 4C, h, w) -> the VAE's latents (B, C, 2h, 2w): undo the batch norm with
        the VAE's running statistics (in float32), then un-patchify. The klein pipeline's ``output_type="latent"``."""
        bn = self.vae.bn
        mean = bn.running_mean.float().view(1, -1, 1, 1).to(x.device)
        std = torch.sqrt(bn.running_var.float().view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(x.device)
        return unpatchify(x.float() * std + mean)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        """(B, 4C, h, w) latents -> float32 images in [0, 1]."""
        vae = self.vae
        with self._frozen_on_device(vae):
            z = self.denormalize(x.to(vae.device))
            images = vae.decode(z.to(vae.dtype)).sample.float()
        return (images * 0.5 + 0.5).clamp(0, 1).to(self.device)  # diffusers' denormalize, written as it is


class Flux2Config(PipelineConfig):
    """``pipeline.name: flux2`` (FLUX.2-dev and FLUX.2-klein, told apart by the checkpoint's model_index.json)."""

    name: str = "flux2"
    adapter: ClassVar[Any] = Flux2Adapter
