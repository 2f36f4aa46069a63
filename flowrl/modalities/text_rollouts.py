"""On-policy completions of a diffusion language model (``trains_on: rollouts``, every dLLM objective): generated
with the rollout sampler, recorded with the rollout policy's log-likelihood estimates, scored by text rewards."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import seeding
from ..prompts import sample_prompts
from ..types import Reward, RewardOutput, TokenTrajectory
from .collector import Chunk, RewardPool
from .reward_overlap import RolloutScoring


def draw_mask_seeds(groups: int, group_size: int, num_seeds: int, shared: bool, gen: torch.Generator) -> torch.Tensor:
    """(groups * group_size, num_seeds) estimator mask seeds for a rollout whose rows come group by group.

    ``shared``: every completion of a prompt gets the same seeds, so the estimator masks the same positions
    in all of them (common random numbers). The group-relative advantages sum to zero within a group, so
    whatever the completions have in common (format tokens, the prompt) then cancels from the gradient
    instead of adding mask noise; d1 goes further and shares one seed across the whole batch. Each row's
    estimate is distributed exactly as with its own seed.
    """
    rows = groups if shared else groups * group_size
    seeds = torch.randint(0, 2**62, (rows, num_seeds), generator=gen)
    return seeds.repeat_interleave(group_size, 0) if shared else seeds


class TextRollouts:
    learns_from_rewards = True

    def __init__(self, modality):
        self.modality, self.config = modality, modality.config
        self.rows_per_prompt = self.config.train.num_generations

    def check(self, reward: Reward) -> None:
        """Text rollouts take any text reward, with or without rollout.overlap_reward."""

    def reward_pools(self) -> list[RewardPool]:
        pc = self.config.prompts
        return [RewardPool("training prompt", self.modality.train_pool, pc.train_file if pc.dataset in ("file", "hf") else None)]

    @torch.no_grad()
    def collect(self, iteration: int, rank: int, world: int) -> Iterator[Chunk]:
        """This process's completions, one chunk, recorded with the rollout policy's log-likelihood estimates. The
        chunk is handed over as soon as it is generated, so with rollout.overlap_reward the reward scores the decoded
        completions on its worker while those estimates are computed: the whole batch in one call, as the serial loop
        scores it."""
        tc, seed = self.config.train, self.config.seed
        groups, n = tc.prompts_per_iteration // world, tc.num_generations
        # Every draw is made for the whole world and keyed by global indices, as for images (seeding.RowGenerators):
        # an N-process run generates exactly the completions of a 1-process run, split in N.
        chosen = seeding.global_draw(
            lambda k: sample_prompts(self.modality.train_pool, k, seeding.python_rng(seed, iteration, 0, "prompts")), groups, rank, world
        )
        prompts = [p for p, _ in chosen for _ in range(n)]
        group_ids = torch.arange(groups).repeat_interleave(n) + rank * groups
        rows = seeding.global_rows(group_ids, n)
        self.modality.pipeline.model.eval()
        traj = self.modality.generate(
            prompts,
            self.config.sampler.temperature,
            seeding.RowGenerators.keyed(seed, iteration, "rollout", rows),
            self.modality.rollout_sampler,
        )
        traj.prompts, traj.metadata = prompts, [dict(m) for _, m in chosen for _ in range(n)]
        traj.group_ids = group_ids
        oc = self.config.objective
        traj.mask_seeds = draw_mask_seeds(
            groups * world, n, oc.num_mask_seeds, oc.group_shared_masks, seeding.torch_generator(seed, iteration, 0, "rollout")
        )[rows]
        yield Chunk(traj, decode=lambda: traj.completions)  # decoded by the sampler already: the hand-over only scores them
        # The rollout policy's log-likelihood estimates (and the reference's) are part of the record, computed
        # with the weights that generated it, before any update: the first ratio is exactly 1.
        self.modality.objective.old_and_ref(self.modality.pipeline, traj)

    def assemble(self, batches: list[TokenTrajectory]) -> TokenTrajectory:
        return batches[0]

    def score(self, batch: TokenTrajectory, reward: Reward, scoring: RolloutScoring | None = None) -> tuple[RewardOutput, None]:
        if scoring is not None and scoring.scored_on_worker:  # scored on the worker during collect
            return scoring.join()[1], None
        return reward(batch.completions, batch.prompts, batch.metadata), None
