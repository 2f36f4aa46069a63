"""Adapter for the embedded text-to-video model ("moving digits", pixel space, 1 x 4 x 16 x 16).

Components use the diffusers/transformers layout: ``transformer/`` (CogVideoXTransformer3DModel),
``text_encoder/`` (CLIPTextModel), ``tokenizer/``, ``scheduler/`` (FlowMatchEulerDiscreteScheduler:
rectified flow). They are loaded with ``from_pretrained`` from the shipped asset (``digits_video``,
written by ``python -m flowrl.pipelines.embedded.train_digits_video``) or any local directory of the
same layout. Latents and decoded samples are videos (B, C, T, H, W), the layout of the video rewards.
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
from ..samplers.schedules import FlowSchedule
from ..types import Condition
from .embedded.digits_video_data import CANVAS, MAX_PROMPT_TOKENS, NUM_FRAMES
from .guidance import guided_prediction

ASSETS = Path(__file__).resolve().parents[1] / "assets"
EMBEDDED = {"digits_video": ASSETS / "digits_video"}
REQUIRED = ("transformer", "text_encoder", "tokenizer", "scheduler")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def denoise(transformer: torch.nn.Module, x: Tensor, timestep: Tensor, context: Tensor) -> Tensor:
    """One denoiser call on flowrl's layout: (B, C, T, H, W) in and out (CogVideoX works frames first)."""
    return transformer(x.transpose(1, 2), context, timestep).sample.transpose(1, 2)


def resolve_pretrained(pretrained: str) -> Path:
    """Map the embedded model name or a local directory to a directory; fail with one sentence."""
    path = EMBEDDED.get(pretrained, Path(pretrained).expanduser())
    if not path.is_dir():
        raise FlowRLError(f"pipeline.pretrained '{pretrained}' is neither the embedded video model ({', '.join(EMBEDDED)}) "
                          "nor an existing directory.")
    missing = [c for c in REQUIRED if not (path / c).is_dir()]
    if missing:
        raise FlowRLError(f"model directory '{path}' lacks the component folder(s) {', '.join(missing)}.")
    return path


class DigitsVideoPipeline:
    """Pixel-space CogVideoXTransformer3DModel + CLIP text encoder, rectified flow, classifier-free guidance."""

    prediction_type = "flow"
    denoiser_subfolder = "transformer"  # where `flowrl export` writes the fine-tuned denoiser

    def __init__(self, pretrained: str = "digits_video", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 num_frames: int | None = None, height: int | None = None, width: int | None = None,
                 lora=None, gradient_checkpointing: bool = False):
        from diffusers import CogVideoXTransformer3DModel
        from transformers import AutoTokenizer, CLIPTextModel

        path = resolve_pretrained(pretrained)
        try:
            self.denoiser = CogVideoXTransformer3DModel.from_pretrained(path / "transformer", torch_dtype=dtype).to(device)
            self.text_encoder = CLIPTextModel.from_pretrained(path / "text_encoder", torch_dtype=dtype).to(device)
            self.tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
            scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        except (OSError, ValueError, RuntimeError) as e:
            raise FlowRLError(f"could not load the model in '{path}': {str(e).splitlines()[0]}") from None
        if not scheduler.get("_class_name", "").startswith("FlowMatch"):
            raise FlowRLError(f"model directory '{path}' has a {scheduler.get('_class_name')} scheduler; the video model is a rectified flow (FlowMatch*).")
        self.num_train_timesteps = int(scheduler.get("num_train_timesteps", 1000))
        self.schedule = FlowSchedule(shift=float(scheduler.get("shift", 1.0)))
        self.source = str(path)  # the model directory (`flowrl export` copies its other components)
        self.text_encoder.requires_grad_(False).eval()
        self.device, self.dtype = torch.device(device), dtype
        patch = self.denoiser.config.patch_size
        self.shape = (self.denoiser.config.in_channels, num_frames or NUM_FRAMES, height or CANVAS, width or CANVAS)
        if self.shape[2] % patch or self.shape[3] % patch:
            raise FlowRLError(f"pipeline height and width ({self.shape[2]}, {self.shape[3]}) must be multiples of the patch size {patch}.")
        self.lora = lora is not None
        if lora is not None:
            from peft import LoraConfig

            self.denoiser.requires_grad_(False)
            self.denoiser.add_adapter(LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=lora.target_modules or LORA_TARGETS, init_lora_weights="gaussian"))
        if gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        self._reference: torch.nn.Module | None = None
        self._use_reference = False
        self._uncond: Tensor | None = None
        self.guidance_mode = "cfg"  # set by the trainer from rollout.guidance_mode (see guidance.py)

    @classmethod
    def from_config(cls, config, device: str | torch.device) -> "DigitsVideoPipeline":
        from . import DTYPES

        return cls(config.pretrained, device=device, dtype=DTYPES[config.dtype], num_frames=config.num_frames,
                   height=config.height, width=config.width, lora=config.lora, gradient_checkpointing=config.gradient_checkpointing)

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
        """The only sigma -> model-timestep conversion of this model."""
        return torch.as_tensor(sigma, device=self.device).float() * self.num_train_timesteps

    def predict(self, x: Tensor, sigma: Tensor, cond: Condition, guidance_scale: float = 1.0) -> Tensor:
        """The velocity ``noise - x0`` at noise level ``sigma``, with classifier-free guidance."""
        model = self._reference if self._use_reference else self.denoiser
        t = self.timestep(sigma)

        def forward(x_in: Tensor, c: Condition) -> Tensor:
            return denoise(model, x_in.to(self.dtype), t.expand(x_in.shape[0]), c["prompt_embeds"].to(self.dtype))

        uncond = {"prompt_embeds": self.unconditional(x.shape[0])}
        if self._use_reference and self.lora:
            with _adapters_disabled(self.denoiser):
                return guided_prediction(forward, x, cond, uncond, guidance_scale, self.guidance_mode)
        return guided_prediction(forward, x, cond, uncond, guidance_scale, self.guidance_mode)

    def initial_noise(self, batch: int, generator: torch.Generator) -> Tensor:
        return torch.randn((batch, *self.shape), generator=generator, device=generator.device).to(self.device)

    def decode(self, x: Tensor) -> Tensor:
        """Videos (B, 1, T, H, W) float32 in [0, 1]."""
        return ((x.float().clamp(-1, 1) + 1) / 2).detach()

    # -- training support ---------------------------------------------------------------------
    @property
    def has_lora(self) -> bool:
        return self.lora

    def merged_denoiser(self) -> torch.nn.Module:
        """A copy of the denoiser with the LoRA update merged into its weights (for `flowrl export`)."""
        model = copy.deepcopy(_unwrap(self.denoiser))
        if self.lora:
            model.fuse_lora()
            model.unload_lora()
        return model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    def enable_reference(self) -> None:
        """The KL reference: with LoRA the base weights (adapters switched off), otherwise a frozen
        copy of the current denoiser (full fine-tuning)."""
        if self.lora:
            self._reference = self.denoiser
            return
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


@contextlib.contextmanager
def _adapters_disabled(module: torch.nn.Module):
    model = _unwrap(module)
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)
