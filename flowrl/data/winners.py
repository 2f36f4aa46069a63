"""Winning images for SePPO: real (prompt, image) examples, as an SFT dataset would hold them.

Three sources, all read once at start-up into images at the model's pixel size, float32 in [0, 1]:

- ``"embedded"``: the embedded digits models' own training data (scikit-learn's 8x8 digits), each image
  once per training prompt phrasing of its digit, metadata ``{"digit": d}``;
- a ``.jsonl`` file: one JSON object per line with ``"prompt"`` and ``"image"`` (a path, relative to the
  file's folder unless absolute); every other key is metadata for the rewards;
- a folder: every image (png, jpg, jpeg, webp, bmp) with its prompt in a text file of the same stem
  (``cat.png`` + ``cat.txt``), as fine-tuning datasets are often laid out.

Problems are one sentence naming the file (and the line of a JSONL file): an unreadable image, a decompression bomb
(an image header claiming more than twice PIL's ``MAX_IMAGE_PIXELS``, refused before it is decoded), a text file
that is not UTF-8.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import FlowRLError
from .files import read_utf8

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass
class Winners:
    images: Tensor  # (N, C, H, W) float32 in [0, 1]
    prompts: list[str]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, index: list[int]) -> Winners:
        return Winners(self.images[index], [self.prompts[i] for i in index], [dict(self.metadata[i]) for i in index])


def load_winners(source: str, channels: int, size: tuple[int, int]) -> Winners:
    """The winners of ``source`` ("embedded", a .jsonl file or a folder) as (channels, *size) images."""
    if source == "embedded":
        return _embedded(channels, size)
    path = Path(source).expanduser()
    if path.is_dir():
        return _folder(path, channels, size)
    if path.suffix == ".jsonl":
        if not path.is_file():
            raise FlowRLError(f"winners file '{path}' does not exist.")
        return _jsonl(path, channels, size)
    raise FlowRLError(f"objective.winners '{source}' is neither 'embedded', an existing folder, nor a .jsonl file.")


def top_fraction(winners: Winners, scores: Tensor, fraction: float) -> Winners:
    """Keep the best-scoring ``fraction`` of the distinct images of every group of winners with equal metadata
    (the digits: each class), at least one image per group, with all of each kept image's rows (an image
    listed once per prompt phrasing counts once), in their original order; ties keep the earlier image."""
    groups: dict[str, dict[bytes, list[int]]] = {}
    for i, m in enumerate(winners.metadata):
        image_rows = groups.setdefault(json.dumps(m, sort_keys=True, default=str), {})
        image_rows.setdefault(winners.images[i].numpy().tobytes(), []).append(i)
    keep = []
    for image_rows in groups.values():
        rows = list(image_rows.values())
        order = sorted(rows, key=lambda r: -max(float(scores[i]) for i in r))  # sorted() is stable
        for r in order[: max(1, round(fraction * len(rows)))]:
            keep += r
    return winners.subset(sorted(keep))


def _embedded(channels: int, size: tuple[int, int]) -> Winners:
    from .digits import IMAGE_SIZE, TRAIN_TEMPLATES, load_digit_images, prompt_for

    if (channels, *size) != (1, IMAGE_SIZE, IMAGE_SIZE):
        raise FlowRLError(
            f"objective.winners 'embedded' holds the embedded digits models' 1x{IMAGE_SIZE}x{IMAGE_SIZE} images, "
            f"but this model makes {channels}x{size[0]}x{size[1]} samples; give a folder or a .jsonl file of images."
        )
    images, labels = load_digit_images()
    rows = [(i, prompt_for(int(labels[i]), t)) for i in range(len(labels)) for t in TRAIN_TEMPLATES]  # image-major
    index = [i for i, _ in rows]
    return Winners((images[index] + 1) / 2, [p for _, p in rows], [{"digit": int(labels[i])} for i in index])


def _read_image(path: Path, channels: int, size: tuple[int, int], where: str) -> Tensor:
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FlowRLError(f"image '{path}' ({where}) does not exist.")
    try:
        with Image.open(path) as img:
            img = img.convert("L" if channels == 1 else "RGB")
            if img.size != (size[1], size[0]):
                img = img.resize((size[1], size[0]), Image.Resampling.BICUBIC)
            data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    except Image.DecompressionBombError as e:  # a header claiming more than twice PIL's pixel limit: never decoded
        claimed = re.search(r"\((\d+) pixels\)", str(e))
        pixels = f"{int(claimed.group(1)):,}" if claimed else "more"
        raise FlowRLError(
            f"image '{path}' ({where}) claims {pixels} pixels, more than twice PIL's limit of {Image.MAX_IMAGE_PIXELS:,} "
            "(a decompression bomb, or an image far too large for a training example), so it was not decoded; "
            "remove it or resize it."
        ) from None
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise FlowRLError(f"image '{path}' ({where}) could not be read ({e.__class__.__name__}).") from None
    return data.view(size[0], size[1], channels).permute(2, 0, 1).float() / 255.0


def _jsonl(path: Path, channels: int, size: tuple[int, int]) -> Winners:
    images, prompts, metadata = [], [], []
    for n, line in enumerate(read_utf8(path, f"winners file '{path}'").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise FlowRLError(f"line {n} of winners file '{path}' is not valid JSON.") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("image"), str):
            raise FlowRLError(f"line {n} of winners file '{path}' needs a string 'prompt' and a string 'image' (a path).")
        image = Path(row["image"]).expanduser()
        images.append(_read_image(image if image.is_absolute() else path.parent / image, channels, size, f"line {n} of '{path}'"))
        prompts.append(row["prompt"])
        metadata.append({k: v for k, v in row.items() if k not in ("prompt", "image")})
    if not prompts:
        raise FlowRLError(f"winners file '{path}' holds no examples.")
    return Winners(torch.stack(images), prompts, metadata)


def _folder(path: Path, channels: int, size: tuple[int, int]) -> Winners:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FlowRLError(f"winners folder '{path}' holds no images ({', '.join(IMAGE_SUFFIXES)}).")
    images, prompts = [], []
    for f in files:
        caption = f.with_suffix(".txt")
        if not caption.is_file():
            raise FlowRLError(f"image '{f}' of winners folder '{path}' has no prompt file '{caption.name}'.")
        images.append(_read_image(f, channels, size, f"winners folder '{path}'"))
        prompts.append(read_utf8(caption, f"prompt file '{caption}' of winners folder '{path}'").strip())
    return Winners(torch.stack(images), prompts, [{} for _ in prompts])
