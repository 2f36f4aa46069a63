"""The held-out evaluation setting of an image / video run: which items, on which time grid, with which
guidance and seed. One definition, used by training-time evaluation and by ``flowrl eval`` (plain,
best-of-N, noise search, SVDD), so every number flowrl prints about a model is measured the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..config import Config, eval_steps_and_guidance
from ..prompts import prompts_for


@dataclass
class HeldOut:
    """The held-out items (each prompt ``eval.samples_per_prompt`` times, prompt-major), the time grid,
    the guidance scale and the seed of the generator every evaluation starts from."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    sigmas: Tensor
    guidance_scale: float
    seed: int

    def generator(self) -> torch.Generator:
        """A fresh generator: every evaluation, on every process, draws the same initial noise."""
        return torch.Generator().manual_seed(self.seed)

    def __len__(self) -> int:
        return len(self.prompts)


def eval_pool(config: Config) -> list[tuple[str, dict[str, Any]]]:
    return prompts_for(config.prompts, "eval")


def held_out_images(config: Config, pipeline, device: torch.device | str) -> HeldOut:
    ec = config.eval
    items = [item for item in eval_pool(config) for _ in range(ec.samples_per_prompt)]
    steps, guidance = eval_steps_and_guidance(config)
    return HeldOut(
        prompts=[p for p, _ in items],
        metadata=[m for _, m in items],
        sigmas=pipeline.schedule.sigmas(steps).to(device),
        guidance_scale=guidance,
        seed=ec.seed,
    )
