"""On-policy rollouts of an image or video model: what GRPO, DDPO, D3PO, DiffusionNFT, AWM, DGPO, Flow-DPPO train on
(``trains_on: rollouts``), and with the reward's gradient through the decoder what Adjoint Matching trains on
(``reward_gradient_rollouts``). B2-DiffuRL's branched rollouts (``rollout.branching``) are collected here too."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .. import seeding
from ..errors import FlowRLError
from ..prompts import sample_prompts
from ..reward_models.gradients import require_differentiable, reward_and_gradient
from ..samplers.branching import branched_rollout, trained_steps
from ..samplers.rollout import keyed_noise, rollout, sde_window
from ..types import Reward, RewardOutput, Trajectory
from .collector import Chunk, RewardPool, refuse_overlap
from .reward_overlap import RolloutScoring


def _attach(chunk: Trajectory, samples) -> None:
    chunk.samples = samples  # the decoded samples in place of the final states rollout() left undecoded


class ImageRollouts:
    """``with_gradient``: score also returns d reward / d final latents (Adjoint Matching)."""

    learns_from_rewards = True

    def __init__(self, modality, with_gradient: bool = False):
        self.modality, self.with_gradient = modality, with_gradient
        self.config, self.pipeline, self.sampler, self.objective = modality.config, modality.pipeline, modality.sampler, modality.objective
        self.rows_per_prompt = self.config.train.num_generations

    @property
    def records_means(self) -> bool:
        """Whether the rollouts keep their stochastic steps' means: an objective that needs them declares
        ``needs_step_means`` (GRPO-Guard's exact ratio normalisation); the others are spared the memory."""
        return bool(getattr(self.objective, "needs_step_means", False))

    def check(self, reward: Reward) -> None:
        rc = self.config.rollout
        if self.with_gradient:  # refused before anything runs or is written
            require_differentiable(reward, self.objective.name)
        if not self.sampler.stochastic and rc.same_noise_in_group and self.rows_per_prompt > 1 and not self.with_gradient:
            raise FlowRLError(
                f"sampler '{self.sampler.name}' is deterministic and rollout.same_noise_in_group is true, so every sample of a "
                "prompt group would be the same and no group has anything to compare; set rollout.same_noise_in_group=false."
            )
        if self.with_gradient:
            refuse_overlap(
                self.config,
                f"objective '{self.objective.name}' trains on the reward's gradient through the decoder, a graph built on the "
                "loop's own thread after the rollout",
            )
        elif rc.branching is not None:
            refuse_overlap(self.config, "rollout.branching rolls out a shared prefix and then its branches, not chunk after chunk")

    def reward_pools(self) -> list[RewardPool]:
        pc = self.config.prompts
        return [RewardPool("training prompt", self.modality.train_pool, pc.train_file if pc.dataset in ("file", "hf") else None)]

    @torch.no_grad()
    def collect(self, iteration: int, rank: int, world: int) -> Iterator[Chunk]:
        """On-policy rollouts of this process's prompt groups. Every draw is made for the whole world and keyed by global
        indices (seeding.global_draw, RowGenerators): an N-process run samples exactly the prompts and noise of a
        1-process run."""
        cfg, tc, seed = self.config.rollout, self.config.train, self.config.seed
        groups = tc.prompts_per_iteration // world
        chosen = seeding.global_draw(
            lambda n: sample_prompts(self.modality.train_pool, n, seeding.python_rng(seed, iteration, 0, "prompts")), groups, rank, world
        )
        prompts = [p for p, _ in chosen for _ in range(tc.num_generations)]
        metadata = [m for _, m in chosen for _ in range(tc.num_generations)]
        group_ids = torch.arange(groups).repeat_interleave(tc.num_generations) + rank * groups
        rows = seeding.global_rows(group_ids, tc.num_generations)
        gen = seeding.RowGenerators.keyed(seed, iteration, "rollout", rows)
        noise = keyed_noise(
            self.pipeline, seeding.RowGenerators.keyed(seed, iteration, "initial_noise", group_ids if cfg.same_noise_in_group else rows)
        )
        self.pipeline.denoiser.eval()  # rollouts sample the policy deterministically in its layers (dropout off), as the peers do; update() sets train()
        if cfg.branching is not None:  # B2-DiffuRL: one shared prefix per group, branches over the trained window (samplers/branching.py)
            yield Chunk(self._branched(iteration, prompts, metadata, group_ids, gen, noise))  # decoded: one graph of branches
            return
        layout = getattr(self.objective, "rollout_layout", None)  # Flash-GRPO, TreeGRPO, stepwise GRPO (samplers/step_credit.py)
        if layout is not None and layout.collects:
            yield Chunk(layout.collect(self, iteration, prompts, metadata, group_ids, gen, noise))  # decoded
            return
        window = sde_window(cfg.num_inference_steps, cfg.sde_window_size, cfg.sde_window_start, cfg.sde_window_slide_every, iteration)
        sigmas = self.pipeline.schedule.sigmas(cfg.num_inference_steps).to(self.modality.device)
        for start in range(0, len(prompts), cfg.batch_size):
            sl = slice(start, start + cfg.batch_size)
            chunk = rollout(
                self.pipeline,
                self.sampler,
                prompts[sl],
                metadata[sl],
                group_ids[sl],
                sigmas,
                gen[sl],
                cfg.guidance_scale,
                window,
                initial_noise=noise[sl],
                decode=False,  # the scorer decodes it (timed; on the reward's worker when overlapped)
                record_means=self.records_means,
            )
            yield Chunk(chunk, decode=functools.partial(self.pipeline.decode, chunk.samples), attach=functools.partial(_attach, chunk))

    def assemble(self, batches: list[Trajectory]) -> Trajectory:
        return Trajectory.cat(batches)

    def _branched(self, iteration: int, prompts, metadata, group_ids, gen, noise) -> Trajectory:
        cfg, b = self.config.rollout, self.config.rollout.branching
        trained = trained_steps(iteration, self.config.train.iterations, cfg.num_inference_steps, b.start_steps, b.end_steps)
        sigmas = self.pipeline.schedule.sigmas(cfg.num_inference_steps).to(self.modality.device)
        traj = branched_rollout(
            self.pipeline,
            self.sampler,
            prompts,
            metadata,
            group_ids,
            sigmas,
            gen,
            cfg.num_inference_steps - trained,
            noise,
            cfg.guidance_scale,
            cfg.batch_size,
            record_means=self.records_means,
        )
        if not traj.stochastic.any():  # e.g. DDIM's step into clean data has no noise, so a 1-step window has nothing to train
            raise FlowRLError(
                f"the trained window of iteration {iteration + 1} (the last {trained} of {cfg.num_inference_steps} steps) has no stochastic "
                f"step on sampler '{self.sampler.name}'; raise rollout.branching.start_steps."
            )
        return traj

    def score(self, batch: Trajectory, reward: Reward, scoring: RolloutScoring | None = None) -> tuple[RewardOutput, torch.Tensor | None]:
        """The reward of the decoded samples; with the gradient also d reward / d final latents, through the decoder (the
        VAE of latent models), ``rollout.batch_size`` samples per graph. With an overlapped ``scoring`` the chunks were
        decoded and scored on its worker during collect: joined here, in order."""
        if scoring is not None and scoring.scored_on_worker:
            samples, out = scoring.join()
            batch.samples = torch.cat(samples)
            return out, None
        if self.with_gradient:
            return reward_and_gradient(
                reward, self.pipeline.decode, batch.latents[:, -1], batch.prompts, batch.metadata, chunk_size=self.config.rollout.batch_size
            )
        with torch.no_grad():
            out = reward(batch.samples, batch.prompts, batch.metadata)
            layout = getattr(self.objective, "rollout_layout", None)  # stepwise GRPO adds the rewards of the x0 estimates
            return (out if layout is None else layout.score(self, batch, reward, out)), None
