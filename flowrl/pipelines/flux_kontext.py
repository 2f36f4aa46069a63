"""FLUX.1 Kontext (image editing): a FLUX.1 transformer that also reads the source image's VAE latents.

Everything FLUX.1-dev does carries over (:class:`~flowrl.pipelines.flux.FluxAdapter`: CLIP pooled + T5 text
encoding, the unpacked ``(B, 16, H/8, W/8)`` trajectory with 2x2 packing inside the denoiser call, sigma as the
transformer's time, FluxPipeline's grid with the dynamic shift of the *output* token count, the guidance
embedding, ``rollout.guidance_mode: embedded``). What Kontext adds, as ``FluxKontextPipeline`` does it:

* The source image comes from each prompt's ``metadata["image"]`` (a path, a PIL image or a float (3, H, W)
  tensor in [0, 1]). It is resized as the pipeline resizes it: by default to the preferred Kontext resolution
  (about one megapixel) whose aspect ratio is closest to the image's; with ``pipeline.condition_auto_resize:
  false`` it keeps its own size; ``pipeline.condition_height/width`` resize it to a fixed size instead
  (Flow-Factory's ``condition_image_size``). Sizes are floored to multiples of 16.
* It is VAE-encoded (the latent distribution's mode), normalised like the generated latents
  (``(z - shift_factor) * scaling_factor``) and stored, unpacked, in the condition (``image_latents``), so
  training re-scores with the rollout's exact condition.
* In the denoiser call its packed tokens are appended to the generated image's tokens, with RoPE ids whose first
  axis is 1 (the generated tokens' is 0); the prediction is the first ``(H/16) * (W/16)`` output tokens.

``pipeline.name=flux_kontext pipeline.pretrained=black-forest-labs/FLUX.1-Kontext-dev``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from ..data.files import read_source_image
from ..errors import FlowRLError
from ..types import Condition
from .diffusers_base import DiffusersAdapter
from .flux import FluxAdapter, FluxConfig, latent_image_ids, pack_latents, unpack_latents
from .sd3 import batch_timestep

# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS as (width, height): the sizes Kontext was trained on
PREFERRED_KONTEXT_RESOLUTIONS = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)


def kontext_image_size(height: int, width: int, multiple_of: int, auto_resize: bool = True) -> tuple[int, int]:
    """(height, width) FluxKontextPipeline resizes a source image of ``height x width`` (already floored to
    ``multiple_of``) to: the preferred resolution nearest in aspect ratio (ties: the narrower) when
    ``auto_resize``, else its own size; then floored to ``multiple_of``."""
    if auto_resize:
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return height // multiple_of * multiple_of, width // multiple_of * multiple_of


def source_image_ids(height: int, width: int) -> Tensor:
    """RoPE ids of the packed source-image tokens (``height x width`` latent pixels): the generated tokens' ids
    with the first axis set to 1, as FluxKontextPipeline.prepare_latents."""
    ids = latent_image_ids(height, width)
    ids[..., 0] = 1
    return ids


class FluxKontextAdapter(FluxAdapter):
    """FLUX.1 Kontext: :class:`FluxAdapter` plus the source image of each prompt (see the module docstring)."""

    lora_pipeline_class = "FluxKontextPipeline"
    needs_metadata = True

    def _load_components(self) -> None:
        super()._load_components()
        from diffusers.image_processor import VaeImageProcessor

        # the pipeline's own processor: its resize (PIL lanczos, or interpolation for tensors) and [-1, 1] scaling
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)
        cfg = self.config
        if (cfg.condition_height is None) != (cfg.condition_width is None):
            raise FlowRLError("pipeline.condition_height and pipeline.condition_width are set together (or neither).")
        multiple = self.vae_scale_factor * 2
        if cfg.condition_height is not None and (cfg.condition_height % multiple or cfg.condition_width % multiple):
            raise FlowRLError(
                f"pipeline.condition_height and pipeline.condition_width ({cfg.condition_height}x{cfg.condition_width}) "
                f"must be multiples of {multiple} for FLUX.1 Kontext (2x2 latent patches)."
            )
        self._source_ids: dict[tuple[int, int], Tensor] = {}

    # -- conditioning ---------------------------------------------------------------------------
    def source_size(self, image: Any) -> tuple[int, int]:
        """(height, width) in pixels the source image is resized to before encoding."""
        cfg, multiple = self.config, self.vae_scale_factor * 2
        if cfg.condition_height is not None:
            return cfg.condition_height, cfg.condition_width
        height, width = self.image_processor.get_default_height_width(image)
        return kontext_image_size(height, width, multiple, cfg.condition_auto_resize)

    @torch.no_grad()
    def encode_image(self, image: Any) -> Tensor:
        """One source image -> its normalised VAE latents (1, C, h, w), float32 on the device."""
        img = read_source_image(image)
        height, width = self.source_size(img)
        pixels = self.image_processor.preprocess(self.image_processor.resize(img, height, width), height, width)
        vae = self.vae
        with self._frozen_on_device(vae):
            latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()  # sample_mode="argmax"
            latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        return latents.float().to(self.device)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], metadata: Sequence[dict[str, Any]] | None = None) -> Condition:
        """Text encodings (cached per prompt) + the source image latents of each sample.

        Within one call each distinct image (path, or object) is encoded once, so a GRPO group sharing its source
        image costs one VAE encode. The images of one batch must come out the same size (they are one transformer
        batch): a prompt set whose images differ in aspect ratio needs ``pipeline.condition_height/width``.
        """
        text = DiffusersAdapter.encode(self, prompts)
        if metadata is None or len(metadata) != len(prompts) or any("image" not in m for m in metadata):
            raise FlowRLError(
                "flux_kontext needs a source image per prompt: metadata['image'] (a path or a (3, H, W) tensor in [0, 1]), "
                'e.g. from a .jsonl prompt file with an "image" key.'
            )
        done: dict[Any, Tensor] = {}
        parts = []
        for m in metadata:
            key = m["image"] if isinstance(m["image"], (str, bytes)) or hasattr(m["image"], "__fspath__") else id(m["image"])
            if key not in done:
                done[key] = self.encode_image(m["image"])
            parts.append(done[key])
        sizes = sorted({tuple(p.shape[-2:]) for p in parts})
        if len(sizes) > 1:
            pixels = [(h * self.vae_scale_factor, w * self.vae_scale_factor) for h, w in sizes]
            raise FlowRLError(
                f"the source images of one batch resize to different sizes {pixels} (height, width), which one transformer "
                "batch cannot hold; set pipeline.condition_height and pipeline.condition_width to resize them all alike."
            )
        return {**text, "image_latents": torch.cat(parts)}

    def unconditional(self, batch: int, cond: Condition | None = None) -> Condition:
        """The empty prompt with the conditional branch's source image (true CFG of a Kontext model without a
        guidance embedding; FLUX.1-Kontext-dev itself runs with the embedded scale, without this branch)."""
        if cond is None:
            raise FlowRLError("flux_kontext's unconditional branch needs the conditional branch's source image.")
        empty = DiffusersAdapter.encode(self, [""])
        text = {k: v.expand(batch, *v.shape[1:]) for k, v in empty.items()}
        return {**text, **{k: v for k, v in cond.items() if k not in text}}

    # -- denoising ------------------------------------------------------------------------------
    def _forward(self, model, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float) -> Tensor:
        b, _, h, w = x.shape
        source = cond["image_latents"]
        size = tuple(source.shape[-2:])
        if size not in self._source_ids:
            self._source_ids[size] = torch.cat([self.img_ids, source_image_ids(*size).to(self.img_ids)])
        # FLUX's time convention (the transformer takes sigma) and guidance input, as FluxAdapter._forward
        t = batch_timestep(sigma, b, x.device)
        guidance = torch.full((b,), float(guidance_scale), device=x.device) if self.guidance_embeds else None
        tokens = torch.cat([pack_latents(x), pack_latents(source.to(x.dtype))], dim=1)  # generated, then source
        out = model(
            hidden_states=tokens.to(self.model_dtype),
            timestep=t,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(self.model_dtype),
            encoder_hidden_states=cond["prompt_embeds"].to(self.model_dtype),
            txt_ids=self.txt_ids,
            img_ids=self._source_ids[size],
            return_dict=False,
        )[0]
        return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)  # the generated tokens' prediction


class FluxKontextConfig(FluxConfig):
    """``pipeline.name: flux_kontext`` (FLUX.1 Kontext: image editing with the source image from metadata.image)."""

    name: str = "flux_kontext"
    # both floored to multiples of 16
    condition_auto_resize: bool = Field(
        True,
        description="Resize the source image to the preferred Kontext resolution nearest in aspect ratio; false: keep its size.",
    )
    condition_height: int | None = Field(None, ge=8, description="A fixed height for every source image; overrides condition_auto_resize.")
    condition_width: int | None = Field(None, ge=8, description="A fixed width for every source image; overrides condition_auto_resize.")
    adapter: ClassVar[Any] = FluxKontextAdapter
