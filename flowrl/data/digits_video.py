"""The data behind the embedded text-to-video model: "moving digits" clips built from the bundled 8x8
handwritten digits (``flowrl.data.digits.load_digit_images``).

A clip is ``NUM_FRAMES`` frames of a ``CANVAS`` x ``CANVAS`` black canvas on which one 8x8 digit
translates by ``SPEED`` pixels per frame in the direction the prompt names (left, right, up, down).
The path is centred on the canvas (optionally moved by up to ``JITTER`` pixels), so the whole digit
stays inside it; what varies between clips is the handwriting (1797 digit images) and the direction. The pixels are exact copies of the digit image (no interpolation), so
the centre of mass of every clip moves by exactly ``SPEED * (NUM_FRAMES - 1)`` pixels.

Prompts come in two disjoint template sets, as for the image model: ``TRAIN_TEMPLATES`` (RL training
prompts) and ``EVAL_TEMPLATES`` (held-out phrasings for evaluation). The generator is pre-trained on
both, so the held-out phrasings are understood but never optimised against. Metadata of a prompt:
``{"digit": d, "direction": "left"}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .digits import IMAGE_SIZE, NUMBER_WORDS, load_digit_images, prompt_tokenizer

CANVAS = 16  # frame height = width in pixels
NUM_FRAMES = 4
SPEED = 2  # pixels per frame
JITTER = 0  # the path is centred; the start may move up to JITTER pixels along and across the motion axis
# direction -> (dy, dx) per frame, image coordinates (y grows downwards)
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
DIRECTION_NAMES = list(DIRECTIONS)
TRAIN_TEMPLATES = ["the digit {word} moving {dir}", "a handwritten {word} sliding {dir}", "digit {n} going {dir}", "a {word} moves {dir}"]
EVAL_TEMPLATES = ["the number {word} drifting {dir}", "handwritten digit {n} travelling {dir}"]
MAX_PROMPT_TOKENS = 8  # [BOS] + at most 6 words + [EOS]


def prompt_for(digit: int, direction: str, template: str) -> str:
    return template.format(word=NUMBER_WORDS[digit], n=digit, dir=direction)


def prompt_set(split: str) -> list[tuple[str, dict[str, Any]]]:
    """All (prompt, metadata) pairs of a split ("train" or "eval"), in a fixed order: template, digit,
    direction (so the first 4k prompts are digits 0..k-1 in every direction)."""
    templates = {"train": TRAIN_TEMPLATES, "eval": EVAL_TEMPLATES}[split]
    return [(prompt_for(d, m, t), {"digit": d, "direction": m}) for t in templates for d in range(10) for m in DIRECTION_NAMES]


def vocabulary() -> list[str]:
    specials = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
    words: set[str] = set()
    for template in TRAIN_TEMPLATES + EVAL_TEMPLATES:
        for d in range(10):
            for m in DIRECTION_NAMES:
                words.update(prompt_for(d, m, template).split())
    return specials + sorted(words)


def build_tokenizer():
    """The image model's word-level tokenizer (``digits.prompt_tokenizer``) over this vocabulary (saved with the model)."""
    return prompt_tokenizer(vocabulary(), MAX_PROMPT_TOKENS)


# -- clips ----------------------------------------------------------------------------------------
def start_position(direction: str, along: int = 0, across: int = 0) -> tuple[int, int]:
    """Top-left (y, x) of the digit in frame 0: the path is centred on the canvas, then moved by
    ``along`` pixels along the motion axis and ``across`` pixels across it (each in [-JITTER, JITTER])."""
    dy, dx = DIRECTIONS[direction]
    assert max(abs(along), abs(across)) <= JITTER
    slack = CANVAS - IMAGE_SIZE - SPEED * (NUM_FRAMES - 1)  # free pixels along the motion axis
    # A digit moving towards +y / +x starts near 0, one moving towards -y / -x near the far edge.
    first = slack // 2 + along if (dy + dx) > 0 else CANVAS - IMAGE_SIZE - slack // 2 + along
    centre = (CANVAS - IMAGE_SIZE) // 2 + across
    return (first, centre) if dy else (centre, first)


def render_clip(image: Tensor, direction: str, along: int = 0, across: int = 0) -> Tensor:
    """One clip (1, T, CANVAS, CANVAS) in [-1, 1] (background -1) of ``image`` (1, 8, 8) in [-1, 1]."""
    dy, dx = DIRECTIONS[direction]
    y0, x0 = start_position(direction, along, across)
    clip = torch.full((1, NUM_FRAMES, CANVAS, CANVAS), -1.0)
    for t in range(NUM_FRAMES):
        y, x = y0 + dy * SPEED * t, x0 + dx * SPEED * t
        clip[0, t, y : y + IMAGE_SIZE, x : x + IMAGE_SIZE] = image[0]
    return clip


