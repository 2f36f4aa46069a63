"""SePPO's training data (``trains_on: reference_rollouts``): a winner from a dataset beside a clean sample of a
reference model the objective picks among its previous checkpoints (flowrl/objectives/seppo.py). The winner is the
preferred row by construction, so the reward only logs what both score."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..objectives.seppo import reference_pair_batch, winners_for
from ..types import Reward, RewardOutput, Trajectory
from .collector import Chunk, RewardPool, refuse_overlap
from .reward_overlap import RolloutScoring


class ReferenceRollouts:
    rows_per_prompt = 2  # (winner, reference sample)
    learns_from_rewards = False

    def __init__(self, modality):
        self.modality = modality
        self.config, self.pipeline, self.sampler, self.objective = modality.config, modality.pipeline, modality.sampler, modality.objective
        self.winners = winners_for(self.objective, self.pipeline)

    def check(self, reward: Reward) -> None:
        refuse_overlap(self.config, f"objective '{self.objective.name}' trains on reference rollouts, which are not rolled out in chunks")

    def reward_pools(self) -> list[RewardPool]:
        source = self.config.objective.winners  # their prompts are scored (and logged) like the reference samples'
        items = list(zip(self.winners.prompts, self.winners.metadata))
        return [RewardPool("winner", items, None if source == "embedded" else source)]

    def collect(self, iteration: int, rank: int, world: int) -> Iterator[Chunk]:
        yield Chunk(self._batch(iteration, rank, world))  # read (or sampled) whole and decoded: nothing to hand over

    def assemble(self, batches: list[Trajectory]) -> Trajectory:
        return batches[0]

    def _batch(self, iteration: int, rank: int, world: int) -> Trajectory:
        rc = self.config.rollout
        return reference_pair_batch(
            self.objective,
            self.pipeline,
            self.sampler,
            self.winners,
            seed=self.config.seed,
            iteration=iteration,
            rank=rank,
            world=world,
            pairs=self.config.train.prompts_per_iteration // world,
            num_inference_steps=rc.num_inference_steps,
            guidance_scale=rc.guidance_scale,
            chunk=rc.batch_size,
        )

    def score(self, batch: Trajectory, reward: Reward, scoring: RolloutScoring | None = None) -> tuple[RewardOutput, None]:
        with torch.no_grad():
            return reward(batch.samples, batch.prompts, batch.metadata), None
