"""Rule-based ("verifiable") rewards from a plain Python function, one sample at a time.

``VerifiableReward(fn, name)`` wraps a user function, so it is built in code rather than by name; it
has no registry entry. A rule that fails on a strange sample must not end a long run, so an exception
inside ``fn`` scores that sample NaN ("not applicable": the trainer drops it) and is counted in the
extra ``errors`` instead of propagating.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowrl.types import RewardOutput

logger = logging.getLogger(__name__)

RuleFn = Callable[[Tensor, str, Mapping[str, Any]], "float | None"]


class VerifiableReward:
    """score_i = float(fn(samples[i], prompts[i], metadata[i])); None -> NaN; an exception -> NaN + errors_i = 1.

    ``fn`` gets one detached sample (e.g. (C, H, W)), its prompt and its metadata dict. A return value
    that cannot be converted to a float counts as an error too. Extras: ``errors`` (B,) 0/1, so its sum
    is the number of failures in the batch. The messages of the last call are kept in ``last_errors``
    and the first one of each call is logged as a warning. Not differentiable.
    """

    differentiable = False

    def __init__(self, fn: RuleFn, name: str) -> None:
        if not callable(fn):
            raise TypeError(f"VerifiableReward needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self.last_errors: list[str] = []

    def __call__(self, samples: Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        detached = samples.detach()
        scores, errors, messages = [], [], []
        for i in range(detached.shape[0]):
            try:
                value = self.fn(detached[i], prompts[i], metadata[i])
                score = math.nan if value is None else float(value)
                failed = 0.0
            except Exception as e:  # a bad sample must never crash a run
                score, failed = math.nan, 1.0
                messages.append(f"sample {i}: {type(e).__name__}: {e}")
            scores.append(score)
            errors.append(failed)
        self.last_errors = messages
        if messages:
            logger.warning("reward %s: %d of %d samples raised; first: %s", self.name, len(messages), len(scores), messages[0])
        device = samples.device
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32, device=device),
            extras={"errors": torch.tensor(errors, dtype=torch.float32, device=device)},
        )
