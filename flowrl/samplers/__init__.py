"""Samplers: stateless transition kernels with exact log-probs, plus the rollout loop."""

from __future__ import annotations

from ..errors import FlowRLError
from ..types import Pipeline, Sampler
from .ddim import DDIMSampler
from .flow_sde import FlowCPSSampler, FlowMemorylessSampler, FlowSDESampler
from .ode import ODESampler
from .schedules import DiscreteSchedule, FlowSchedule

__all__ = ["DDIMSampler", "FlowCPSSampler", "FlowMemorylessSampler", "FlowSDESampler", "ODESampler", "DiscreteSchedule", "FlowSchedule", "build_sampler"]


def _family_ode(pipeline: Pipeline) -> Sampler:
    if pipeline.prediction_type == "flow":
        return FlowSDESampler(noise_level=0.0)
    return DDIMSampler(schedule=pipeline.schedule, prediction_type=pipeline.prediction_type, eta=0.0)


def build_sampler(config, pipeline: Pipeline) -> Sampler:
    """Build the sampler a config section names, checked against the pipeline's prediction type."""
    kwargs = config.model_dump(exclude={"name"})
    if config.name == "ode":
        return ODESampler(_family_ode(pipeline))
    if config.name == "ddim":
        sampler = DDIMSampler(schedule=getattr(pipeline, "schedule", None), prediction_type=pipeline.prediction_type, **kwargs) if pipeline.prediction_type != "flow" else None
    elif config.name == "flow_sde":
        sampler = FlowSDESampler(**kwargs)
    elif config.name == "flow_memoryless":
        sampler = FlowMemorylessSampler(**kwargs)
    else:
        sampler = FlowCPSSampler(**kwargs)
    if sampler is None or pipeline.prediction_type not in sampler.prediction_types:
        family = "rectified-flow (velocity)" if pipeline.prediction_type == "flow" else f"diffusion ({pipeline.prediction_type})"
        raise FlowRLError(f"sampler '{config.name}' does not fit this {family} model; use "
                          f"{'flow_sde, flow_cps, flow_memoryless' if pipeline.prediction_type == 'flow' else 'ddim'} or ode.")
    return sampler
