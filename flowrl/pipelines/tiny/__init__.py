"""Tiny random-weight checkpoints of every model family: ``flowrl tiny FAMILY OUT`` / :func:`tiny_checkpoint`.

Each builder makes the family's real diffusers / transformers classes at a tiny config (seeded, a few MB, seconds on a
CPU) and saves them as the hub checkpoint is laid out (``model_index.json`` and component folders; a transformers
model directory for a diffusion LM), so ``pipeline.name=FAMILY pipeline.pretrained=OUT`` loads it through the same
path as the real model. The weights are random: a run on them exercises the whole code path (loading, encoding,
sampling, log-probs, the objective, LoRA, checkpoints), never image quality. The family tests build their models
here too (tests/test_family_*.py). ``runs.py`` holds the overrides that run each shipped preset on one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import FlowRLError


@dataclass(frozen=True)
class Variant:
    """One checkpoint a family loads: its builder (``module:function`` of this package, called as
    ``build(directory, seed=seed, **kwargs)``) and what it is."""

    builder: str
    about: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, directory: Path, seed: int) -> Path:
        module, name = self.builder.split(":")
        getattr(importlib.import_module(f"{__name__}.{module}"), name)(directory, seed=seed, **self.kwargs)
        return Path(directory)


EDIT = {"prompts": True}  # image-conditioned: a prompt file with source images in OUT/prompts/
# pipeline.name -> its variants, the default first
FAMILIES: dict[str, dict[str, Variant]] = {
    "stable_diffusion": {
        "epsilon": Variant("unet:build_tiny_sd", "SD 1.x-shaped UNet, epsilon prediction, DDIM"),
        "v_prediction": Variant("unet:build_tiny_sd", "SD 2.x-shaped: v-prediction", {"prediction_type": "v_prediction"}),
    },
    "sdxl": {
        "epsilon": Variant("unet:build_tiny_sdxl", "SDXL base-shaped: two CLIP encoders, time ids, Euler"),
        "v_prediction": Variant("unet:build_tiny_sdxl", "SDXL with v-prediction", {"prediction_type": "v_prediction"}),
    },
    "sd3": {
        "sd3.5": Variant("sd3_flux:build_tiny_sd3", "SD3.5-shaped MMDiT, CLIP + CLIP + T5"),
        "no-t5": Variant("sd3_flux:build_tiny_sd3", "SD3 without its T5 encoder", {"with_t5": False}),
    },
    "flux": {
        "dev": Variant("sd3_flux:build_tiny_flux", "FLUX.1-dev-shaped: guidance embedding"),
        "schnell": Variant("sd3_flux:build_tiny_flux", "FLUX.1-schnell-shaped: no guidance embedding", {"guidance_embeds": False}),
    },
    "flux_kontext": {"dev": Variant("sd3_flux:build_tiny_kontext", "FLUX.1-Kontext-dev-shaped, with source images", EDIT)},
    "flux2": {
        "dev": Variant("flux2:build_tiny_flux2", "FLUX.2-dev-shaped: Mistral3 encoder, guidance embedding"),
        "klein": Variant("flux2:build_tiny_flux2", "FLUX.2-klein (distilled): Qwen3 encoder", {"variant": "klein", "is_distilled": True}),
        "klein-base": Variant("flux2:build_tiny_flux2", "FLUX.2-klein-base: Qwen3 encoder, true CFG", {"variant": "klein"}),
    },
    "z_image": {"turbo": Variant("z_image:build_tiny_z_image", "Z-Image(-Turbo)-shaped: Qwen3 captions, Turbo's scheduler")},
    "qwen_image": {"t2i": Variant("qwen_image:build_tiny_qwen_image", "Qwen-Image-shaped: Qwen2.5-VL encoder")},
    "qwen_image_edit": {
        "edit": Variant("qwen_image:build_tiny_qwen_edit", "Qwen-Image-Edit-shaped, with source images", EDIT),
    },
    "qwen_image_edit_plus": {
        "2509": Variant("qwen_image:build_tiny_qwen_edit", "Qwen-Image-Edit-2509-shaped", {"plus": True, "zero_cond_t": False, **EDIT}),
        "2511": Variant("qwen_image:build_tiny_qwen_edit", "Qwen-Image-Edit-2511-shaped: zero_cond_t", {"plus": True, **EDIT}),
    },
    "wan": {
        "t2v": Variant("video:build_tiny_wan", "Wan2.1 T2V-shaped"),
        "a14b": Variant("video:build_tiny_wan22", "Wan2.2 T2V-A14B-shaped: two experts"),
        "ti2v": Variant("video:build_tiny_ti2v", "Wan2.2 TI2V-5B-shaped: 48-channel VAE, one timestep per token"),
    },
    "wan_i2v": {
        "i2v": Variant("video:build_tiny_wan_i2v", "Wan2.1 I2V-shaped: CLIP image encoder, with first frames", EDIT),
        "a14b": Variant("video:build_tiny_wan22", "Wan2.2 I2V-A14B-shaped: two experts, with first frames", {"i2v": True, **EDIT}),
        "ti2v": Variant("video:build_tiny_ti2v", "Wan2.2 TI2V-5B-shaped, with first frames", EDIT),
    },
    "cogvideox": {
        "rotary": Variant("video:build_tiny_cogvideox", "CogVideoX-5b-shaped: rotary positions"),
        "sincos": Variant("video:build_tiny_cogvideox", "CogVideoX-2b-shaped: sinusoidal positions", {"rotary": False}),
    },
    "amused": {"256": Variant("amused:build_tiny_amused", "aMUSEd-shaped: VQModel tokens, UVit2DModel")},
    "dllm": {
        "mdlm": Variant("text:build_tiny_mdlm", "masked-diffusion LM (BertForMaskedLM, arith_mdlm's class)"),
        "bd3lm": Variant("text:build_tiny_bd3lm", "block-diffusion LM (LlamaForCausalLM, blocks of 4, arith_bd3lm's class)"),
    },
    "diffusion_gemma": {"tiny": Variant("text:build_tiny_diffusion_gemma", "DiffusionGemmaForBlockDiffusion, 2 layers")},
}
SHIPPED = ("digits", "digits_video", "toy2d")  # families whose models ship with flowrl: nothing to build


def family_list() -> str:
    """Every family with its variants, the default first: ``amused, cogvideox (rotary, sincos), ...``."""
    return ", ".join(f"{name} ({', '.join(v)})" if len(v) > 1 else name for name, v in FAMILIES.items())


def variant_of(family: str, variant: str | None = None) -> tuple[str, Variant]:
    """The family's ``variant`` (None: its first) and its name; one sentence for an unknown family or variant."""
    if family not in FAMILIES:
        shipped = f" ({family}'s models ship with flowrl)" if family in SHIPPED else ""
        raise FlowRLError(f"no tiny checkpoint for family '{family}'{shipped}; the families are: {family_list()}.")
    variants = FAMILIES[family]
    name = variant or next(iter(variants))
    if name not in variants:
        raise FlowRLError(f"family '{family}' has no variant '{name}'; its variants are: {', '.join(variants)}.")
    return name, variants[name]


def tiny_checkpoint(family: str, out: str | Path, variant: str | None = None, seed: int = 0, overwrite: bool = False) -> Path:
    """Write a tiny random-weight checkpoint of ``family`` (a ``pipeline.name``) into ``out`` and return its path.

    ``variant``: one of the family's checkpoints (``flux2``: dev, klein, klein-base; None: the first); ``seed``: the
    weights' seed (the same seed gives the same weights). An existing non-empty ``out`` is refused unless
    ``overwrite``; the directory appears whole or not at all, and the global torch RNG is left as it was."""
    import torch

    from ...atomic_files import atomic_directory

    name, chosen = variant_of(family, variant)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FlowRLError(f"'{out}' exists and is not an empty directory; choose another OUT or pass --overwrite.")
    with torch.random.fork_rng(devices=[]), atomic_directory(out) as tmp:
        chosen.build(tmp, seed)
    return out
