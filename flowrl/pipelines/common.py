"""What every model family's config shares: the device, the weights' dtype and LoRA."""

from __future__ import annotations

import re
from typing import Annotated, Literal, get_args

import torch
from pydantic import AfterValidator, Field

from ..errors import FlowRLError
from ..sections import Section

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(Dtype)}


def _device_spec(v: str) -> str:
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v):  # what resolve_device() can check exists
        raise ValueError(f"must be auto, cpu, cuda, cuda:N or mps, got {v!r}")
    return v


DeviceSpec = Annotated[
    str,
    AfterValidator(_device_spec),
    Field(description='Where the model runs: "auto" lets accelerate place it (a GPU when present), else exactly this device.'),
]
ModelDtype = Annotated[Dtype, Field(description="Precision of the model's weights.")]
PromptLength = Annotated[int | None, Field(description="Left-pad prompts to this many tokens; None: the longest prompt of the batch.")]


def resolve_device(spec: str, key: str = "pipeline.device") -> torch.device | None:
    """The torch device ``spec`` names, or None for "auto" (accelerate's choice: a GPU when present). A device
    this machine does not have is refused in one sentence instead of silently running elsewhere."""
    if spec == "auto":
        return None
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FlowRLError(
                f"{key} is '{spec}' but this machine has no CUDA device (torch.cuda.is_available() is False); use {key}=cpu or {key}=auto."
            )
        if device.index is not None and device.index >= count:
            raise FlowRLError(f"{key} is '{spec}' but this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}).")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise FlowRLError(f"{key} is '{spec}' but MPS is not available on this machine; use {key}=cpu or {key}=auto.")
    return device


def device_for(spec: str) -> torch.device:
    """``pipeline.device`` honoured exactly (refused when this machine lacks it); ``auto``: a GPU when present."""
    device = resolve_device(spec)
    return device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LoraConfig(Section):
    """``pipeline.lora``: train low-rank adapters (peft) instead of the whole denoiser / language model."""

    r: int = Field(8, ge=1, description="Rank of the low-rank adapters.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator: the adapter's update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability on the adapters' input.")
    target_modules: list[str] | None = Field(None, description="Names of the modules that get adapters; None: the family's default.")


OptionalLora = Annotated[
    LoraConfig | None, Field(description="Train low-rank adapters (peft) with these settings; None: fine-tune the whole model.")
]
