"""Objectives: pure loss math (functional.py) composed into trainable objectives."""

from __future__ import annotations

from ..types import Objective
from .ddpo import build_ddpo
from .grpo import build_grpo

__all__ = ["build_objective"]


def build_objective(config) -> Objective:
    kwargs = config.model_dump(exclude={"name"})
    return {"grpo": build_grpo, "ddpo": build_ddpo}[config.name](**kwargs)
