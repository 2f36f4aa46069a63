"""Rollouts laid out for step-level credit: Flash-GRPO's one SDE step per trajectory, TreeGRPO's shared-prefix
trees, and Stepwise-Flow-GRPO's x0 (Tweedie) estimates of every step.

An objective that needs its rollouts laid out its own way carries a ``rollout_layout`` (one of the classes at the
end of this file); the image collector (modalities/image_rollouts.py) then collects with ``layout.collect`` (where
``layout.collects``; stepwise GRPO keeps the run's own rollouts) and finishes the reward with ``layout.score``. The rollouts themselves are ``rollout.rollout`` (Flash-GRPO, stepwise) or
its loop with the model called once per tree node (TreeGRPO), so a re-scored step is the step that was sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..seeding import RowGenerators, derive_seed
from ..types import Pipeline, RewardOutput, Sampler, Trajectory, index_condition
from .rollout import rollout, rows_of

FLASH_STEP_TAG = 2**30 + 40  # the stream of Flash-GRPO's per-group step draw, apart from every seeding.PURPOSES stream


def candidate_steps(stochastic: Tensor, fraction: float) -> list[int]:
    """The steps a Flash-GRPO group's one SDE step is drawn from: the first ``max(1, int(fraction * n))`` of the n
    steps the rollout may make stochastic (``stochastic``, (K,) bool), in sampling order (the noise end first; the
    released code draws from the first 10 of its 20 steps: fraction 0.5)."""
    steps = torch.nonzero(stochastic).flatten().tolist()
    return steps[: max(1, int(fraction * len(steps)))]


def group_steps(seed: int, iteration: int, group_ids: Tensor, candidates: Sequence[int]) -> Tensor:
    """(B,) the SDE step of every row: one draw per global group id from ``candidates``, uniform, keyed by (seed,
    iteration, group id) alone, so the members of a group share it (iso-temporal grouping) on any number of processes."""
    draws = {}
    for g in torch.unique(group_ids).tolist():
        gen = torch.Generator().manual_seed(derive_seed(seed, iteration, FLASH_STEP_TAG, int(g)))
        draws[g] = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
    return torch.tensor([draws[int(g)] for g in group_ids.tolist()], dtype=torch.long)


def merge_rows(parts: list[tuple[Tensor, Trajectory]], num_rows: int) -> Trajectory:
    """Trajectories of disjoint row sets (``(rows, trajectory)``) put back in row order; a step is stochastic when it
    is in any part (the rows not sampled stochastically there keep NaN log-probs)."""
    order = torch.cat([rows for rows, _ in parts])
    merged = Trajectory.cat([t for _, t in parts])
    merged.stochastic = torch.stack([t.stochastic.cpu() for _, t in parts]).any(0).to(merged.stochastic.device)
    inverse = torch.empty(num_rows, dtype=torch.long)
    inverse[order] = torch.arange(num_rows)
    return merged[inverse]


@torch.no_grad()
def iso_temporal_rollout(
    pipeline: Pipeline,
    sampler: Sampler,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    group_ids: Tensor,
    sigmas: Tensor,
    generator: RowGenerators,
    initial_noise: Tensor,
    steps: Tensor,
    guidance_scale: float = 1.0,
    batch_size: int = 64,
) -> Trajectory:
    """Flash-GRPO's rollouts: row b takes the sampler's stochastic step at step ``steps[b]`` alone and the
    deterministic (ODE) step everywhere else. Rows that share a step are rolled out together, ``batch_size`` per
    denoiser call; the result is in row order, with NaN log-probs wherever a row was not stochastic."""
    num_steps = sigmas.shape[0] - 1
    parts = []
    for k in torch.unique(steps).tolist():
        window = torch.zeros(num_steps, dtype=torch.bool)
        window[k] = True
        rows = torch.nonzero(steps == k).flatten()
        for start in range(0, rows.numel(), batch_size):
            idx = rows[start : start + batch_size]
            chunk = rollout(
                pipeline,
                sampler,
                [prompts[i] for i in idx],
                [metadata[i] for i in idx],
                group_ids[idx],
                sigmas,
                rows_of(generator, idx),
                guidance_scale,
                window,
                initial_noise=initial_noise[idx],
            )
            parts.append((idx, chunk))
    return merge_rows(parts, len(prompts))


def leaf_index(group_ids: Tensor) -> Tensor:
    """(B,) each row's position among the rows of its group, in row order."""
    out = torch.empty_like(group_ids)
    for g in torch.unique(group_ids):
        members = torch.nonzero(group_ids == g).flatten()
        out[members] = torch.arange(members.numel(), device=group_ids.device)
    return out


