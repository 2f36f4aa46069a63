"""Pipeline adapters: one thin file per model family; ``embedded/`` holds the shipped tiny models.

``FAMILIES`` is the one table of ``pipeline.name`` values: each names the family's config section (in the
family's own file), which builds its adapter (docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FlowRLError
from ..registry import Registry
from ..sections import PipelineSection
from ..types import Pipeline
from .common import DTYPES, LoraConfig, resolve_device

__all__ = ["DTYPES", "FAMILIES", "LoraConfig", "build_pipeline", "resolve_device"]


def _needs_a_section(target: Any, name: str) -> Any:
    """A family has no signature to read a section from: it is declared by its section class."""
    kind = (
        "function"
        if callable(target) and not isinstance(target, type)
        else type(target).__name__
        if not isinstance(target, type)
        else "class"
    )
    raise FlowRLError(
        f"pipeline.name '{name}' is a {kind}, not a model family's section (a PipelineSection subclass whose build() makes "
        f'the adapter; docs/architecture.md, "Adding a model family").'
    )


FAMILIES = Registry(
    "model family",
    "pipeline.name",
    {
        "digits": "flowrl.pipelines.digits:DigitsConfig",
        "digits_video": "flowrl.pipelines.digits_video:DigitsVideoConfig",
        "stable_diffusion": "flowrl.pipelines.stable_diffusion:StableDiffusionConfig",
        "sdxl": "flowrl.pipelines.sdxl:SDXLConfig",
        "sd3": "flowrl.pipelines.sd3:SD3Config",
        "flux": "flowrl.pipelines.flux:FluxConfig",
        "flux_kontext": "flowrl.pipelines.flux_kontext:FluxKontextConfig",
        "flux2": "flowrl.pipelines.flux2:Flux2Config",
        "z_image": "flowrl.pipelines.z_image:ZImageConfig",
        "wan": "flowrl.pipelines.wan:WanConfig",
        "wan_i2v": "flowrl.pipelines.wan:WanImageToVideoConfig",
        "qwen_image": "flowrl.pipelines.qwen_image:QwenImageConfig",
        "qwen_image_edit": "flowrl.pipelines.qwen_image:QwenImageEditConfig",
        "qwen_image_edit_plus": "flowrl.pipelines.qwen_image:QwenImageEditPlusConfig",
        "cogvideox": "flowrl.pipelines.cogvideox:CogVideoXConfig",
        "toy2d": "flowrl.pipelines.toy2d:Toy2DConfig",
        "dllm": "flowrl.pipelines.dllm:DLLMPipelineConfig",
        "diffusion_gemma": "flowrl.pipelines.diffusion_gemma:DiffusionGemmaPipelineConfig",
        "amused": "flowrl.pipelines.amused:AmusedConfig",
    },
    base=PipelineSection,
    derive=_needs_a_section,
    group="flowrl.pipelines",
)


def family_section(section: PipelineSection) -> PipelineSection:
    """``section`` as its family's own section class (a generic ``PipelineConfig(name="sd3")`` becomes an
    ``SD3Config``), so it builds that family's adapter."""
    cls = FAMILIES.section(section.name)
    return section if type(section) is cls else cls.model_validate(section.model_dump())


def build_pipeline(section: PipelineSection, device: torch.device | str, loaded: Any = None) -> Pipeline:
    """The model ``section`` describes, on ``device``; ``loaded``: a model already in memory to use instead of
    loading ``section.pretrained`` (a diffusers pipeline; for text, a transformers model or (model, tokenizer))."""
    return family_section(section).build(device, loaded)
