"""B2-DiffuRL's sampling (Hu et al., CVPR 2025, "Towards Better Alignment: Training Diffusion Models with
Reinforcement Learning Against Sparse Rewards"): backward progressive training and branch-based sampling.

Backward progressive training: only the last denoising steps (the data end) are trained at first, and the
trained window grows towards the noise end over training, so a sparse reward first has to be explained by
a few steps. Branch-based sampling: every prompt group shares one prefix, sampled from noise to the branch
step (the first trained step); its members are branches from that state. A reward difference inside a
group is then due to the window's steps alone, which is what the window's policy-gradient update credits.
The objective is unchanged (GRPO normalises within the branches of a prefix, DDPO per prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field
from torch import Tensor

from ..sections import Section
from ..seeding import RowGenerators
from ..types import Pipeline, Sampler, Trajectory
from .rollout import rollout, rows_of


def trained_steps(iteration: int, iterations: int, num_steps: int, start_steps: int, end_steps: int | None = None) -> int:
    """How many steps, counted from the data end, the window trains at 0-based ``iteration``.

    The window grows one step per stage from ``start_steps`` to ``end_steps`` (default ``num_steps``) in
    ``end - start + 1`` stages of equal length: n(i) = start + floor(i * (end - start + 1) / iterations),
    capped at end. A function of the iteration alone, so a resumed run continues the schedule exactly.
    """
    end = num_steps if end_steps is None else end_steps
    return min(end, start_steps + (iteration * (end - start_steps + 1)) // max(iterations, 1))


def trained_window(num_steps: int, trained: int) -> Tensor:
    """(K,) bool: the last ``trained`` steps, the ones sampled stochastically with log-probs."""
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[num_steps - trained :] = True
    return mask


@torch.no_grad()
def branched_rollout(
    pipeline: Pipeline,
    sampler: Sampler,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    group_ids: Tensor,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    branch_step: int,
    initial_noise: Tensor,
    guidance_scale: float = 1.0,
    batch_size: int = 64,
    record_means: bool = False,
) -> Trajectory:
    """B trajectories in which the members of a group share the states x_0 .. x_b exactly (b = ``branch_step``)
    and branch from x_b: one prefix per group, sampled with the stochastic sampler from the first member's
    ``initial_noise``, then every member continues on its own noise. Steps b .. K-1 carry log-probs;
    the prefix steps are recorded as not stochastic (NaN log-prob), so they are never trained.

    Rollouts run ``batch_size`` prefixes or branches per denoiser call. ``record_means``: the branches' stochastic
    steps keep their means (``Trajectory.step_means``; the prefix has none, being recorded as not stochastic).
    """
    num_steps = sigmas.shape[0] - 1
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    first = torch.stack([torch.nonzero(inverse == g).flatten()[0] for g in range(unique.numel())])  # each group's first member
    prefix = initial_noise[first].float()[:, None]  # (G, 1, *S): with branch_step 0 the shared prefix is the noise itself
    if branch_step > 0:
        chunks = []
        for start in range(0, unique.numel(), batch_size):
            idx = first[start : start + batch_size]
            chunks.append(
                rollout(
                    pipeline,
                    sampler,
                    [prompts[i] for i in idx],
                    [metadata[i] for i in idx],
                    unique[start : start + batch_size],
                    sigmas[: branch_step + 1],
                    rows_of(generator, idx),
                    guidance_scale,
                    initial_noise=prefix[start : start + batch_size, 0],
                    decode=False,
                ).latents
            )
        prefix = torch.cat(chunks)  # (G, b + 1, *S)
    prefix = prefix[inverse]  # the shared states, repeated for every branch
    window = torch.ones(num_steps - branch_step, dtype=torch.bool)
    chunks = []
    for start in range(0, len(prompts), batch_size):
        sl = slice(start, start + batch_size)
        chunks.append(
            rollout(
                pipeline,
                sampler,
                prompts[sl],
                metadata[sl],
                group_ids[sl],
                sigmas[branch_step:],
                rows_of(generator, sl),
                guidance_scale,
                window,
                initial_noise=prefix[sl, -1],
                record_means=record_means,
            )
        )
    branches = Trajectory.cat(chunks)
    nan = torch.full((len(prompts), branch_step), float("nan"), device=branches.log_probs.device)
    branches.latents = torch.cat([prefix[:, :-1].to(branches.latents), branches.latents], dim=1)
    branches.log_probs = torch.cat([nan, branches.log_probs], dim=1)
    branches.stochastic = torch.cat([torch.zeros(branch_step, dtype=torch.bool), branches.stochastic.cpu()]).to(branches.stochastic.device)
    branches.sigmas = sigmas
    return branches


class BranchingConfig(Section):
    """``rollout.branching``: B2-DiffuRL (Hu et al., CVPR 2025; docs/objectives/b2_diffurl.md): backward progressive
    training with branch-based sampling. Each prompt group shares one prefix sampled up to the branch step, and its
    train.num_generations members are branches from there; only the steps after the branch step (the trained
    window, always ending at the data end) are stochastic with log-probs. The window starts at the last
    ``start_steps`` steps and grows towards the noise end in equal stages to ``end_steps`` (default: all)."""

    start_steps: int = Field(2, ge=1, description="Trained steps, counted from the data end, at the first iteration.")
    end_steps: int | None = Field(None, ge=1, description="Trained steps in the last stage; None: rollout.num_inference_steps.")
