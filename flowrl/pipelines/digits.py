"""Adapter for the embedded text-to-digit generators (pixel space, 1x8x8).

Components use the diffusers/transformers layout: ``unet/`` (UNet2DConditionModel), ``text_encoder/``
(CLIPTextModel), ``tokenizer/``, ``scheduler/`` (FlowMatchEulerDiscreteScheduler -> rectified flow,
DDPMScheduler -> epsilon/v diffusion). They are loaded with ``from_pretrained`` from the shipped assets
(``digits_flow``, ``digits_ddpm``) or any local directory of the same layout.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..samplers.schedules import DiscreteSchedule, FlowSchedule
from ..types import Condition
from .guidance import guided_prediction
from .embedded.digits_data import MAX_PROMPT_TOKENS

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED = {"digits_flow": ASSETS / "digits_flow", "digits_ddpm": ASSETS / "digits_ddpm"}
REQUIRED = ("unet", "text_encoder", "tokenizer", "scheduler")


def resolve_pretrained(pretrained: str) -> Path:
    """Map an embedded model name or a local directory to a directory; fail with one sentence."""
    path = EMBEDDED.get(pretrained, Path(pretrained).expanduser())
    if not path.is_dir():
        raise FlowRLError(f"pipeline.pretrained '{pretrained}' is neither an embedded model ({', '.join(EMBEDDED)}) nor an existing directory.")
    missing = [c for c in REQUIRED if not (path / c).is_dir()]
    if missing:
        raise FlowRLError(f"model directory '{path}' lacks the component folder(s) {', '.join(missing)}.")
    return path


class DigitsPipeline:
    """Pixel-space UNet2DConditionModel + CLIP text encoder, with classifier-free guidance."""

    def __init__(self, pretrained: str = "digits_flow", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        from diffusers import UNet2DConditionModel
        from transformers import AutoTokenizer, CLIPTextModel

        path = resolve_pretrained(pretrained)
        try:
            self.denoiser = UNet2DConditionModel.from_pretrained(path / "unet", torch_dtype=dtype).to(device)
            self.text_encoder = CLIPTextModel.from_pretrained(path / "text_encoder", torch_dtype=dtype).to(device)
            self.tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
        except (OSError, ValueError, RuntimeError) as e:
            raise FlowRLError(f"could not load the model in '{path}': {str(e).splitlines()[0]}") from None
        self.text_encoder.requires_grad_(False).eval()
        self.device, self.dtype = torch.device(device), dtype
        self._configure_schedule(path / "scheduler")
        self._reference: torch.nn.Module | None = None
        self._use_reference = False
        self._uncond: Tensor | None = None
        self.guidance_mode = "cfg"  # set by the trainer from rollout.guidance_mode (see guidance.py)

    @classmethod
    def from_config(cls, config, device: str | torch.device) -> "DigitsPipeline":
        from . import DTYPES

        return cls(config.pretrained, device=device, dtype=DTYPES[config.dtype])

    def _configure_schedule(self, scheduler_dir: Path) -> None:
        config = json.loads((scheduler_dir / "scheduler_config.json").read_text())
        self.num_train_timesteps = int(config.get("num_train_timesteps", 1000))
        if config["_class_name"].startswith("FlowMatch"):
            self.prediction_type = "flow"
            self.schedule = FlowSchedule(shift=float(config.get("shift", 1.0)))
        else:
            from diffusers import DDPMScheduler

            self.prediction_type = config.get("prediction_type", "epsilon")
            self.schedule = DiscreteSchedule.from_diffusers(DDPMScheduler.from_config(config))

    # -- conditioning -------------------------------------------------------------------------
    @torch.no_grad()
    def _embed(self, prompts: Sequence[str]) -> Tensor:
        ids = self.tokenizer(list(prompts), padding="max_length", max_length=MAX_PROMPT_TOKENS, truncation=True, return_tensors="pt").input_ids
        return self.text_encoder(ids.to(self.device)).last_hidden_state.float()  # (B, L, D)

    def encode(self, prompts: Sequence[str]) -> Condition:
        return {"prompt_embeds": self._embed(prompts)}

    def unconditional(self, batch: int) -> Tensor:
        if self._uncond is None:
            self._uncond = self._embed([""])
        return self._uncond.expand(batch, -1, -1)

    # -- denoising ----------------------------------------------------------------------------
    def timestep(self, sigma: Tensor) -> Tensor:
        """The only sigma -> model-timestep conversion of this model family."""
        sigma = torch.as_tensor(sigma, device=self.device)
        if self.prediction_type == "flow":
            return sigma.float() * self.num_train_timesteps
        return self.schedule.timestep(sigma)

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        model = self._reference if self._use_reference else self.denoiser
        t = self.timestep(sigma)

        def forward(x_in: Tensor, c: Condition) -> Tensor:
            return model(x_in.to(self.dtype), t.expand(x_in.shape[0]), c["prompt_embeds"].to(self.dtype)).sample

        uncond = {"prompt_embeds": self.unconditional(x.shape[0])}
        return guided_prediction(forward, x, cond, uncond, guidance_scale, self.guidance_mode)

    def initial_noise(self, batch: int, generator: torch.Generator) -> Tensor:
        return torch.randn((batch, 1, 8, 8), generator=generator, device=generator.device).to(self.device)

    def decode(self, x: Tensor) -> Tensor:
        return ((x.float().clamp(-1, 1) + 1) / 2).detach()

    # -- training support ---------------------------------------------------------------------
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def enable_reference(self) -> None:
        """Keep a frozen copy of the current denoiser as the KL reference (full fine-tuning)."""
        self._reference = copy.deepcopy(_unwrap(self.denoiser)).requires_grad_(False).eval()

    @contextlib.contextmanager
    def reference(self):
        if self._reference is None:
            raise FlowRLError("a reference model was requested but none was enabled (objective.beta is 0).")
        self._use_reference = True
        try:
            yield self
        finally:
            self._use_reference = False


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)
