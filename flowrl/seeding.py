"""Deterministic random streams derived from (seed, iteration, process, purpose).

Every random draw of a training iteration comes from a stream keyed by the iteration, so a run resumed
from a checkpoint replays exactly the draws an uninterrupted run would make: no RNG state to save.
"""

from __future__ import annotations

import random

import numpy as np
import torch

PURPOSES = {"prompts": 0, "rollout": 1, "update": 2, "eval": 3, "init": 4, "pairs": 5, "pair_prompts": 6}


def derive_seed(seed: int, *keys: int) -> int:
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1, dtype=np.uint64)[0] % (2**63 - 1))


def torch_generator(seed: int, iteration: int, rank: int, purpose: str, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(seed, iteration, rank, PURPOSES[purpose]))


def python_rng(seed: int, iteration: int, rank: int, purpose: str) -> random.Random:
    return random.Random(derive_seed(seed, iteration, rank, PURPOSES[purpose]))


def seed_initialisation(seed: int) -> None:
    """Seed the global torch RNG that fresh modules draw their initial weights from (LoRA adapters, DCoLT's
    unmasking-policy head), identically on every process, so a run's seed fixes its initial weights."""
    torch.manual_seed(derive_seed(seed, 0, 0, PURPOSES["init"]))
