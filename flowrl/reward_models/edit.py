"""Rewards for instruction-based image editing (Qwen-Image-Edit, FLUX.1 Kontext): did the edit keep what it
should keep, and did it move the image the way the instruction says?

Both read the source image from the prompt's metadata (``metadata["image"]``: a path, a PIL image or a (3, H, W)
tensor in [0, 1]; the first of ``metadata["images"]`` when only a list is given), the same field the edit
families condition on, so a prompt file's ``{"prompt": "make the sky red", "image": "beach.png"}`` serves both.

* ``source_preservation`` (no model weights): ``1 - mean |edited - source|`` over the pixels outside the edit
  region, in [0, 1] (1: untouched). The source is resized to the sample's size (antialiased bilinear). An optional
  ``metadata["mask"]`` (a path or an (H, W) / (1, H, W) tensor; white / 1 = the region the instruction may change)
  restricts it to the rest of the image. Differentiable. Limits: on its own it is maximised by returning the source
  unchanged, and without a mask it also penalises the intended change (and every global edit such as a style
  transfer), so it is meant to be mixed with an instruction-following term, and its weight sets how much change
  the policy may buy.
* ``clip_directional`` (a CLIP model): the CLIP directional similarity that InstructPix2Pix (Brooks et al. 2023)
  and StyleGAN-NADA (Gal et al. 2022) use to evaluate edits: the cosine between the image change
  ``E_img(edited) - E_img(source)`` and the text change ``E_txt(target caption) - E_txt(source caption)``, in
  [-1, 1]. Captions come from ``metadata["target_caption"]`` (default: the prompt, i.e. the instruction) and
  ``metadata["source_caption"]`` (default: the empty string). It measures whether the image moved *in the
  direction* the text moved, not how far, and inherits CLIP's blind spots (counting, spatial relations, text
  rendering); with the instruction as the target caption the text direction is only roughly the edit's.

A typical edit reward is the mix of the two (``reward.components: {source_preservation: 1.0, clip_directional:
1.0}``); docs/rewards.md has the details and the measured run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.reward_models.clip_common import ClipBackedReward, as_rgb, text_embeddings
from flowrl.types import RewardOutput

DEFAULT_MODEL = "openai/clip-vit-large-patch14"


def _source_of(meta: Mapping[str, Any], reward: str) -> Any:
    if meta.get("image") is not None:
        return meta["image"]
    images = meta.get("images")
    if isinstance(images, (list, tuple)) and images:
        return images[0]
    raise FlowRLError(f"reward '{reward}' needs the source image of every prompt in metadata['image'] (a path or a (3, H, W) tensor).")


def read_image_tensor(image: Any, where: str) -> Tensor:
    """(C, H, W) float in [0, 1] from a path, a PIL image or a tensor (the edit families' reader,
    :func:`flowrl.data.files.read_source_image`, so the model and the reward accept the same forms)."""
    import numpy as np

    from flowrl.data.files import read_source_image

    if isinstance(image, Tensor):
        t = image.detach().float()
        t = t[None] if t.ndim == 2 else t
        if t.ndim != 3:
            raise FlowRLError(f"{where} must be a (C, H, W) tensor in [0, 1], got shape {tuple(image.shape)}.")
        return t
    pil = read_source_image(image, where)
    return torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def _resized(image: Tensor, size: tuple[int, int]) -> Tensor:
    if tuple(image.shape[-2:]) == tuple(size):
        return image
    return F.interpolate(image[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]


class SourcePreservationReward:
    """``1 - mean |edited - source|`` outside ``metadata["mask"]`` (module docstring). Images (B, C, H, W) in [0, 1]."""

    name = "source_preservation"
    differentiable = True

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        if samples.ndim != 4:
            raise FlowRLError(f"reward 'source_preservation' reads (B, C, H, W) images, got shape {tuple(samples.shape)}.")
        if len(metadata) != samples.shape[0]:
            raise FlowRLError(f"reward 'source_preservation' got {samples.shape[0]} images but {len(metadata)} metadata entries.")
        size = tuple(samples.shape[-2:])
        scores, kept = [], []
        for x, meta in zip(samples, metadata):
            source = _resized(read_image_tensor(_source_of(meta, self.name), "metadata['image']"), size).to(x.device)
            if source.shape[0] != x.shape[0]:  # grayscale samples against an RGB source and vice versa: compare luminance
                source = source.mean(0, keepdim=True).expand(x.shape[0], -1, -1)
            keep = torch.ones(1, *size, device=x.device)
            if meta.get("mask") is not None:
                mask = _resized(read_image_tensor(meta["mask"], "metadata['mask']").mean(0, keepdim=True), size).to(x.device)
                keep = (mask < 0.5).float()  # white = may change
            area = keep.sum() * x.shape[0]
            diff = ((x.float() - source).abs() * keep).sum() / area.clamp(min=1)
            scores.append(1 - diff)
            kept.append(keep.mean())
        return RewardOutput(scores=torch.stack(scores), extras={"preserved_fraction": torch.stack(kept).detach()})


@dataclass(eq=False, repr=False)
class ClipDirectionalReward(ClipBackedReward):
    """CLIP directional similarity of an edit (module docstring); its arguments are every CLIP reward's
    (:class:`~flowrl.reward_models.clip_common.ClipBackedReward`)."""

    name = "clip_directional"

    pretrained: str = DEFAULT_MODEL

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        samples = as_rgb(samples)
        if len(metadata) != samples.shape[0] or len(prompts) != samples.shape[0]:
            raise FlowRLError(
                f"reward 'clip_directional' got {samples.shape[0]} images for {len(prompts)} prompts and {len(metadata)} metadata entries."
            )
        size = tuple(samples.shape[-2:])
        sources = torch.stack(
            [as_rgb(_resized(read_image_tensor(_source_of(m, self.name), "metadata['image']"), size)[None])[0] for m in metadata]
        )
        edited = self.embed_images(samples)
        with torch.no_grad():
            source = self.embed_images(sources.to(samples.device))
        targets = [str(m.get("target_caption", p)) for m, p in zip(metadata, prompts)]
        originals = [str(m.get("source_caption", "")) for m in metadata]
        tokenizer = self.clip_processor.tokenizer
        t_target = text_embeddings(self._model, tokenizer, targets, edited.device)
        t_source = text_embeddings(self._model, tokenizer, originals, edited.device)
        cosine = F.cosine_similarity(edited - source, t_target - t_source, dim=-1, eps=1e-8)
        return RewardOutput(
            scores=cosine.float().to(samples.device),
            extras={"image_change": (edited - source).norm(dim=-1).detach().float().to(samples.device)},
        )


__all__ = ["SourcePreservationReward", "ClipDirectionalReward", "read_image_tensor"]