def tree_node_ids(group_ids: Tensor, branch_factor: int, depth: int, level: int) -> Tensor:
    """(B,) the node each leaf row sits under after ``level`` of the tree's ``depth`` branchings: leaf j of a group
    of branch_factor^depth leaves is under node j // branch_factor^(depth - level) of its group; ids are global."""
    per_group = branch_factor**level
    _, group_pos = torch.unique(group_ids, return_inverse=True)
    return group_pos.cpu() * per_group + leaf_index(group_ids.cpu()) // branch_factor ** (depth - level)


@torch.no_grad()
def tree_rollout(
    pipeline: Pipeline,
    sampler: Sampler,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    group_ids: Tensor,
    sigmas: Tensor,
    generator: RowGenerators,
    initial_noise: Tensor,
    branch_steps: Sequence[int],
    branch_factor: int,
    guidance_scale: float = 1.0,
    batch_size: int = 64,
) -> Trajectory:
    """TreeGRPO's rollouts: every prompt group is one tree of branch_factor^len(branch_steps) leaves (its rows, in
    order) grown from one root, the group's first member's ``initial_noise``. At a branch step every node is
    predicted once and splits into ``branch_factor`` children by the sampler's stochastic step, each child on the
    noise stream of its first leaf; every other step is the deterministic (ODE) step of each node. The denoiser sees
    each node once per step (``batch_size`` nodes per call), so a tree costs sum_k nodes_k calls instead of
    leaves x K. Returns one row per leaf: the states of its path (shared, bit for bit, with every leaf of the same
    node), log-probs on the branch steps (a leaf's: its child edge's), NaN elsewhere."""
    num_steps, depth = sigmas.shape[0] - 1, len(branch_steps)
    branch = set(int(k) for k in branch_steps)
    leaves = len(prompts)
    cond_all = (
        pipeline.encode(list(prompts), list(metadata)) if getattr(pipeline, "needs_metadata", False) else pipeline.encode(list(prompts))
    )
    level = 0
    node = tree_node_ids(group_ids, branch_factor, depth, level)  # (B,) node of each leaf
    rep = _first_rows(node)  # (M,) a leaf row standing for each node
    x = initial_noise.float()[rep]  # (M, *S): the roots
    states, log_probs = [x[node]], []
    for k in range(num_steps):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        cond = index_condition(cond_all, rep.to(x.device))
        v = torch.cat(
            [
                pipeline.predict(x[s : s + batch_size], sigma, index_condition(cond, slice(s, s + batch_size)), guidance_scale)
                for s in range(0, len(rep), batch_size)
            ]
        )
        if k in branch:
            level += 1
            child = tree_node_ids(group_ids, branch_factor, depth, level)
            child_rep = _first_rows(child)  # a leaf row per child: its noise stream, and its parent
            parent_of_child = torch.searchsorted(torch.unique(node), node[child_rep])  # node ids are sorted and dense per level
            out = sampler.step(v[parent_of_child], x[parent_of_child], sigma, sigma_next, generator=generator[child_rep.tolist()])
            x, node, rep = out.x_next, child, child_rep
            log_probs.append(out.log_prob[_dense(node)])
        else:
            x = sampler.deterministic_step(v, x, sigma, sigma_next)
            log_probs.append(torch.full((leaves,), float("nan"), device=x.device))
        states.append(x[_dense(node)])
    stochastic = torch.tensor([k in branch for k in range(num_steps)], dtype=torch.bool)
    final = torch.stack(states, dim=1)
    return Trajectory(
        latents=final,
        sigmas=sigmas,
        log_probs=torch.stack(log_probs, dim=1),
        stochastic=stochastic.to(final.device),
        cond=cond_all,
        prompts=list(prompts),
        metadata=[dict(m) for m in metadata],
        group_ids=group_ids,
        samples=pipeline.decode(final[:, -1]),
        guidance_scale=guidance_scale,
    )


