"""Reward gradients with respect to a sampler's final state, for objectives that train on them (Adjoint Matching).

``require_differentiable(reward)`` refuses, before any work, a reward with a non-differentiable part, naming
that part. ``reward_and_gradient(reward, decode, x_final, prompts, metadata)`` scores the decoded samples and
returns d(sum of the scores)/d x_final through ``decode`` (for latent models the VAE decoder), per sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import FlowRLError
from flowrl.types import Reward, RewardOutput

from .combine import RewardEnsemble, WeightedSum
from .per_frame import PerFrameReward

DIFFERENTIABLE_EXAMPLES = "ink, digit_classifier, aesthetic, clip_score, pickscore, hpsv2, image_reward, linear2d, quadratic2d"


def reward_leaves(reward: Any, name: str) -> Iterator[tuple[str, Any]]:
    """(name, reward) for every scoring model inside the combiners, in the order the config lists them.
    A weighted sum's parts are named by their component key (what the config calls them)."""
    if isinstance(reward, WeightedSum):
        for key, part in reward.components.items():
            yield from reward_leaves(part, key)
    elif isinstance(reward, RewardEnsemble):
        for member in reward.members:
            yield from reward_leaves(member, getattr(member, "name", type(member).__name__))
    elif isinstance(reward, PerFrameReward):
        yield from reward_leaves(reward.inner, name)
    else:
        yield name, reward


def require_differentiable(reward: Reward, objective: str = "adjoint_matching") -> None:
    """Raise FlowRLError naming the first part of ``reward`` that does not declare ``differentiable``."""
    for name, leaf in reward_leaves(reward, getattr(reward, "name", type(reward).__name__)):
        if not getattr(leaf, "differentiable", False):
            # a model reward that can be differentiable but was configured not to be
            built_off = (
                " (it was built with differentiable=False)" if getattr(leaf, "name", None) in DIFFERENTIABLE_EXAMPLES.split(", ") else ""
            )
            raise FlowRLError(
                f"reward '{name}' is not differentiable{built_off}; {objective} needs a reward gradient, so use "
                f"differentiable rewards only (e.g. {DIFFERENTIABLE_EXAMPLES})."
            )


def _one_chunk(
    reward: Reward, decode: Callable[[Tensor], Tensor], x: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> tuple[RewardOutput, Tensor]:
    x = x.detach().clone().float().requires_grad_(True)
    out = reward(decode(x), prompts, metadata)
    scores = out.scores.float()
    finite = torch.isfinite(scores)
    if not scores.requires_grad:
        raise FlowRLError(
            f"the reward's scores carry no gradient back to the final state: the pipeline's decode or the reward "
            f"'{getattr(reward, 'name', type(reward).__name__)}' runs without autograd or detaches its output."
        )
    # Dropped samples contribute nothing: select before summing so their NaN never enters the sum.
    total = torch.where(finite, scores, torch.zeros_like(scores)).sum()
    (grads,) = torch.autograd.grad(total, x, allow_unused=True)
    grads = torch.zeros_like(x) if grads is None else grads
    extras = {k: v.detach() for k, v in out.extras.items()}
    return RewardOutput(scores=scores.detach(), extras=extras), grads.detach()


def reward_and_gradient(
    reward: Reward,
    decode: Callable[[Tensor], Tensor],
    x_final: Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    chunk_size: int | None = None,
) -> tuple[RewardOutput, Tensor]:
    """Score ``decode(x_final)`` and return (the RewardOutput with detached tensors, grads (B, *S)), where
    grads[i] = d score_i / d x_final[i] through ``decode``.

    Rewards score samples independently, so the gradient of the sum of the scores is the per-sample
    gradient. A sample whose reward is not finite gets a zero gradient; one whose reward is finite but whose
    gradient is not (a reward model overflowing) is treated the same way and its score set to NaN, so the
    loop drops it like any other non-finite reward. ``chunk_size`` bounds how many samples are decoded and
    scored with a graph at once (None: all). Runs with gradients whatever the caller's grad or inference mode.
    """
    size = chunk_size or len(x_final)
    outs, grads = [], []
    with torch.inference_mode(False), torch.enable_grad():
        for start in range(0, len(x_final), size):
            sl = slice(start, start + size)
            out, g = _one_chunk(reward, decode, x_final[sl], prompts[sl], metadata[sl])
            outs.append(out)
            grads.append(g)
    scores = torch.cat([o.scores for o in outs])
    grad = torch.cat(grads)
    bad_grad = ~torch.isfinite(grad.flatten(1)).all(1)
    scores = torch.where(bad_grad.to(scores.device), torch.full_like(scores, float("nan")), scores)
    drop = ~torch.isfinite(scores).to(grad.device)
    grad = torch.where(drop.view(-1, *[1] * (grad.ndim - 1)), torch.zeros_like(grad), grad)
    extras = {k: torch.cat([o.extras[k] for o in outs]) for k in outs[0].extras}
    return RewardOutput(scores=scores, extras=extras), grad
