"""JPEG (in)compressibility rewards, as in DDPO: the size of each image saved as a quality-95 JPEG.

Compressibility (``-size_kb``) pushes towards flat, simple images; incompressibility (``+size_kb``)
towards busy, detailed ones. Neither needs a model, so both make good smoke tests of a trainer.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput

JPEG_QUALITY = 95


def jpeg_size_kb(samples: Tensor, upscale: int = 1, quality: int = JPEG_QUALITY) -> Tensor:
    """Return (B,) float32 JPEG sizes in kilobytes (bytes / 1000) of (B, 1|3, H, W) images in [0, 1].

    ``upscale`` enlarges each image by an integer nearest-neighbour factor first: an 8x8 image is a
    single JPEG block, too small for the size to say much about its content.
    """
    if samples.ndim != 4 or samples.shape[1] not in (1, 3):
        raise FlowRLError(f"JPEG rewards read (B, 1 or 3, H, W) images, got shape {tuple(samples.shape)}.")
    if upscale < 1:
        raise FlowRLError(f"JPEG upscale must be a positive integer, got {upscale}.")
    pixels = (samples.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
    pixels = pixels.transpose(0, 2, 3, 1)  # NCHW -> NHWC, the layout PIL expects
    sizes = []
    for image in pixels:
        if upscale > 1:
            image = image.repeat(upscale, axis=0).repeat(upscale, axis=1)
        # A 2-D uint8 array becomes mode "L" and an (H, W, 3) one mode "RGB".
        pil = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
        buffer = io.BytesIO()
        pil.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(np.array(sizes, dtype=np.float32), device=samples.device)


class _JpegSizeReward:
    """score = sign * JPEG size in kilobytes (DDPO's compressibility rewards).

    Args:
        upscale: enlarge each image by this integer nearest-neighbour factor before encoding (tiny images).
    """

    name = "jpeg_size"
    sign = 1.0
    differentiable = False

    def __init__(self, upscale: int = 1) -> None:
        self.upscale = upscale

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        return RewardOutput(scores=self.sign * jpeg_size_kb(samples, self.upscale))


class JpegCompressibilityReward(_JpegSizeReward):
    """Reward small JPEG files: score = -size in kilobytes."""

    name = "jpeg_compressibility"
    sign = -1.0


class JpegIncompressibilityReward(_JpegSizeReward):
    """Reward large JPEG files: score = +size in kilobytes."""

    name = "jpeg_incompressibility"
    sign = 1.0
