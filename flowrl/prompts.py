"""Prompt sources: where (prompt, metadata) pairs for training and evaluation come from."""

from __future__ import annotations

import random
from typing import Any

Prompt = tuple[str, dict[str, Any]]


def prompt_pool(dataset: str, split: str) -> list[Prompt]:
    """Every (prompt, metadata) pair of a dataset split, in a fixed order."""
    from .errors import FlowRLError

    if dataset == "digits":
        from .pipelines.embedded.digits_data import prompt_set

        try:
            return prompt_set(split)
        except KeyError:
            raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'digits' (use train or eval).") from None
    raise FlowRLError(f"unknown prompt dataset '{dataset}'.")


def sample_prompts(pool: list[Prompt], n: int, rng: random.Random) -> list[Prompt]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]
