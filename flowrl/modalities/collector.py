"""What the loop collects for an objective, and how it is scored: a ``Collector`` per kind of training data.

An objective declares what it trains on (``Objective.trains_on``: on-policy rollouts, rollouts with the reward's
gradient, offline preference pairs, SePPO's winners beside a reference model's samples); a modality keeps one table
from those kinds to its collectors and hands the loop the collector of the objective's kind (``collector_for``, the
one place that looks the kind up). The loop then only calls ``collect`` and ``score``, and reads two facts the
collector states: how many rows a prompt has in a batch, and whether the rewards are what the objective learns from.

``collect`` yields the batch in chunks as they are finished (a rollout chunk of ``rollout.batch_size`` samples, a
diffusion LM's generations, a whole batch of pairs); the loop hands each chunk that still has to be decoded to the
scorer (modalities/reward_overlap.py: decoded at once, or decoded and scored on a worker thread while the next chunk
is generated) and the collector ``assemble``s the batch from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import FlowRLError
from ..types import Reward, RewardOutput
from .reward_overlap import RolloutScoring


@dataclass
class RewardPool:
    """Items the reward will score, checked before anything runs: ``what`` they are in a sentence ("training prompt"),
    the (prompt, metadata) pairs, and the file they came from (None: built in)."""

    what: str
    items: list[tuple[str, dict]]
    file: str | None = None


@dataclass
class Chunk:
    """A finished part of a batch. ``decode``: makes its samples from its final states (None: nothing to decode, e.g.
    pairs read from disk already decoded); ``attach``: puts the decoded samples into ``batch``."""

    batch: Any
    decode: Callable[[], Any] | None = None
    attach: Callable[[Any], None] | None = None


class Collector(Protocol):
    rows_per_prompt: int  # rows of one prompt in a batch: the group size, or 2 for (winner, loser) pairs
    learns_from_rewards: bool  # False: the rows are labelled already (pairs, SePPO's winners) and the reward is only logged

    def check(self, reward: Reward) -> None:
        """Refuse, in one sentence, a setting this kind of data cannot be collected or scored with."""
        ...

    def reward_pools(self) -> list[RewardPool]:
        """The items besides the held-out ones whose metadata the reward reads."""
        ...

    def collect(self, iteration: int, rank: int, world: int) -> Iterator[Chunk]:
        """This process's batch for ``iteration``, chunk by chunk, keyed by (seed, iteration, global row) so that a
        resumed run and any number of processes collect exactly what one uninterrupted process does."""
        ...

    def assemble(self, batches: list[Any]) -> Any:
        """The batch the chunks make, in the order they came."""
        ...

    def score(self, batch: Any, reward: Reward, scoring: RolloutScoring | None = None) -> tuple[RewardOutput, torch.Tensor | None]:
        """The reward of the batch's samples, and the reward's gradient where the objective trains on it."""
        ...


def collector_for(table: dict[str, Callable[[], Collector]], objective: Any, modality: str) -> Collector:
    """The collector of the objective's training data, from a modality's ``table`` (kind -> constructor)."""
    make = table.get(objective.trains_on)
    if make is None:
        raise FlowRLError(
            f"objective '{objective.name}' trains on {objective.trains_on.replace('_', ' ')}, which {modality} models do not "
            f"collect; they collect {', '.join(k.replace('_', ' ') for k in table)}."
        )
    return make()


def refuse_overlap(config, why: str) -> None:
    """rollout.overlap_reward scores rollout chunks on a worker thread: refused, saying why, where there are none."""
    if config.rollout.overlap_reward:
        raise FlowRLError(
            f"rollout.overlap_reward scores each rollout chunk on a worker thread while the next one is generated, but {why}; "
            "set rollout.overlap_reward=false."
        )
