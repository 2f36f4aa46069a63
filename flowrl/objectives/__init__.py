"""Objectives: pure loss math (functional.py) composed into trainable objectives.

``OBJECTIVES`` is the one table of ``objective.name`` values: each names the objective's config section, which
builds it (docs/architecture.md, "Adding an objective"; flowrl/registry.py for users' own).
"""

from __future__ import annotations

from ..registry import Registry
from ..sections import BuildContext, ObjectiveSection
from ..types import Objective

__all__ = ["OBJECTIVES", "BuildContext", "build_objective"]

OBJECTIVES = Registry(
    "objective",
    "objective.name",
    {
        "grpo": "flowrl.objectives.grpo:GRPOConfig",
        "ddpo": "flowrl.objectives.ddpo:DDPOConfig",
        "d3po": "flowrl.objectives.d3po:D3POConfig",
        "diffusion_dpo": "flowrl.objectives.diffusion_dpo:DiffusionDPOConfig",
        "seppo": "flowrl.objectives.seppo:SePPOConfig",
        "adjoint_matching": "flowrl.objectives.adjoint_matching:AdjointMatchingConfig",
        "diffusion_nft": "flowrl.objectives.diffusion_nft:DiffusionNFTConfig",
        "flow_dppo": "flowrl.objectives.flow_dppo:FlowDPPOConfig",
        "awm": "flowrl.objectives.awm:AWMConfig",
        "dgpo": "flowrl.objectives.dgpo:DGPOConfig",
        # diffusion language models (modality "text")
        "diffu_grpo": "flowrl.objectives.dllm.policy:DiffuGRPOConfig",
        "unigrpo": "flowrl.objectives.dllm.policy:UniGRPOConfig",
        "dcolt": "flowrl.objectives.dllm.policy:DCoLTConfig",
        "bgpo": "flowrl.objectives.dllm.policy:BGPOConfig",
        "step_grpo": "flowrl.objectives.dllm.step_grpo:StepGRPOConfig",  # uniform-noise block diffusion (DiffusionGemma)
    },
    base=ObjectiveSection,
)


def build_objective(section: ObjectiveSection, context: BuildContext | None = None) -> Objective:
    """The objective ``section`` describes; ``context`` carries what it may need of the run (reward weights, the
    sampler section, the built model)."""
    return section.build(context)
