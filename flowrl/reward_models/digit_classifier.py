"""A small CNN that reads 8x8 digits, and the prompt-alignment reward built on it.

The reward is the embedded analogue of a CLIP score: the probability the classifier gives to the
digit the prompt asked for. It is differentiable, so direct reward backpropagation can use it.
Weights ship in ``flowrl/assets/digit_classifier/`` and are written by
``python -m flowrl.reward_models.train_digit_classifier``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput

WEIGHTS_FILE = "model.safetensors"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "assets" / "digit_classifier"
NUM_CLASSES = 10
IMAGE_SIZE = 8


class DigitClassifier(nn.Module):
    """Classify (B, 1, 8, 8) images in [0, 1] into 10 digit logits."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 64),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(64, NUM_CLASSES),
        )

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))


def weights_path(path: str | Path | None = None) -> Path:
    """Resolve ``path`` (a weights file, a directory holding one, or None for the shipped weights)."""
    p = Path(path) if path is not None else DEFAULT_DIR
    if p.is_file() or p.suffix == ".safetensors":
        return p
    return p / WEIGHTS_FILE


def load_classifier(path: str | Path | None = None) -> DigitClassifier:
    """Load a frozen classifier in eval mode; raise FlowRLError if its weights are missing or unreadable."""
    from safetensors.torch import load_file

    file = weights_path(path)
    if not file.is_file():
        raise FlowRLError(
            f"digit classifier weights not found at {file}; run `python -m flowrl.reward_models.train_digit_classifier` to create them."
        )
    try:
        state = load_file(str(file))
    except Exception as e:  # safetensors raises several types for truncated or garbage files
        raise FlowRLError(f"digit classifier weights at {file} are corrupt ({str(e).splitlines()[0]}).") from e
    model = DigitClassifier()
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise FlowRLError(
            f"digit classifier weights at {file} do not fit the classifier architecture; retrain them with "
            "`python -m flowrl.reward_models.train_digit_classifier`."
        ) from e
    model.eval()
    model.requires_grad_(False)
    return model


def target_digits(metadata: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """The digit each sample was asked for, or None where the metadata names none."""
    digits: list[int | None] = []
    for m in metadata:
        d = m.get("digit")
        if d is not None and not 0 <= int(d) < NUM_CLASSES:
            raise FlowRLError(f"metadata digit {d!r} is outside 0-9.")
        digits.append(None if d is None else int(d))
    return digits


class DigitClassifierReward:
    """Score each image by the classifier's probability of the prompted digit (NaN without a digit).

    Args:
        path: the classifier's weights file; None: the embedded classifier shipped with flowrl.
    """

    name = "digit_classifier"
    differentiable = True
    # Metadata every prompt must carry for a score (checked when a run starts: a prompt without it scores NaN forever).
    required_metadata = ("digit",)

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = path
        self._model: DigitClassifier | None = None

    @property
    def model(self) -> DigitClassifier:
        # Loaded on first use so that building a reward (e.g. to validate a config) costs nothing.
        if self._model is None:
            self._model = self._outside_inference_mode(lambda: load_classifier(self.path))
        return self._model

    @staticmethod
    def _outside_inference_mode(fn):
        # Weights created (or moved) under a caller's torch.inference_mode() would be inference
        # tensors, which break every later differentiable call; build them as ordinary tensors.
        with torch.inference_mode(False):
            return fn()

    def logits(self, samples: Tensor) -> Tensor:
        """Return (B, 10) logits for (B, 1|3, 8, 8) images in [0, 1], keeping the graph to ``samples``."""
        if samples.ndim != 4 or samples.shape[1] not in (1, 3) or samples.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
            raise FlowRLError(f"the digit classifier reads (B, 1 or 3, 8, 8) images, got shape {tuple(samples.shape)}.")
        x = samples.float()
        if x.shape[1] == 3:
            x = x.mean(dim=1, keepdim=True)
        model = self._outside_inference_mode(lambda: self.model.to(samples.device))
        return model(x)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        digits = target_digits(metadata)
        has = torch.tensor([d is not None for d in digits], device=samples.device)
        index = torch.tensor([d if d is not None else 0 for d in digits], device=samples.device)
        probs = self.logits(samples).softmax(dim=-1)
        picked = probs.gather(1, index[:, None]).squeeze(1)
        nan = torch.full_like(picked, math.nan)
        scores = torch.where(has, picked, nan)
        correct = (probs.detach().argmax(dim=-1) == index).float()
        accuracy = torch.where(has, correct, nan.detach())
        return RewardOutput(scores=scores, extras={"accuracy": accuracy})
