"""A weighted sum of rewards, the usual way to trade prompt alignment against an aesthetic term."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from pydantic import Field
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.sections import Section
from flowrl.types import Reward, RewardOutput


def _device_of(samples: Any) -> torch.device:
    """Images and videos are tensors; text completions are a list of strings (scored on the CPU)."""
    return samples.device if isinstance(samples, Tensor) else torch.device("cpu")


class WeightedSum:
    """Score = sum of ``weights[name] * component(samples)``; every component is logged under its name.

    A component with weight 0 is evaluated and logged but left out of the sum, so it can be watched
    without being optimised. A NaN from any weighted component makes that sample's total NaN
    ("not applicable"), so the trainer drops the sample rather than scoring it on a partial sum.
    """

    name = "weighted"

    def __init__(self, components: Mapping[str, Reward], weights: Mapping[str, float]) -> None:
        if not components:
            raise FlowRLError("a weighted reward needs at least one component.")
        if set(components) != set(weights):
            raise FlowRLError(
                f"reward weights name {sorted(weights)} but the components are {sorted(components)}; give one weight per component."
            )
        self.components = dict(components)
        self.weights = {k: float(v) for k, v in weights.items()}
        self.differentiable = all(c.differentiable for c in self.components.values())

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        device = _device_of(samples)
        total = torch.zeros(len(samples), dtype=torch.float32, device=device)
        extras: dict[str, Tensor] = {}
        for key, reward in self.components.items():
            out = reward(samples, prompts, metadata)
            scores = out.scores.to(device=device, dtype=torch.float32)
            if self.weights[key] != 0.0:
                total = total + self.weights[key] * scores
            # Logged copies must not keep the autograd graph of a differentiable component alive.
            extras[key] = scores.detach()
            extras.update({f"{key}/{k}": v.detach() for k, v in out.extras.items()})
        return RewardOutput(scores=total, extras=extras)


class RewardEnsemble:
    """Combine an ensemble of reward models scoring the same thing (Coste et al. 2023, arXiv:2310.02743).

    mode "mean": mean over members. "wco" (worst-case optimisation): min over members.
    "uwo" (uncertainty-weighted optimisation): mean - coefficient * disagreement, where disagreement is
    the intra-ensemble variance (the paper's UWO; ``uncertainty="variance"``) or its standard deviation
    (``uncertainty="std"``). Both use the population (biased) statistic over members.
    Extras: ``member<i>`` scores, ``mean``, ``std``. A NaN from any member makes the sample NaN.
    """

    def __init__(self, members: Sequence[Reward], mode: str, coefficient: float, uncertainty: str, name: str = "ensemble") -> None:
        if len(members) < 2:
            raise FlowRLError(f"reward ensemble '{name}' needs at least two members, got {len(members)}.")
        if mode not in ("mean", "wco", "uwo"):
            raise FlowRLError(f"reward ensemble mode must be mean, wco or uwo, got '{mode}'.")
        if uncertainty not in ("variance", "std"):
            raise FlowRLError(f"reward ensemble uncertainty must be variance or std, got '{uncertainty}'.")
        self.members, self.mode, self.coefficient, self.uncertainty, self.name = list(members), mode, coefficient, uncertainty, name
        self.differentiable = all(m.differentiable for m in self.members)

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        device = _device_of(samples)
        scores = torch.stack([m(samples, prompts, metadata).scores.float().to(device) for m in self.members])  # (M, B)
        mean = scores.mean(0)
        var = scores.var(0, unbiased=False)
        if self.mode == "wco":
            total = scores.min(0).values
        elif self.mode == "uwo":
            total = mean - self.coefficient * (var if self.uncertainty == "variance" else var.sqrt())
        else:
            total = mean
        total = torch.where(torch.isnan(scores).any(0), torch.full_like(total, float("nan")), total)
        extras = {f"member{i}": s.detach() for i, s in enumerate(scores)}
        extras.update(mean=mean.detach(), std=var.sqrt().detach())
        return RewardOutput(scores=total, extras=extras)


class EnsembleMember(Section):
    name: str = Field(description="The member reward: a registered name, an entry point or an import path.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="The member's constructor arguments.")


class EnsembleConfig(Section):
    """``reward.ensembles.<new name>``: several reward models of the same quantity combined conservatively (WCO / UWO)."""

    members: list[EnsembleMember] = Field(min_length=2, description="The reward models of the same quantity (two or more).")
    mode: Literal["mean", "wco", "uwo"] = Field(
        "wco", description="mean: their mean; wco: worst case, their minimum; uwo: mean - coefficient * uncertainty."
    )
    coefficient: float = Field(1.0, ge=0, description="UWO's lambda: the weight of the members' disagreement.")
    uncertainty: Literal["variance", "std"] = Field("variance", description="UWO's measure of disagreement: the members' variance or std.")
