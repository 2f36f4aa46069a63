"""Classifier-free guidance, written once for every adapter.

Modes (``rollout.guidance_mode``; docs/guidance.md has the gradients each one gives):

* ``cfg``: ``u + s (c - u)`` in rollout and training, both branches in one batched forward, gradient
  through both (DDPO, Flow-GRPO with ``train.cfg``).
* ``cfg_detached_uncond``: the same value, but the unconditional branch runs without gradient, so the
  policy gradient is ``s * dc`` and the unconditional activations are not kept (less memory).
* ``cfg_rollout_only``: guided rollouts; training re-scores with the conditional branch alone (the
  trainer passes ``guidance_scale=1`` when re-scoring). Cheapest, but off-policy: the first ratio is
  not 1 and the clipping absorbs the mismatch.
* ``embedded``: guidance-distilled models (FLUX.1-dev) take the scale as an input; one forward pass,
  the adapter puts the scale into the condition. This function is then not called with ``scale != 1``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

import torch
from torch import Tensor

from ..types import Condition, GuidanceMode, cat_conditions

GUIDANCE_MODES: tuple[str, ...] = get_args(GuidanceMode)

Forward = Callable[[Tensor, Condition], Tensor]


def rows_sigma(sigma: Tensor, rows: int) -> Tensor:
    """``sigma`` for a batch of ``rows``: a noise level per sample is repeated when CFG runs both branches as one
    doubled batch (a single level broadcasts as it is)."""
    if sigma.ndim == 0 or sigma.shape[0] in (1, rows):
        return sigma
    return sigma.repeat(rows // sigma.shape[0], *([1] * (sigma.ndim - 1)))


def guided_prediction(forward: Forward, x: Tensor, cond: Condition, uncond: Condition, scale: float, mode: str = "cfg") -> Tensor:
    """Return ``forward(x, cond)`` guided by ``uncond`` at ``scale`` (float32).

    forward: the model on a batch (x, condition) -> output, batch on dim 0 of everything.
    uncond:  the unconditional condition with the same batch size as ``cond``.
    """
    if mode not in GUIDANCE_MODES:
        raise ValueError(f"unknown guidance mode {mode!r}")
    if scale == 1.0 or mode == "embedded":
        return forward(x, cond).float()
    if mode == "cfg_detached_uncond":
        with torch.no_grad():
            uncond_out = forward(x, uncond).float()
        cond_out = forward(x, cond).float()
    else:
        out = forward(torch.cat([x, x]), cat_conditions([cond, uncond])).float()
        cond_out, uncond_out = out.chunk(2)
    return uncond_out + scale * (cond_out - uncond_out)


def training_guidance_scale(mode: str, rollout_scale: float) -> float:
    """The scale training re-scores with: the rollout's, except in ``cfg_rollout_only``."""
    return 1.0 if mode == "cfg_rollout_only" else rollout_scale
