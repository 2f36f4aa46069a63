"""What is refused before a run starts, each in one sentence and before anything is written: a batch the processes
cannot share, a user's reward that cannot score the model's samples (tried before any model loads), and a reward that
needs metadata some prompt lacks (it would score NaN in every iteration)."""

from __future__ import annotations

from typing import Any

from ..errors import FlowRLError
from ..prompts import prompts_for
from ..reward_models.mix import probe_user_rewards, required_metadata, user_parts


def check_divisibility(config, world: int) -> None:
    if config.train.prompts_per_iteration % world:
        raise FlowRLError(
            f"train.prompts_per_iteration ({config.train.prompts_per_iteration}) must be divisible by the number of processes ({world})."
        )


def probe_rewards(config, rewards: list[Any]) -> None:
    """A user's reward (an import path, an entry point, an object passed in) scores two samples shaped like the
    model's, with the first training prompts, before the model loads (reward_models/mix.py)."""
    if not any(user_parts(r) for r in rewards):
        return
    pool = (prompts_for(config.prompts, "train")[:2] * 2)[:2]
    probe_user_rewards(rewards, config.pipeline.probe_samples(len(pool)), [p for p, _ in pool], [m for _, m in pool])


def check_reward_can_score(config, reward: Any, collector: Any) -> None:
    """Refuse a reward that cannot score the configured prompts: a reward declares the metadata it needs
    (``required_metadata``, e.g. the digit classifier's "digit"), and a prompt without it would score NaN in every
    iteration. Components weighted 0 are only watched, so they are not checked. The items: the collector's (training
    prompts, pairs, winners) and the held-out ones."""
    from ..evaluation.held_out import eval_pool
    from ..modalities.collector import RewardPool

    needs = sorted(required_metadata(reward))
    if not needs:
        return
    pc = config.prompts
    held_out = RewardPool("held-out prompt", eval_pool(config), pc.eval_file if pc.dataset in ("file", "hf") else None)
    for pool in [*collector.reward_pools(), held_out]:
        for i, (prompt, metadata) in enumerate(pool.items):
            for reward_name, key in needs:
                if metadata.get(key) is None:
                    where = f" of '{pool.file}'" if pool.file else ""
                    raise FlowRLError(
                        f"reward '{reward_name}' needs '{key}' in every prompt's metadata, but {pool.what} {i + 1}{where} "
                        f"({prompt[:60]!r}) has none, so it would score NaN and never train; give the prompts a "
                        f"'{key}' (a .jsonl prompt file) or choose another reward."
                    )