def sample_clips(images: Tensor, labels: Tensor, batch: int, generator: torch.Generator) -> tuple[Tensor, list[int], list[str]]:
    """``batch`` random clips (B, 1, T, CANVAS, CANVAS) in [-1, 1], their digits and directions; every
    draw comes from ``generator``, so a seed fixes the clips."""
    idx = torch.randint(0, images.shape[0], (batch,), generator=generator).tolist()
    dirs = torch.randint(0, len(DIRECTION_NAMES), (batch,), generator=generator).tolist()
    along = torch.randint(-JITTER, JITTER + 1, (batch,), generator=generator).tolist()
    across = torch.randint(-JITTER, JITTER + 1, (batch,), generator=generator).tolist()
    clips = torch.stack([render_clip(images[i], DIRECTION_NAMES[m], a, c) for i, m, a, c in zip(idx, dirs, along, across)])
    return clips, [int(labels[i]) for i in idx], [DIRECTION_NAMES[m] for m in dirs]


def example_clips(seed: int = 0, batch: int = 16) -> tuple[Tensor, list[int], list[str]]:
    """Deterministic clips for tests and docs: (B, 1, T, H, W) in [0, 1], digits, directions."""
    images, labels = load_digit_images()
    clips, digits, dirs = sample_clips(images, labels, batch, torch.Generator().manual_seed(seed))
    return (clips + 1) / 2, digits, dirs


# -- measuring motion -----------------------------------------------------------------------------
def centre_of_mass(videos: Tensor, floor: float = 0.2) -> Tensor:
    """(B, C, T, H, W) in [0, 1] -> (B, T, 2) intensity-weighted (y, x) of every frame. Intensities
    below ``floor`` (background noise of generated clips) do not count."""
    v = videos.float().mean(dim=1)  # (B, T, H, W)
    w = (v - floor).clamp(min=0)
    h, wd = v.shape[-2:]
    ys = torch.arange(h, dtype=torch.float32).view(1, 1, h, 1)
    xs = torch.arange(wd, dtype=torch.float32).view(1, 1, 1, wd)
    mass = w.sum(dim=(-2, -1)).clamp(min=1e-6)
    return torch.stack([(w * ys).sum(dim=(-2, -1)) / mass, (w * xs).sum(dim=(-2, -1)) / mass], dim=-1)


def displacement(videos: Tensor) -> Tensor:
    """(B, 2) centre-of-mass shift (dy, dx) in pixels from the first frame to the last."""
    com = centre_of_mass(videos)
    return com[:, -1] - com[:, 0]


def measured_directions(videos: Tensor) -> list[str]:
    """The direction each clip moves in: the one whose unit vector has the largest dot product with
    the centre-of-mass displacement."""
    units = torch.tensor([DIRECTIONS[m] for m in DIRECTION_NAMES], dtype=torch.float32)  # (4, 2) as (dy, dx)
    return [DIRECTION_NAMES[i] for i in (displacement(videos) @ units.T).argmax(dim=1).tolist()]


def direction_accuracy(videos: Tensor, directions: Sequence[str]) -> float:
    """Fraction of clips whose measured direction is the asked one."""
    got = measured_directions(videos)
    return sum(g == d for g, d in zip(got, directions)) / max(len(got), 1)


def digit_crops(videos: Tensor, frame: int = 0) -> Tensor:
    """(B, 1, 8, 8) in [0, 1]: the 8x8 window centred on the centre of mass of one frame of each clip,
    for the embedded digit classifier (which reads 8x8 digits)."""
    com = centre_of_mass(videos)[:, frame]
    v = videos.float().mean(dim=1)[:, frame]  # (B, H, W)
    h, w = v.shape[-2:]
    crops = []
    for img, (cy, cx) in zip(v, com.tolist()):
        y = min(max(int(round(cy - (IMAGE_SIZE - 1) / 2)), 0), h - IMAGE_SIZE)
        x = min(max(int(round(cx - (IMAGE_SIZE - 1) / 2)), 0), w - IMAGE_SIZE)
        crops.append(img[y : y + IMAGE_SIZE, x : x + IMAGE_SIZE])
    return torch.stack(crops).unsqueeze(1)
