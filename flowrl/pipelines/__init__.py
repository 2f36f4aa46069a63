"""Pipeline adapters: one thin file per model family; ``embedded/`` holds the shipped tiny models."""

from __future__ import annotations

import torch

from ..types import Pipeline

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_pipeline(config, device: torch.device | str) -> Pipeline:
    from .digits import DigitsPipeline

    return DigitsPipeline(config.pretrained, device=device, dtype=DTYPES[config.dtype])
