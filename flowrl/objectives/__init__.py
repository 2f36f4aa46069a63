"""Objectives: pure loss math (functional.py) composed into trainable objectives."""

from __future__ import annotations

from ..errors import FlowRLError
from ..types import Objective
from .adjoint_matching import build_adjoint_matching
from .d3po import build_d3po
from .ddpo import build_ddpo
from .diffusion_dpo import DiffusionDPOObjective
from .diffusion_nft import build_diffusion_nft
from .grpo import build_grpo
from .seppo import build_seppo

__all__ = ["build_objective"]


def build_objective(config, reward_weights: dict[str, float] | None = None) -> Objective:
    """Build the objective a config section names. ``reward_weights`` (component -> weight) is used by
    GRPO's per-reward advantage option and D3PO's Pareto preferences."""
    kwargs = config.model_dump(exclude={"name"})
    if config.name == "grpo":
        return build_grpo(reward_weights=reward_weights, **kwargs)
    if config.name == "d3po":
        if config.preference == "pareto" and len(reward_weights or {}) < 2:
            raise FlowRLError("objective.preference=pareto compares reward components: reward.components needs at least two.")
        return build_d3po(**kwargs)
    if config.name == "diffusion_dpo":
        return DiffusionDPOObjective(**kwargs)
    if config.name == "seppo":
        return build_seppo(**kwargs)
    if config.name == "adjoint_matching":
        kwargs.pop("allow_non_memoryless")  # checked with the sampler when the config is validated
        return build_adjoint_matching(**kwargs)
    if config.name == "diffusion_nft":
        return build_diffusion_nft(**kwargs)
    return build_ddpo(**kwargs)
