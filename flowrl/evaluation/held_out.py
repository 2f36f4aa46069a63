"""The held-out evaluation setting of an image / video run: which items, on which time grid, with which
guidance and seed. One definition, used by training-time evaluation and by ``flowrl eval`` (plain,
best-of-N, noise search, SVDD), so every number flowrl prints about a model is measured the same way.

Every held-out sample draws its noise from its own stream keyed by its prompt's content and its index among
that prompt's samples (``seeding.RowGenerators.by_content``): evaluating a subset, a superset or a reordering
of the prompts gives the same samples for the prompts they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..config import Config, eval_steps_and_guidance
from ..prompts import prompts_for
from ..seeding import RowGenerators


@dataclass
class HeldOut:
    """The held-out items (each prompt ``eval.samples_per_prompt`` times, prompt-major, ``sample_index`` the
    position of each among its prompt's samples), the time grid, the guidance scale and the evaluation seed."""

    prompts: list[str]
    metadata: list[dict[str, Any]]
    sample_index: list[int]
    sigmas: Tensor
    guidance_scale: float
    seed: int

    def generator(self) -> RowGenerators:
        """Fresh per-item streams keyed by content: every evaluation, on every process, draws the same noise for
        the same item. Draw the initial noise and the steps' noise from one such object, in that order."""
        return RowGenerators.by_content(self.seed, self.prompts, self.metadata, self.sample_index)

    def __len__(self) -> int:
        return len(self.prompts)


def eval_pool(config: Config) -> list[tuple[str, dict[str, Any]]]:
    return prompts_for(config.prompts, "eval")


def held_out_images(config: Config, pipeline, device: torch.device | str) -> HeldOut:
    ec = config.eval
    items = [(*item, j) for item in eval_pool(config) for j in range(ec.samples_per_prompt)]
    steps, guidance = eval_steps_and_guidance(config)
    return HeldOut(
        prompts=[p for p, _, _ in items],
        metadata=[m for _, m, _ in items],
        sample_index=[j for _, _, j in items],
        sigmas=pipeline.schedule.sigmas(steps).to(device),
        guidance_scale=guidance,
        seed=ec.seed,
    )
