"""Reading the user's files: text that must be UTF-8 (prompt files, winners captions, recorded generations) and the
source images that image-conditioned families and edit rewards take from a prompt's metadata (``metadata["image"]``,
``metadata["images"]``: Wan image-to-video, FLUX.1 Kontext, Qwen-Image-Edit(-Plus), the edit rewards). One reader of
each, so everything accepts the same forms and says the same sentence when a file cannot be read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import FlowRLError


def read_utf8(path: Path, what: str) -> str:
    """The text of ``path``; a file that is not UTF-8 is one sentence naming it (``what``, e.g. "prompt file
    'p.txt'") and the first bad byte, not a UnicodeDecodeError."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise FlowRLError(
            f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line} is not valid UTF-8); save it as UTF-8."
        ) from None


def read_source_image(image: Any, where: str = "metadata['image']") -> Any:
    """A PIL RGB image (from a path or given), or a (1, 3, H, W) float tensor in [0, 1] for a (3, H, W) tensor.

    ``where`` names the field in the error sentences. A file that is missing, not an image, or larger than PIL's
    decompression-bomb limit is one FlowRLError naming it."""
    import PIL.Image

    if isinstance(image, PIL.Image.Image):
        return image.convert("RGB")
    if isinstance(image, Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise FlowRLError(f"{where} tensors must be (3, H, W) in [0, 1], got shape {tuple(image.shape)}.")
        return image.detach().float().cpu().clamp(0, 1)[None]
    try:
        with PIL.Image.open(image) as img:
            return img.convert("RGB")
    except (OSError, TypeError, AttributeError, ValueError, PIL.Image.DecompressionBombError) as e:
        reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise FlowRLError(f"could not read the source image {str(image)[:120]!r} ({where}): {reason}") from None


def as_pil(image: Any) -> Any:
    """:func:`read_source_image`'s result as a PIL image (a tensor is rounded to uint8, as an image file would be)."""
    import PIL.Image

    if isinstance(image, Tensor):
        array = (image[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        return PIL.Image.fromarray(array)
    return image
