"""Samplers: stateless transition kernels with exact log-probs, plus the rollout loop.

``SAMPLERS`` is the one table of ``sampler.name`` values: each names its config section, which builds the
sampler for a model (flowrl/registry.py says how users add their own).
"""

from __future__ import annotations

from ..errors import FlowRLError
from ..registry import Registry
from ..sections import SamplerSection
from ..types import Pipeline, Sampler
from .ddim import DDIMConfig, DDIMSampler
from .flow_sde import FlowCPSConfig, FlowCPSSampler, FlowMemorylessConfig, FlowMemorylessSampler, FlowSDEConfig, FlowSDESampler
from .masked import MaskedSamplerConfig
from .ode import ODEConfig, ODESampler
from .schedules import DiscreteSchedule, FlowSchedule

__all__ = [
    "SAMPLERS",
    "DDIMConfig",
    "DDIMSampler",
    "FlowCPSConfig",
    "FlowCPSSampler",
    "FlowMemorylessConfig",
    "FlowMemorylessSampler",
    "FlowSDEConfig",
    "FlowSDESampler",
    "MaskedSamplerConfig",
    "ODEConfig",
    "ODESampler",
    "DiscreteSchedule",
    "FlowSchedule",
    "build_sampler",
]

SAMPLERS = Registry(
    "sampler",
    "sampler.name",
    {
        "flow_sde": "flowrl.samplers.flow_sde:FlowSDEConfig",
        "flow_cps": "flowrl.samplers.flow_sde:FlowCPSConfig",
        "flow_memoryless": "flowrl.samplers.flow_sde:FlowMemorylessConfig",
        "flash_sde": "flowrl.samplers.flash_sde:FlashSDEConfig",  # Flash-GRPO
        "ddim": "flowrl.samplers.ddim:DDIMConfig",
        "ode": "flowrl.samplers.ode:ODEConfig",
        "masked": "flowrl.samplers.masked:MaskedSamplerConfig",
        "entropy_bound": "flowrl.samplers.entropy_bound:EntropyBoundSamplerConfig",  # DiffusionGemma
        "masked_image": "flowrl.samplers.masked_image:MaskedImageConfig",
    },
    base=SamplerSection,
)


def build_sampler(section: SamplerSection, pipeline: Pipeline) -> Sampler:
    """The sampler ``section`` describes, for ``pipeline``; refused in one sentence when it cannot step that
    model's output (a DDIM sampler on a rectified flow, a flow SDE on an epsilon model)."""
    prediction = pipeline.prediction_type
    kinds = type(section).prediction_types
    if kinds and prediction not in kinds:
        names = {"flow": "rectified-flow (velocity)", "masked_tokens": "masked-token (amused)"}
        family = names.get(prediction, f"diffusion ({prediction})")
        fitting = [n for n in SAMPLERS.builtin_names() if n != "ode" and prediction in SAMPLERS.section(n).prediction_types]
        if prediction in ODEConfig.prediction_types:  # image tokens have no ODE
            fitting.append("ode")
        raise FlowRLError(f"sampler '{section.name}' does not fit this {family} model; use {' or '.join(fitting)}.")
    return section.build(pipeline)
