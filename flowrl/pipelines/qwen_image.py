"""Qwen-Image: QwenImageTransformer2DModel (MMDiT) + Qwen2.5-VL text encoder + AutoencoderKLQwenImage.

Three ``pipeline.name`` values, one per diffusers pipeline:

* ``qwen_image``: text-to-image (``QwenImagePipeline``; Qwen/Qwen-Image, Qwen/Qwen-Image-2512);
* ``qwen_image_edit``: one source image (``QwenImageEditPipeline``; Qwen/Qwen-Image-Edit), from each prompt's
  ``metadata["image"]``. The image goes into the Qwen2.5-VL prompt (vision tokens) and, through the VAE, into
  the transformer's token sequence after the generated image's tokens;
* ``qwen_image_edit_plus``: several source images (``QwenImageEditPlusPipeline``; Qwen/Qwen-Image-Edit-2509,
  -2511), from ``metadata["images"]`` (a list; ``metadata["image"]`` alone is a list of one).

Rectified flow (velocity ``noise - x0``), as FLUX: flowrl keeps the latents unpacked, ``(B, 16, H/8, W/8)``;
the 2x2 packing into tokens ``(B, H/16 * W/16, 64)`` happens inside ``_forward``. The transformer's timestep
is ``sigma * 1000 / 1000`` (the pipeline's ``timestep / 1000``, computed the same way in float32). The default
grid is the pipeline's: ``sigmas = linspace(1, 1/K, K)`` shifted by the scheduler with mu from the image
token count (FlowSchedule's "flux" grid), then stretched so that the last nonzero sigma is the scheduler's
``shift_terminal`` (0.02 for the Qwen checkpoints), which :class:`QwenFlowSchedule` adds.

Guidance is true CFG against a negative prompt (``pipeline.negative_prompt``, default ``" "`` as in Qwen's
model card), with the pipeline's norm rescale: the guided velocity of each image token is scaled back to the
norm of the conditional one (``pipeline.cfg_norm_rescale``). Qwen-Image is not guidance-distilled.

``pipeline.name=qwen_image pipeline.pretrained=Qwen/Qwen-Image``. docs/model_families/qwen_image.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from ..data.files import as_pil, read_source_image
from ..errors import FlowRLError
from ..samplers.schedules import FlowSchedule, sampling_grid
from ..types import Condition, cat_conditions
from .diffusers_base import DiffusersAdapter, PipelineConfig
from .flux import pack_latents, patchable_sample_size, unpack_latents
from .sd3 import JOINT_ATTENTION_LORA_TARGETS, flow_shift, modules_ending_with

# QwenImagePipeline's prompt template; its first 34 tokens (the system prompt and the user turn's header) are
# dropped from the encoder's hidden states
T2I_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
T2I_DROP = 34
# QwenImageEditPipeline's template (the image's vision tokens before the instruction) and QwenImageEditPlusPipeline's
# (a "Picture i: " entry per image, put in front of the instruction); both drop the first 64 tokens
_EDIT_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n"
)
EDIT_TEMPLATE = _EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_TEMPLATE = _EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
EDIT_DROP = 64
IMAGE_PAD = "<|image_pad|>"
TOKENIZER_MAX_LENGTH = 1024  # the pipelines' tokenizer_max_length


@dataclass(frozen=True)
class QwenFlowSchedule(FlowSchedule):
    """FlowSchedule with FlowMatchEulerDiscreteScheduler's ``shift_terminal`` stretch on the "flux" grid.

    After the shift, the scheduler maps ``1 - s`` linearly so that the last nonzero sigma becomes
    ``shift_terminal``: ``s' = 1 - (1 - s) / ((1 - s_last) / (1 - shift_terminal))``, in float32 as it does.
    For K = 1 the only sigma is 1 and diffusers divides 0 by 0 (its grid is NaN); flowrl keeps [1, 0].
    """

    shift_terminal: float | None = None

    def sigmas(self, num_steps: int) -> Tensor:
        grid = super().sigmas(num_steps)
        if not self.shift_terminal or self.grid != "flux" or int(num_steps) == 1:
            return grid
        s = grid[:-1].numpy()  # float32, as set_timesteps holds them before the stretch
        one_minus = 1 - s
        scale = one_minus[-1] / (1 - self.shift_terminal)
        stretched = torch.from_numpy(np.asarray(1 - (one_minus / scale))).to(torch.float32)
        return torch.cat([stretched, stretched.new_zeros(1)])


def qwen_schedule(scheduler_config: dict, image_seq_len: int, pipeline_config) -> QwenFlowSchedule:
    """The pipelines' default grid ("flux": linspace(1, 1/K, K), shifted with mu from the image token count, then
    the terminal stretch), or ``pipeline.sampling_grid=linspace`` (flowrl's own grid, no stretch)."""
    config = dict(scheduler_config)
    terminal = config.pop("shift_terminal", None)  # handled here; flow_shift refuses it
    grid = sampling_grid(pipeline_config, "flux", ("flux", "linspace"))
    return QwenFlowSchedule(
        shift=flow_shift(config, image_seq_len, default_max_shift=1.15),  # calculate_shift's defaults
        grid=grid,
        dynamic=bool(config.get("use_dynamic_shifting", False)),
        num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
        shift_terminal=float(terminal) if terminal else None,
    )


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of about ``target_area`` pixels at aspect ``ratio``, multiples of 32 (the edit pipelines')."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def center_crop(image, aspect: float):
    """The largest centred crop of a PIL image with width / height = ``aspect`` (the image itself when it has it)."""
    width, height = image.size
    if abs(width / height - aspect) < 1e-6:
        return image
    if width / height > aspect:
        new = round(height * aspect)
        left = (width - new) // 2
        return image.crop((left, 0, left + new, height))
    new = round(width / aspect)
    top = (height - new) // 2
    return image.crop((0, top, width, top + new))


def _masked_rows(hidden: Tensor, mask: Tensor, drop: int) -> list[Tensor]:
    """Each row's real tokens (``mask``), less the template's first ``drop`` (the pipelines' _extract_masked_hidden)."""
    return [h[m.bool()][drop:] for h, m in zip(hidden, mask, strict=True)]


def _pad_rows(rows: list[Tensor], length: int) -> tuple[Tensor, Tensor]:
    """Rows of (L_i, D) zero-padded to ``length``: embeddings (B, length, D) float32 and a 0/1 int64 mask."""
    embeds = rows[0].new_zeros(len(rows), length, rows[0].shape[-1], dtype=torch.float32)
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=rows[0].device)
    for i, row in enumerate(rows):
        embeds[i, : row.shape[0]] = row.float()
        mask[i, : row.shape[0]] = 1
    return embeds, mask


class QwenImageAdapter(DiffusersAdapter):
    """Qwen-Image text-to-image (see the module docstring).

    The condition holds ``prompt_embeds`` (B, L, D), the Qwen2.5-VL last hidden states after the template's
    prefix, zero-padded to L = ``pipeline.max_sequence_length`` (so that rollouts of any batches concatenate),
    and ``prompt_embeds_mask`` (B, L). Each forward trims both to the longest prompt in its batch and, when no
    row is padded, passes no mask, as the pipeline does.
    """

    denoiser_subfolder = "transformer"
    lora_pipeline_class = "QwenImagePipeline"
    default_max_sequence_length = 512  # QwenImagePipeline.__call__'s default
    template = T2I_TEMPLATE
    template_drop = T2I_DROP
    lora_target_suffixes = JOINT_ATTENTION_LORA_TARGETS  # both streams' joint attention (Flow-Factory's default)

    # -- loading --------------------------------------------------------------------------------
    def _load_components(self) -> None:
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import Qwen2_5_VLForConditionalGeneration

        self._load_text_side()
        self.text_encoder = self._load(Qwen2_5_VLForConditionalGeneration, "text_encoder")
        self.vae = self._load(AutoencoderKLQwenImage, "vae")
        self.denoiser = self._load(QwenImageTransformer2DModel, "transformer")
        if self.denoiser.config.guidance_embeds:
            raise FlowRLError(
                f"the transformer of '{self.source}' has a guidance embedding (guidance_embeds=True), which diffusers' "
                "Qwen-Image pipelines do not drive; flowrl supports the true-CFG Qwen-Image checkpoints."
            )
        scheduler = self._read_config(FlowMatchEulerDiscreteScheduler, "scheduler", "the scheduler config")
        self.num_train_timesteps = int(scheduler.get("num_train_timesteps", 1000))
        self.vae_scale_factor = 2 ** len(self.vae.config.temperal_downsample)
        self.default_size = (128 * self.vae_scale_factor,) * 2  # the pipelines' default_sample_size (1024 px)
        self.max_sequence_length = self.config.max_sequence_length or self.default_max_sequence_length
        self.latent_channels = int(self.vae.config.z_dim)
        z = self.latent_channels
        self._latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        self._latents_std = torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)
        _, h, w = self.latent_shape()
        self.schedule = qwen_schedule(scheduler, (h // 2) * (w // 2), self.config)

    def _load_text_side(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = self._load(AutoTokenizer, "tokenizer")

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The attention projections of every block, less the two the output cannot depend on.

        The text stream leaves the model after the last block's attention, so that block's text query
        (``attn.add_q_proj``) and text output projection (``attn.to_add_out``) change nothing a LoRA there could
        train (the "every tensor changes" test found them).
        """
        return modules_ending_with(self.denoiser, self.lora_target_suffixes, set(self._dead_text_modules()))

    def _dead_text_modules(self) -> list[str]:
        """Modules of the last block that only feed the text stream after its attention, which no output reads."""
        last = f"transformer_blocks.{len(self.denoiser.transformer_blocks) - 1}"
        return [f"{last}.attn.add_q_proj", f"{last}.attn.norm_added_q", f"{last}.attn.to_add_out", f"{last}.txt_mlp"]

    def _configure_denoiser(self) -> None:
        super()._configure_denoiser()
        if self.config.lora is None:
            # full fine-tuning: the text-stream tail of the last block gets no gradient (its output is discarded), so it
            # is frozen rather than carried through the optimizer unchanged
            modules = dict(self.denoiser.named_modules())
            for name in self._dead_text_modules():
                if name in modules:
                    modules[name].requires_grad_(False)

    # (called by DiffusersAdapter.guidance_mode's setter, which the trainer uses after construction)
    def check_guidance_mode(self, mode: str) -> None:
        if mode == "embedded":
            raise FlowRLError(
                "rollout.guidance_mode 'embedded' needs a guidance-distilled model, but Qwen-Image runs true CFG against a "
                "negative prompt: use 'cfg' (or 'cfg_detached_uncond' / 'cfg_rollout_only'), guidance_scale 1 for none."
            )

    # -- conditioning ---------------------------------------------------------------------------
    def _hidden_states(self, inputs: dict[str, Tensor]) -> Tensor:
        """The Qwen2.5-VL's last hidden states (the pipelines' ``hidden_states[-1]``) on ``inputs``."""
        with self._frozen_on_device(self.text_encoder):
            device = self.text_encoder.device
            out = self.text_encoder(**{k: v.to(device) for k, v in inputs.items()}, output_hidden_states=True)
        return out.hidden_states[-1]

    def _encode_prompts(self, prompts: list[str]) -> Condition:
        """QwenImagePipeline.encode_prompt: the template, the last hidden states of the real tokens, the first 34
        dropped, at most ``max_sequence_length`` kept (padded to it here)."""
        tokens = self.tokenizer(
            [self.template.format(p) for p in prompts],
            max_length=TOKENIZER_MAX_LENGTH + self.template_drop,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        hidden = self._hidden_states({"input_ids": tokens.input_ids, "attention_mask": tokens.attention_mask})
        rows = [r[: self.max_sequence_length] for r in _masked_rows(hidden, tokens.attention_mask.to(hidden.device), self.template_drop)]
        embeds, mask = _pad_rows(rows, self.max_sequence_length)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The negative prompt's encoding (``pipeline.negative_prompt``), the CFG branch of the pipeline."""
        return {k: v.expand(batch, *v.shape[1:]) for k, v in self.encode([self.config.negative_prompt]).items()}

    # -- denoising ------------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> transformer timestep conversion of this family: the pipeline's ``timestep / 1000`` with
        ``timestep = sigma * num_train_timesteps``, in the same float32 steps (it can differ from sigma by one ulp)."""
        return (sigma.float() * self.num_train_timesteps) / 1000

    def _text(self, cond: Condition) -> tuple[Tensor, Tensor | None]:
        """The prompt embeddings trimmed to this batch's longest prompt, and their mask (None when no row is padded)."""
        mask = cond["prompt_embeds_mask"]
        length = max(int(mask.sum(dim=1).max()), 1)
        mask = mask[:, :length]
        embeds = cond["prompt_embeds"][:, :length].to(self.model_dtype)
        return embeds, None if bool(mask.all()) else mask

    def _image_tokens(self, x: Tensor, cond: Condition) -> tuple[Tensor, list[tuple[int, int, int]]]:
        """The transformer's image tokens and img_shapes: the generated image's packed latents (edit: then the
        source images' packed latents)."""
        _, _, h, w = x.shape
        return pack_latents(x), [(1, h // 2, w // 2)]

    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        b, _, h, w = x.shape
        embeds, mask = self._text(cond)
        tokens, shapes = self._image_tokens(x, cond)
        t = self.timestep(torch.broadcast_to(sigma.reshape(-1), (b,)).to(x.device))
        out = model(
            hidden_states=tokens.to(self.model_dtype),
            timestep=t,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[shapes] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)  # the generated image's tokens come first

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        """The velocity at ``sigma``, with the pipelines' true CFG when ``guidance_scale != 1``:
        ``u + s (c - u)``, then (``cfg_norm_rescale``) each image token's guided velocity rescaled to the norm of
        its conditional one, ``g * |c| / |g|`` over the token's 64 packed channels. The guidance modes choose the
        gradient as for every family (docs/model_families.md); the rescale keeps gradients through both norms."""
        model = self._reference if self._reference is not None and self._use_reference else self.denoiser
        sigma = torch.as_tensor(sigma, device=self.device, dtype=torch.float32)
        if guidance_scale == 1.0:
            return self._forward(model, x, sigma, cond, guidance_scale).float()
        uncond = self.unconditional(x.shape[0], cond)
        if self.guidance_mode == "cfg_detached_uncond":
            with torch.no_grad():
                u = self._forward(model, x, sigma, uncond, guidance_scale).float()
            c = self._forward(model, x, sigma, cond, guidance_scale).float()
        else:
            both = sigma.repeat(2) if sigma.numel() > 1 else sigma  # a per-sample sigma for both halves
            c, u = self._forward(model, torch.cat([x, x]), both, cat_conditions([cond, uncond]), guidance_scale).float().chunk(2)
        guided = u + guidance_scale * (c - u)
        if not self.config.cfg_norm_rescale:
            return guided
        _, _, h, w = x.shape
        c_tokens, g_tokens = pack_latents(c), pack_latents(guided)
        rescaled = g_tokens * (torch.norm(c_tokens, dim=-1, keepdim=True) / torch.norm(g_tokens, dim=-1, keepdim=True))
        return unpack_latents(rescaled, h, w)

    def latent_shape(self) -> tuple[int, ...]:
        h, w = patchable_sample_size(self, "Qwen-Image")
        return (self.denoiser.config.in_channels // 4, h // self.vae_scale_factor, w // self.vae_scale_factor)

    def decode(self, x: Tensor) -> Tensor:  # differentiable (reward gradients); samplers call it under no_grad
        """(B, C, h, w) latents -> (B, 3, H, W) float32 images in [0, 1], as the pipelines decode: ``z / (1 / std)
        + mean`` in the VAE's dtype, one-frame VAE decode, ``image / 2 + 0.5`` clamped."""
        vae = self.vae
        with self._frozen_on_device(vae):
            z = x.to(vae.device, vae.dtype)[:, :, None]
            mean = self._latents_mean.to(vae.device, vae.dtype)
            inverse_std = 1.0 / self._latents_std.to(vae.device, vae.dtype)
            images = vae.decode(z / inverse_std + mean, return_dict=False)[0][:, :, 0].float()
        return (images / 2 + 0.5).clamp(0, 1).to(self.device)


class QwenImageConfig(PipelineConfig):
    """``pipeline.name: qwen_image`` (Qwen-Image text-to-image)."""

    name: str = "qwen_image"
    negative_prompt: str = Field(" ", description='The prompt of the CFG branch (Qwen\'s model card uses " ").')
    cfg_norm_rescale: bool = Field(
        True, description="Rescale the guided velocity to the norm of the conditional one (the pipelines' rescale)."
    )
    adapter: ClassVar[Any] = QwenImageAdapter


class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: one source image per prompt, ``metadata["image"]`` (a path, a PIL image or a (3, H, W)
    tensor in [0, 1]).

    As QwenImageEditPipeline: the image is resized to about ``pipeline.condition_area`` pixels at its own aspect
    ratio (multiples of 32), shown to Qwen2.5-VL inside the edit template (its vision tokens stay in the prompt
    embeddings; the first 64 template tokens are dropped), and VAE-encoded (mode, normalised by the latents mean
    and std, packed) into tokens that follow the generated image's in the transformer's sequence; only the
    generated tokens' velocity is kept. The CFG branch is the negative prompt with the same image. The output size
    is ``pipeline.height`` x ``pipeline.width`` (the pipeline's default follows the source image's aspect ratio;
    flowrl's latent shape is fixed per run).

    The condition (stored in the trajectory, so training re-scores with the rollout's) holds the prompt and the
    negative prompt embeddings with their masks, zero-padded to the image's vision tokens plus
    ``pipeline.max_sequence_length``, ``image_latents`` (B, N, 4C) and ``image_shapes`` (B, images, 2). Every
    source image of a run must give the same condition geometry (same aspect ratio), since the transformer
    takes no mask over image tokens; another one fails with one sentence.
    """

    lora_pipeline_class = "QwenImageEditPipeline"
    needs_metadata = True
    template = EDIT_TEMPLATE
    template_drop = EDIT_DROP

    def _load_text_side(self) -> None:
        """The processor's tokenizer and image processor (``processor/``), as Qwen2VLProcessor loads them. flowrl
        does the processor's one step of its own, expanding each ``<|image_pad|>`` to the image's token count:
        Qwen2VLProcessor cannot be built without torchvision (its video processor needs it), while its image
        processor falls back to a PIL implementation."""
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = self._load(AutoTokenizer, "processor")
        self.tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a pipeline in memory gives its processor
        image_processor = self._load(AutoImageProcessor, "processor")
        self.vlm_image_processor = getattr(image_processor, "image_processor", image_processor)
        self._geometry: tuple | None = None

    def _load_components(self) -> None:
        super()._load_components()
        from diffusers.image_processor import VaeImageProcessor

        self.vae_image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    # -- conditioning ---------------------------------------------------------------------------
    def _source_images(self, meta: dict[str, Any]) -> list[Any]:
        if "image" not in meta:
            raise FlowRLError(
                f"{self.config.name} needs a source image per prompt: metadata['image'] (a path, a PIL image or a (3, H, W) "
                'tensor in [0, 1]), e.g. from a .jsonl prompt file with an "image" key or prompts.columns.images.'
            )
        return [meta["image"]]

    def _prepare_images(self, images: list) -> tuple[list, list[Tensor], list[tuple[int, int]]]:
        """QwenImageEditPipeline's preprocessing: the image resized to ``condition_area`` at its aspect ratio, which
        both Qwen2.5-VL and the VAE see. Returns (VLM images, VAE inputs (1, 3, 1, h, w) in [-1, 1], (h, w) each)."""
        (img,) = images
        width, height = calculate_dimensions(self.config.condition_area, img.size[0] / img.size[1])
        resized = self.vae_image_processor.resize(img, height, width)
        pixels = self.vae_image_processor.preprocess(resized, height, width).unsqueeze(2)
        return [resized], [pixels], [(height, width)]

    def _prompt_text(self, prompt: str, count: int) -> str:
        return self.template.format(prompt)

    def _vlm_inputs(self, texts: list[str], images: list[list]) -> dict[str, Tensor]:
        """Qwen2VLProcessor(text=texts, images=..., padding=True): the image processor on every image in order,
        each ``<|image_pad|>`` expanded to its image's ``t * h * w / merge_size^2`` tokens, then the tokenizer."""
        flat = [img for row in images for img in row]
        vision = self.vlm_image_processor(images=flat, return_tensors="pt")
        merge = self.vlm_image_processor.merge_size**2
        counts = iter((vision["image_grid_thw"].prod(dim=-1) // merge).tolist())
        expanded = []
        for text in texts:
            head, *rest = text.split(IMAGE_PAD)
            expanded.append(head + "".join(IMAGE_PAD * next(counts) + part for part in rest))
        tokens = self.tokenizer(expanded, padding=True, return_tensors="pt")
        return {
            "input_ids": tokens.input_ids,
            "attention_mask": tokens.attention_mask,
            "pixel_values": vision["pixel_values"],
            "image_grid_thw": vision["image_grid_thw"],
        }

    def _embed(self, texts: list[str], images: list[list], length: int) -> tuple[Tensor, Tensor]:
        """Prompt embeddings of ``texts`` with their images, the template's first 64 tokens dropped, padded to
        ``length`` (a row longer than that fails: the pipeline would keep it whole)."""
        inputs = self._vlm_inputs(texts, images)
        hidden = self._hidden_states(inputs)
        rows = _masked_rows(hidden, inputs["attention_mask"].to(hidden.device), self.template_drop)
        longest = max(r.shape[0] for r in rows)
        if longest > length:
            raise FlowRLError(
                f"a prompt with its source images takes {longest} tokens, more than the {length} the condition holds "
                f"(the images' vision tokens + pipeline.max_sequence_length {self.max_sequence_length}): raise "
                "pipeline.max_sequence_length."
            )
        return _pad_rows(rows, length)

    def _vision_tokens(self, images: list) -> int:
        """How many ``<|image_pad|>`` tokens the VLM images take."""
        grid = self.vlm_image_processor(images=images, return_tensors="pt")["image_grid_thw"]
        return int((grid.prod(dim=-1) // self.vlm_image_processor.merge_size**2).sum())

    @torch.no_grad()
    def _encode_source(self, images: list, where: str) -> tuple[list, Condition]:
        """One sample's source images -> (the VLM images, {"image_latents": (1, N, 4C), "image_shapes": (1, n, 2)})."""
        read = [as_pil(read_source_image(img, where)) for img in images]
        if self.config.condition_aspect is not None:
            read = [center_crop(img, self.config.condition_aspect) for img in read]
        vlm_images, pixels, sizes = self._prepare_images(read)
        geometry = (tuple(sizes), tuple(img.size for img in vlm_images))
        if self._geometry is None:
            self._geometry = geometry
            self._text_length = self._vision_tokens(vlm_images) + self.max_sequence_length
        elif geometry != self._geometry:
            raise FlowRLError(
                f"the source images {where} give condition sizes {list(sizes)}, where this run's first ones gave "
                f"{list(self._geometry[0])}: every sample of a run needs the same (the transformer takes no mask over "
                "image tokens): use source images of one aspect ratio, or set pipeline.condition_aspect to center-crop "
                "them all to one."
            )
        tokens = []
        with self._frozen_on_device(self.vae):
            mean = self._latents_mean.to(self.vae.device, self.vae.dtype)
            std = self._latents_std.to(self.vae.device, self.vae.dtype)
            for x in pixels:
                latents = self.vae.encode(x.to(self.vae.device, self.vae.dtype)).latent_dist.mode()
                tokens.append(pack_latents(((latents - mean) / std)[:, :, 0]).float().to(self.device))
        h_w = [(h // self.vae_scale_factor // 2, w // self.vae_scale_factor // 2) for h, w in sizes]
        shapes = torch.tensor([h_w], dtype=torch.long, device=self.device)
        return vlm_images, {"image_latents": torch.cat(tokens, dim=1), "image_shapes": shapes}

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None) -> Condition:
        """The condition of each (prompt, source images) sample. Not cached across calls (the prompt embeddings depend
        on the images); within a call each distinct sample is encoded once, so a GRPO group costs one encode."""
        if metadata is None or len(metadata) != len(prompts):
            raise FlowRLError(f"{self.config.name} needs each prompt's metadata (its source images).")

        def key(image: Any) -> Any:
            return image if isinstance(image, (str, bytes)) or hasattr(image, "__fspath__") else id(image)

        samples: dict[tuple, int] = {}
        order = []
        sources: dict[tuple, tuple[list, Condition]] = {}
        for prompt, meta in zip(prompts, metadata, strict=True):
            images = self._source_images(meta)
            image_key = tuple(key(img) for img in images)
            if image_key not in sources:
                sources[image_key] = self._encode_source(images, f"of the prompt {prompt[:60]!r}")
            order.append(samples.setdefault((prompt, image_key), len(samples)))
        unique = list(samples)
        image_keys = list(sources)
        count = len(next(iter(sources.values()))[0])
        embeds, mask = self._embed([self._prompt_text(p, count) for p, _ in unique], [sources[k][0] for _, k in unique], self._text_length)
        negative = self._prompt_text(self.config.negative_prompt, count)
        neg_embeds, neg_mask = self._embed([negative] * len(image_keys), [sources[k][0] for k in image_keys], self._text_length)
        rows = []
        for i, (_, image_key) in enumerate(unique):
            j = image_keys.index(image_key)
            rows.append(
                {
                    "prompt_embeds": embeds[i : i + 1],
                    "prompt_embeds_mask": mask[i : i + 1],
                    "negative_prompt_embeds": neg_embeds[j : j + 1],
                    "negative_prompt_embeds_mask": neg_mask[j : j + 1],
                    **sources[image_key][1],
                }
            )
        return {k: v.to(self.device) for k, v in cat_conditions([rows[i] for i in order]).items()}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The negative prompt with the same source images (its encoding is part of the condition)."""
        if cond is None:
            raise FlowRLError(f"{self.config.name}'s CFG branch needs the conditional branch's condition (its source images).")
        return {**cond, "prompt_embeds": cond["negative_prompt_embeds"], "prompt_embeds_mask": cond["negative_prompt_embeds_mask"]}

    # -- denoising ------------------------------------------------------------------------------
    def _image_tokens(self, x: Tensor, cond: Condition) -> tuple[Tensor, list[tuple[int, int, int]]]:
        _, _, h, w = x.shape
        # the transformer's RoPE reads the first sample's shapes for the whole batch; every sample has the same
        shapes = [(1, h // 2, w // 2)] + [(1, int(a), int(b)) for a, b in cond["image_shapes"][0].tolist()]
        return torch.cat([pack_latents(x), cond["image_latents"].to(x.dtype)], dim=1), shapes


class QwenImageEditPlusAdapter(QwenImageEditAdapter):
    """Qwen-Image-Edit-Plus (2509, 2511): several source images per prompt, ``metadata["images"]`` (a list), else
    ``metadata["image"]``, or the metadata keys ``pipeline.source_images`` names.

    As QwenImageEditPlusPipeline: each image is shown to Qwen2.5-VL at about ``pipeline.vlm_condition_area`` pixels
    (384 x 384 in diffusers) as "Picture i: <vision tokens>" before the instruction, and VAE-encoded at about
    ``pipeline.condition_area`` (1024 x 1024), each at its own aspect ratio; the images' tokens follow the generated
    image's in the order given. diffusers' pipeline takes one prompt per call; flowrl batches samples that share
    the condition geometry.
    """

    lora_pipeline_class = "QwenImageEditPlusPipeline"
    template = EDIT_PLUS_TEMPLATE

    def _source_images(self, meta: dict[str, Any]) -> list[Any]:
        keys = self.config.source_images
        if keys:
            missing = [k for k in keys if k not in meta]
            if missing:
                raise FlowRLError(f"a prompt's metadata lacks the source image key(s) {missing} named by pipeline.source_images.")
            return [meta[k] for k in keys]
        images = meta.get("images")
        if images is None:
            return super()._source_images(meta)
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence) or not images:
            raise FlowRLError(f"metadata['images'] must be a non-empty list of source images, got {str(images)[:80]!r}.")
        return list(images)

    def _prepare_images(self, images: list) -> tuple[list, list[Tensor], list[tuple[int, int]]]:
        vlm_images, pixels, sizes = [], [], []
        for img in images:
            ratio = img.size[0] / img.size[1]
            vlm_width, vlm_height = calculate_dimensions(self.config.vlm_condition_area, ratio)
            width, height = calculate_dimensions(self.config.condition_area, ratio)
            vlm_images.append(self.vae_image_processor.resize(img, vlm_height, vlm_width))
            pixels.append(self.vae_image_processor.preprocess(img, height, width).unsqueeze(2))
            sizes.append((height, width))
        return vlm_images, pixels, sizes

    def _prompt_text(self, prompt: str, count: int) -> str:
        return self.template.format("".join(EDIT_PLUS_PICTURE.format(i + 1) for i in range(count)) + prompt)


class QwenImageEditConfig(QwenImageConfig):
    """``pipeline.name: qwen_image_edit`` (Qwen-Image-Edit: one source image from metadata.image)."""

    name: str = "qwen_image_edit"
    condition_area: int = Field(
        1024 * 1024, ge=32 * 32, description="Pixels of the source image the VAE and the VLM see (the pipeline's 1024^2)."
    )
    # so that sources of mixed aspect ratios share one condition geometry; None keeps each image's ratio (a run then
    # needs one ratio)
    condition_aspect: float | None = Field(
        None, gt=0, description="Width / height every source image is centre-cropped to first; None: each keeps its own."
    )
    adapter: ClassVar[Any] = QwenImageEditAdapter


class QwenImageEditPlusConfig(QwenImageEditConfig):
    """``pipeline.name: qwen_image_edit_plus`` (Qwen-Image-Edit-2509/2511: source images from metadata.images)."""

    name: str = "qwen_image_edit_plus"
    vlm_condition_area: int = Field(
        384 * 384, ge=28 * 28, description="Pixels of each source image Qwen2.5-VL sees (the pipeline's 384^2)."
    )
    source_images: list[str] | None = Field(
        None,
        description='Metadata keys of the source images, in order; None: metadata["images"] (a list), else metadata["image"].',
    )
    adapter: ClassVar[Any] = QwenImageEditPlusAdapter
