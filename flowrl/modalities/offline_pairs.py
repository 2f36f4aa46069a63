"""Offline preference pairs (``trains_on: offline_pairs``): Diffusion-DPO's (winner, loser) samples, and D3PO's with
their recorded denoising trajectories, read from a pairs directory (``prompts.pairs``, built by
``python -m flowrl.preferences.pairs``), in their stored order or by a person's labels (``objective.preference:
human``). Nothing is sampled; the reward only logs what the pairs score."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

from .. import seeding
from ..errors import FlowRLError
from ..preferences.labels import labelled_pairs
from ..preferences.pairs import PreferencePairs, read_pairs
from ..types import Reward, RewardOutput, Trajectory
from .collector import Chunk, RewardPool, refuse_overlap
from .reward_overlap import RolloutScoring


class OfflinePairs:
    rows_per_prompt = 2  # (winner, loser)
    learns_from_rewards = False  # labelled already

    def __init__(self, modality):
        self.modality = modality
        self.config, self.pipeline, self.objective = modality.config, modality.pipeline, modality.objective
        self.pairs = self._read()

    def check(self, reward: Reward) -> None:
        refuse_overlap(self.config, f"objective '{self.objective.name}' trains on offline pairs, which are not rolled out in chunks")

    def reward_pools(self) -> list[RewardPool]:
        return [RewardPool("pair", list(zip(self.pairs.prompts, self.pairs.metadata)), self.config.prompts.pairs)]

    def _read(self) -> PreferencePairs:
        """The objective's pairs, checked against the model's sample shape."""
        if self.config.prompts.pairs is None:
            raise FlowRLError(
                f"objective '{self.objective.name}' trains on offline preference pairs: set prompts.pairs to a pairs "
                "directory (python -m flowrl.preferences.pairs)."
            )
        directory = self.config.prompts.pairs
        # objective.preference (D3PO, Diffusion-DPO): "human" trains on a person's labels.jsonl of the pairs
        if getattr(self.config.objective, "preference", None) == "human":
            labelled = labelled_pairs(directory)
            pairs, c = labelled.pairs, labelled.counts
            print(
                f"flowrl: training on {c['preferences']} human preferences of the {c['total']} pairs in '{directory}' "
                f"({c['ties']} ties, {c['skips']} skips and {c['total'] - c['labelled']} unlabelled pairs left out).",
                file=sys.stderr,
                flush=True,
            )
        else:
            pairs = read_pairs(directory)
        shape = tuple(self.pipeline.initial_noise(1, torch.Generator()).shape[1:])
        if tuple(pairs.winners.shape[1:]) != shape:
            raise FlowRLError(f"the pairs in '{directory}' have shape {tuple(pairs.winners.shape[1:])}, the model's samples {shape}.")
        if self.objective.needs_log_probs:  # D3PO re-scores every step of the stored trajectories
            self._check_trajectories(pairs, directory)
        return pairs

    def _check_trajectories(self, pairs: PreferencePairs, directory: str) -> None:
        if pairs.trajectories is None:
            raise FlowRLError(
                f"objective '{self.objective.name}' trains on the denoising trajectories of the pairs, and '{directory}' has "
                "none; build the pairs with python -m flowrl.preferences.pairs CONFIG --trajectories."
            )
        rc = self.config.rollout
        grid = self.pipeline.schedule.sigmas(rc.num_inference_steps).cpu().float()
        if pairs.trajectories.sigmas.shape != grid.shape or not torch.allclose(pairs.trajectories.sigmas, grid, atol=1e-6):
            raise FlowRLError(
                f"the trajectories in '{directory}' were sampled on {pairs.trajectories.sigmas.shape[0] - 1} steps of another "
                f"time grid than this config's (rollout.num_inference_steps = {rc.num_inference_steps}); use the config they were built with."
            )

    @torch.no_grad()
    def collect(self, iteration: int, rank: int, world: int) -> Iterator[Chunk]:
        yield Chunk(self._batch(iteration, rank, world))  # read (or sampled) whole and decoded: nothing to hand over

    def assemble(self, batches: list[Trajectory]) -> Trajectory:
        return batches[0]

    def _batch(self, iteration: int, rank: int, world: int) -> Trajectory:
        """This process's pairs for ``iteration`` (drawn with replacement, keyed by the seed) as a trajectory of clean
        samples, rows (2i, 2i + 1) = (winner, loser) of pair i; D3PO's with every recorded state."""
        per_process = self.config.train.prompts_per_iteration // world
        rng = seeding.python_rng(self.config.seed, iteration, 0, "pairs")  # drawn for the whole world, as rollouts are
        idx = seeding.global_draw(lambda n: [rng.randrange(len(self.pairs)) for _ in range(n)], per_process, rank, world)
        prompts = [self.pairs.prompts[i] for i in idx for _ in range(2)]
        metadata = [dict(self.pairs.metadata[i]) for i in idx for _ in range(2)]
        group_ids = torch.arange(per_process).repeat_interleave(2) + rank * per_process
        if self.objective.needs_log_probs:  # every recorded state (D3PO on human labels), as the rollout recorded it
            traj = self.pairs.trajectories
            states = torch.stack([t for i in idx for t in (traj.winners[i], traj.losers[i])]).to(self.modality.device)
            x0, k = states[:, -1], states.shape[1] - 1
            sigmas, log_probs, stochastic, guidance = (
                traj.sigmas.to(self.modality.device),
                torch.full((len(prompts), k), float("nan")),
                traj.stochastic.clone(),
                traj.guidance_scale,
            )
        else:
            x0 = torch.stack([t for i in idx for t in (self.pairs.winners[i], self.pairs.losers[i])]).to(self.modality.device)
            states, sigmas, log_probs = x0[:, None], torch.zeros(1), x0.new_zeros(len(prompts), 0)
            stochastic, guidance = torch.zeros(0, dtype=torch.bool), 1.0
        return Trajectory(
            latents=states,
            sigmas=sigmas,
            log_probs=log_probs,
            stochastic=stochastic,
            cond=self.pipeline.encode(prompts),
            prompts=prompts,
            metadata=metadata,
            group_ids=group_ids,
            samples=self.pipeline.decode(x0),
            guidance_scale=guidance,
        )

    def score(self, batch: Trajectory, reward: Reward, scoring: RolloutScoring | None = None) -> tuple[RewardOutput, None]:
        with torch.no_grad():
            return reward(batch.samples, batch.prompts, batch.metadata), None
