"""Prompt sources: where (prompt, metadata) pairs for training and evaluation come from."""

from __future__ import annotations

import random
from typing import Any

Prompt = tuple[str, dict[str, Any]]


def prompt_pool(dataset: str, split: str, size: int = 2000, file: str | None = None) -> list[Prompt]:
    """The (prompt, metadata) pairs of a dataset split, in a fixed order (``size`` of them for the
    generated arith task and the shared evaluation files; ``file`` for dataset "file")."""
    from .errors import FlowRLError

    if dataset == "file":
        from .prompt_files import read_prompt_file

        return read_prompt_file(file)

    if dataset == "arith":
        from .data.arith import problems

        try:
            return problems(split, size if split == "eval" else 4000, seed=0)
        except KeyError:
            raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'arith' (use train or eval).") from None
    if dataset in ("gsm8k", "math500", "countdown", "sudoku"):  # the shared evaluation files (FLOWRL_DATA_DIR)
        from .evaluation import text_data

        return getattr(text_data, f"load_{dataset}")(limit=size)

    if dataset == "digits":
        from .data.digits import prompt_set

        try:
            return prompt_set(split)
        except KeyError:
            raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'digits' (use train or eval).") from None
    if dataset == "digits_video":  # the embedded text-to-video model: "the digit three moving left"
        from .data.digits_video import prompt_set as video_prompt_set

        try:
            return video_prompt_set(split)
        except KeyError:
            raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'digits_video' (use train or eval).") from None
    if dataset == "toy2d":  # the unconditional 2-D toy: one empty prompt
        return [("", {})]
    raise FlowRLError(f"unknown prompt dataset '{dataset}'.")


def sample_prompts(pool: list[Prompt], n: int, rng: random.Random) -> list[Prompt]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]
