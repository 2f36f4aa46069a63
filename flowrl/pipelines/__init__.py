"""Pipeline adapters: one thin file per model family; ``embedded/`` holds the shipped tiny models."""

from __future__ import annotations

import importlib

import torch

from ..types import Pipeline

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# pipeline.name -> "module:Class"; each class is built with ``Class.from_config(config, device)``.
FAMILIES = {
    "digits": "digits:DigitsPipeline",
    "digits_video": "digits_video:DigitsVideoPipeline",
    "stable_diffusion": "stable_diffusion:StableDiffusionAdapter",
    "sdxl": "sdxl:SDXLAdapter",
    "sd3": "sd3:SD3Adapter",
    "flux": "flux:FluxAdapter",
    "wan": "wan:WanAdapter",
    "cogvideox": "cogvideox:CogVideoXAdapter",
    "wan_i2v": "wan:WanImageToVideoAdapter",
    "toy2d": "toy2d:Toy2DPipeline",
}


def pipeline_class(name: str) -> type:
    module, cls = FAMILIES[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def build_pipeline(config, device: torch.device | str) -> Pipeline:
    return pipeline_class(config.name).from_config(config, device)
