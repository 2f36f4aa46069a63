"""Objectives: pure loss math (functional.py) composed into trainable objectives."""

from __future__ import annotations

from ..types import Objective
from .ddpo import build_ddpo
from .grpo import build_grpo

__all__ = ["build_objective"]


def build_objective(config, reward_weights: dict[str, float] | None = None) -> Objective:
    """Build the objective a config section names. ``reward_weights`` (component -> weight) is used by
    GRPO's per-reward advantage option."""
    kwargs = config.model_dump(exclude={"name"})
    if config.name == "grpo":
        return build_grpo(reward_weights=reward_weights, **kwargs)
    return build_ddpo(**kwargs)
