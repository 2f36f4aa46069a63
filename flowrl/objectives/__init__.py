"""Objectives: pure loss math (functional.py) composed into trainable objectives.

``OBJECTIVES`` is the one table of ``objective.name`` values: each names the objective's config section, which
builds it (docs/architecture.md, "Adding an objective"; flowrl/registry.py for users' own).
"""

from __future__ import annotations

from typing import Any

from ..registry import Registry
from ..sections import BuildContext, ObjectiveSection
from ..types import FrozenRole, Objective, TrainedRole

__all__ = ["OBJECTIVES", "BuildContext", "build_objective", "own_modules"]

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
        "flash_grpo": "flowrl.objectives.flash_grpo:FlashGRPOConfig",  # one SDE step per trajectory, iso-temporal groups
        "tree_grpo": "flowrl.objectives.tree_grpo:TreeGRPOConfig",  # shared-prefix trees, per-edge advantages
        "stepwise_grpo": "flowrl.objectives.stepwise_grpo:StepwiseGRPOConfig",  # dense credit: gains of the x0 estimate's reward
        "dmd2": "flowrl.objectives.dmd2:DMD2Config",  # few-step distillation: student + fake score
        "dmdr": "flowrl.objectives.dmdr:DMDRConfig",  # RL on a few-step student, DMD as the regulariser
        "diffusion_opd": "flowrl.objectives.diffusion_opd:DiffusionOPDConfig",  # on-policy distillation from task teachers
        # diffusion language models (modality "text")
        "diffu_grpo": "flowrl.objectives.dllm.policy:DiffuGRPOConfig",
        "unigrpo": "flowrl.objectives.dllm.policy:UniGRPOConfig",
        "dcolt": "flowrl.objectives.dllm.policy:DCoLTConfig",
        "bgpo": "flowrl.objectives.dllm.policy:BGPOConfig",
        "step_grpo": "flowrl.objectives.dllm.step_grpo:StepGRPOConfig",  # uniform-noise block diffusion (DiffusionGemma)
        "just_grpo": "flowrl.objectives.dllm.just_grpo:JustGRPOConfig",  # left-to-right rollouts, exact likelihood
        "block_elbo": "flowrl.objectives.dllm.block_elbo:BlockELBOConfig",  # block diffusion: LLaDA2.1's EBPO
        "tracerl": "flowrl.objectives.dllm.tracerl:TraceRLConfig",  # the sampler's own trajectory, token log-probs replayed
    },
    base=ObjectiveSection,
)


def build_objective(section: ObjectiveSection, context: BuildContext | None = None) -> Objective:
    """The objective ``section`` describes; ``context`` carries what it may need of the run (reward weights, the
    sampler section, the built model)."""
    return section.build(context)


def own_modules(objective: Objective) -> list[tuple[str, Any]]:
    """(checkpoint prefix, module) of every module an objective trains beside the policy (``Objective.roles``'s trained
    roles with a module of their own, e.g. DCoLT's unmasking-policy head): what a checkpoint of its run holds besides
    the model's weights, and what an evaluation of that checkpoint loads."""
    return [(r.prefix, getattr(objective, r.attribute)) for r in objective.roles if isinstance(r, TrainedRole) and r.adapter is None]


def frozen_roles(objective: Objective) -> list[FrozenRole]:
    """The frozen models an objective reads: its declared ones, and the initial model when ``reference`` is
    ``"initial"`` (the role ``"reference"``)."""
    declared = [r for r in objective.roles if isinstance(r, FrozenRole)]
    return ([FrozenRole("reference", "initial")] if objective.reference == "initial" else []) + declared