def _first_rows(ids: Tensor) -> Tensor:
    """The first row of every distinct id, in id order."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((unique.numel(),), len(ids), dtype=torch.long)
    return first.scatter_reduce(0, inverse, torch.arange(len(ids)), reduce="amin")


def _dense(ids: Tensor) -> Tensor:
    """ids mapped to 0 .. M-1 in id order (the index of each row's node in the node tensors)."""
    return torch.unique(ids, return_inverse=True)[1]


def velocities(sampler: Sampler, batch: Trajectory) -> Tensor:
    """(B, K, *S) the model output every step of ``batch`` was taken with, read back from the trajectory without a
    denoiser call: a flow sampler's step mean is affine in the model output v elementwise, mean(v) = m0 + c v, so a
    stochastic step's v = (mean - m0) / c from the rollout's recorded mean (``Trajectory.step_means``), with m0 and
    c from the sampler's own step at v = 0 and v = 1; a deterministic (Euler) step's v = (x_next - x) / dt."""
    out = []
    for k in range(batch.num_steps):
        x, x_next = batch.latents[:, k].float(), batch.latents[:, k + 1].float()
        sigma, sigma_next = batch.sigmas[k], batch.sigmas[k + 1]
        if bool(batch.stochastic[k]):
            m0 = sampler.step(torch.zeros_like(x), x, sigma, sigma_next, x_next=x_next).mean
            c = sampler.step(torch.ones_like(x), x, sigma, sigma_next, x_next=x_next).mean - m0
            out.append((batch.step_mean(k).to(x.device) - m0) / c)
        else:
            out.append((x_next - x) / (sigma_next - sigma).float())
    return torch.stack(out, dim=1)


def x0_estimates(sampler: Sampler, batch: Trajectory) -> Tensor:
    """(B, K, *S) the flow's x0 (Tweedie) estimate at every step's input state, x0_hat_k = x_k - sigma_k v_k, with
    v_k read back from the trajectory (``velocities``): no denoiser call."""
    v = velocities(sampler, batch)
    sig = batch.sigmas[:-1].float().to(v.device).reshape(1, -1, *([1] * (v.ndim - 2)))
    return batch.latents[:, :-1].float() - sig * v


# -- layouts: how the image collector collects and scores for these objectives --------------------------------
class _Layout:
    collects = True  # the layout lays out the rollouts itself (collect); False: the run's plain rollouts are kept

    def score(self, collector: Any, batch: Trajectory, reward: Any, out: RewardOutput) -> RewardOutput:
        return out


@dataclass
class FlashLayout(_Layout):
    """Flash-GRPO: one SDE step per trajectory, shared by the members of a prompt group (``group_steps``)."""

    step_fraction: float

    def collect(
        self, collector: Any, iteration: int, prompts, metadata, group_ids: Tensor, gen: RowGenerators, noise: Tensor
    ) -> Trajectory:
        cfg, pipeline = collector.config.rollout, collector.pipeline
        sigmas = pipeline.schedule.sigmas(cfg.num_inference_steps).to(collector.modality.device)
        candidates = candidate_steps(torch.ones(cfg.num_inference_steps, dtype=torch.bool), self.step_fraction)
        steps = group_steps(collector.config.seed, iteration, group_ids.cpu(), candidates)
        return iso_temporal_rollout(
            pipeline, collector.sampler, prompts, metadata, group_ids, sigmas, gen, noise, steps, cfg.guidance_scale, cfg.batch_size
        )


@dataclass
class TreeLayout(_Layout):
    """TreeGRPO: one tree per prompt group (``tree_rollout``)."""

    branch_steps: tuple[int, ...]
    branch_factor: int

    def collect(
        self, collector: Any, iteration: int, prompts, metadata, group_ids: Tensor, gen: RowGenerators, noise: Tensor
    ) -> Trajectory:
        cfg, pipeline = collector.config.rollout, collector.pipeline
        sigmas = pipeline.schedule.sigmas(cfg.num_inference_steps).to(collector.modality.device)
        return tree_rollout(
            pipeline,
            collector.sampler,
            prompts,
            metadata,
            group_ids,
            sigmas,
            gen,
            noise,
            self.branch_steps,
            self.branch_factor,
            cfg.guidance_scale,
            cfg.batch_size,
        )


X0_REWARD = "stepwise/x0_reward_{:02d}"  # the reward component holding the reward of step k's x0 estimate


@dataclass
class StepwiseLayout(_Layout):
    """Stepwise-Flow-GRPO: the run's plain rollouts (its SDE window), which keep their step means, and at scoring the reward
    of every step's x0 estimate beside the final one's (components ``stepwise/x0_reward_kk``)."""

    collects = False  # the run's own rollouts: they keep their step means, since the objective declares needs_step_means

    def score(self, collector: Any, batch: Trajectory, reward: Any, out: RewardOutput) -> RewardOutput:
        x0 = x0_estimates(collector.sampler, batch)
        extras = dict(out.extras)
        size = collector.config.rollout.batch_size
        for k in range(batch.num_steps):
            scores = [
                reward(
                    collector.pipeline.decode(x0[s : s + size, k]), batch.prompts[s : s + size], batch.metadata[s : s + size]
                ).scores.float()
                for s in range(0, len(batch), size)
            ]
            extras[X0_REWARD.format(k)] = torch.cat(scores)
        return RewardOutput(scores=out.scores, extras=extras)
