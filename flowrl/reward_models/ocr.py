"""Text-rendering reward (Flow-GRPO's OCR reward) with RapidOCR (PP-OCR models run by onnxruntime).

The target text is ``metadata["text"]`` when given, else the first double-quoted span of the prompt
(``'a sign that says "flowrl"'`` -> ``flowrl``; Flow-GRPO takes ``prompt.split('"')[1]``). The image
is read with RapidOCR, the recognised lines are concatenated, and the score follows
``flow_grpo/ocr.py`` (``OcrScorer.__call__``) of Flow-GRPO (Liu et al. 2025, github.com/yifan123/flow_grpo):

    rec, tgt = recognised and target text, lowercased, spaces removed
    dist     = 0                      if tgt is a substring of rec
             = Levenshtein(rec, tgt)  otherwise
    dist     = min(dist, len(tgt))    ("recognised many unrelated characters": at most a full penalty)
    score    = 1 - dist / len(tgt)    in [0, 1]

so a clean rendering of the target scores 1 (extra recognised text around it is not penalised), a
blank image 0. NaN where a sample has no target text. Flow-GRPO recognises with PaddleOCR
(``use_angle_cls=False``, lines kept above PaddleOCR's default drop score 0.5); here RapidOCR's shipped
PP-OCR ONNX models do the recognition with the angle classifier off and RapidOCR's default
``text_score`` of 0.5, so scores are comparable but not bit-identical to Flow-GRPO's.

Input: images float32 (B, 1 or 3, H, W) in [0, 1]. Not differentiable. Needs ``pip install rapidocr
onnxruntime`` (the wheel ships the OCR weights, nothing is downloaded); the engine is built on the
first call.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import RewardOutput

_QUOTED = re.compile(r'"([^"]*)"')


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalize_text(text: str) -> str:
    """Flow-GRPO's normalisation: remove spaces, lowercase."""
    return text.replace(" ", "").lower()


def target_text(prompt: str, metadata: Mapping[str, Any]) -> str | None:
    """``metadata["text"]`` if present, else the first double-quoted span of the prompt, else None."""
    text = metadata.get("text")
    if text is None:
        match = _QUOTED.search(prompt)
        text = match.group(1) if match else None
    if text is None or not normalize_text(str(text)):
        return None
    return str(text)


def ocr_score(recognized: str, target: str) -> tuple[float, int]:
    """Return (score, clipped distance) exactly as Flow-GRPO's OcrScorer computes them."""
    rec, tgt = normalize_text(recognized), normalize_text(target)
    dist = 0 if tgt in rec else levenshtein(rec, tgt)
    dist = min(dist, len(tgt))
    return 1.0 - dist / len(tgt), dist


def to_uint8_bgr(samples: Tensor) -> np.ndarray:
    """(B, 1|3, H, W) in [0, 1] -> (B, H, W, 3) uint8 BGR (the channel order RapidOCR assumes for arrays)."""
    pixels = (samples.detach().float() * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
    pixels = pixels.transpose(0, 2, 3, 1)
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    return np.ascontiguousarray(pixels[..., ::-1])


class OCRReward:
    """score = 1 - min(edit distance, len(target)) / len(target) of the recognised text; see the module docstring."""

    name = "ocr"
    differentiable = False

    def __init__(self, text_score: float = 0.5, min_side: int = 0) -> None:
        """
        Args:
            text_score: recognised lines with a lower confidence are dropped (RapidOCR's default, 0.5).
            min_side: images whose shorter side is smaller are upscaled (nearest) to at least this
                size first; 0 leaves them as they are.
        """
        self.text_score = float(text_score)
        self.min_side = int(min_side)
        self._engine = None
        self.last_texts: list[str | None] = []

    @property
    def engine(self):
        if self._engine is None:
            try:
                from rapidocr import RapidOCR
            except ImportError as e:
                raise FlowRLError("the ocr reward needs RapidOCR; install it with `pip install rapidocr onnxruntime`.") from e
            self._engine = RapidOCR(params={"Global.log_level": "error", "Global.use_cls": False, "Global.text_score": self.text_score})
        return self._engine

    def recognize(self, image: np.ndarray) -> str:
        """All recognised lines of one (H, W, 3) uint8 BGR image, concatenated in RapidOCR's reading order."""
        if self.min_side and min(image.shape[:2]) < self.min_side:
            factor = math.ceil(self.min_side / min(image.shape[:2]))
            image = np.ascontiguousarray(image.repeat(factor, axis=0).repeat(factor, axis=1))
        result = self.engine(image, use_cls=False)
        texts = getattr(result, "txts", None) or ()
        return "".join(texts)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        if samples.ndim != 4 or samples.shape[1] not in (1, 3):
            raise FlowRLError(f"the ocr reward reads (B, 1 or 3, H, W) images, got shape {tuple(samples.shape)}.")
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]
        images = to_uint8_bgr(samples) if any(t is not None for t in targets) else None
        scores, dists, texts = [], [], []
        for i, target in enumerate(targets):
            if target is None:
                scores.append(math.nan)
                dists.append(math.nan)
                texts.append(None)
                continue
            recognized = self.recognize(images[i])
            score, dist = ocr_score(recognized, target)
            scores.append(score)
            dists.append(float(dist))
            texts.append(recognized)
        self.last_texts = texts
        device = samples.device
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32, device=device),
            extras={"edit_distance": torch.tensor(dists, dtype=torch.float32, device=device)},
        )
