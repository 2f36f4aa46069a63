"""Deterministic sampling for evaluation: the probability-flow ODE (Euler) for flows, DDIM eta = 0
for diffusion models. No log-probs; objectives that need them refuse this sampler at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..sections import SamplerSection
from ..types import Sampler, StepOutput


@dataclass
class ODESampler:
    base: Sampler  # the family sampler whose deterministic_step is the ODE step
    name = "ode"
    stochastic = False

    @property
    def prediction_types(self):
        return self.base.prediction_types

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None) -> StepOutput:
        mean = self.base.deterministic_step(model_output, x, sigma, sigma_next)
        return StepOutput(x_next=mean if x_next is None else x_next.float(), log_prob=None, mean=mean, std=mean.new_zeros(()))

    def deterministic_step(self, model_output, x, sigma, sigma_next):
        return self.base.deterministic_step(model_output, x, sigma, sigma_next)


class ODEConfig(SamplerSection):
    """The deterministic sampler of the model: the probability-flow ODE (Euler) for flows, DDIM eta = 0 for diffusion."""

    name: str = "ode"
    prediction_types: ClassVar[tuple[str, ...]] = ("flow", "epsilon", "v_prediction")

    def build(self, pipeline: Any) -> ODESampler:
        if pipeline.prediction_type == "flow":
            from .flow_sde import FlowSDEConfig

            return ODESampler(FlowSDEConfig(noise_level=0.0).build(pipeline))
        from .ddim import DDIMConfig

        return ODESampler(DDIMConfig(eta=0.0).build(pipeline))
