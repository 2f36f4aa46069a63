"""Settings parity: each sampling path's settings against the rollout's and the evaluation's, every difference named.

Two rules. Against the rollout, a difference is a mismatch unless ``INTENDED`` names it with its reason and its
condition holds (the evaluation steps the rollout sampler's deterministic counterpart; ``eval.num_inference_steps`` /
``eval.guidance_scale`` / a diffusion LM's ``eval_temperature`` set it apart on purpose). Against the evaluation,
every way of sampling the trained model afterwards (``Trainer.sample``, ``flowrl sample``, the exported model card)
must agree exactly: the numbers a run reports are the evaluation's, so whoever samples or serves the model must get
the model that was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ROLLOUT, EVALUATION = "rollout", "evaluation"

# setting -> why a path may differ from the rollout there; ``allowed(setting, value, context)`` says when it does
INTENDED: dict[str, str] = {
    "sampler": "the evaluation samples the rollout sampler's deterministic counterpart (its noise-free step: the "
    "probability-flow ODE, DDIM eta = 0), so fixed seeds give comparable numbers",
    "steps": "eval.num_inference_steps sets the evaluation's steps apart from the rollout's (Flow-GRPO trains on fewer "
    "steps than it evaluates with)",
    "guidance scale": "eval.guidance_scale sets the evaluation's guidance apart from the rollout's",
    "temperature": "a diffusion LM evaluates at sampler.eval_temperature (greedy by default) and rolls out at sampler.temperature",
    "negative prompt": "CFG's unconditional branch is only called when the guidance scale is not 1",
}
# a diffusion LM's objective that rolls out with sampler settings of its own (objective.rollout_sampler)
OBJECTIVE_ROLLOUT = (
    "the objective rolls out with its own sampler settings (rollout_sampler; JustGRPO: left to right, one token per "
    "step) and the evaluation keeps the run's sampler"
)


@dataclass
class Difference:
    setting: str
    path: str
    value: Any
    against: str
    expected: Any
    intended: str | None  # the reason, when this difference is by design

    def sentence(self) -> str:
        return f"{self.path}'s {self.setting} is {_show(self.value)} but the {self.against}'s is {_show(self.expected)}" + (
            f" (intended: {self.intended})" if self.intended else ""
        )


@dataclass
class Context:
    """What the intended differences are conditioned on: the config's evaluation keys and the two samplers."""

    eval_steps: int | None
    eval_guidance: float | None
    eval_temperature: float | None
    same_deterministic_step: Callable[[str], bool]  # path -> its sampler steps as the rollout's does without noise
    objective_rollout: frozenset[str] = frozenset()  # the settings an objective's own rollout sampler changes


def intended(setting: str, path: str, value: Any, expected: Any, context: Context) -> str | None:
    """The reason ``path`` may show ``value`` for ``setting`` where the rollout shows ``expected``, or None."""
    if setting in context.objective_rollout:
        return OBJECTIVE_ROLLOUT
    allowed = {
        "sampler": lambda: context.same_deterministic_step(path),
        "steps": lambda: context.eval_steps is not None and value == context.eval_steps,
        "guidance scale": lambda: context.eval_guidance is not None and value == context.eval_guidance,
        "temperature": lambda: context.eval_temperature is not None and value == context.eval_temperature,
        # only one of the two guided: the guidance row names that difference; two different empty-prompt branches do not pass
        "negative prompt": lambda: str(value).startswith("none") or str(expected).startswith("none"),
    }
    check = allowed.get(setting)
    return INTENDED[setting] if check is not None and check() else None


def compare(rows: dict[str, dict[str, Any]], context: Context) -> list[Difference]:
    """Every path against the rollout (``INTENDED`` may excuse a difference) and every sampling path after training
    against the evaluation (nothing excuses one)."""
    found = []
    reference = rows.get(ROLLOUT, {})
    for path, row in rows.items():
        if path == ROLLOUT:
            continue
        for setting, value in row.items():
            if setting in reference and not _same(value, reference[setting]):
                reason = intended(setting, path, value, reference[setting], context)
                found.append(Difference(setting, path, value, ROLLOUT, reference[setting], reason))
    evaluated = rows.get(EVALUATION, {})
    for path, row in rows.items():
        if path in (ROLLOUT, EVALUATION):
            continue
        for setting, value in row.items():
            if setting in evaluated and not _same(value, evaluated[setting]):
                found.append(Difference(setting, path, value, EVALUATION, evaluated[setting], None))
    return found


def same_deterministic_step(eval_sampler: Any, rollout_sampler: Any, sigmas: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether the evaluation sampler's step is exactly the rollout sampler's noise-free step on this grid: both
    applied to one random state and model output at every step of it."""
    if eval_sampler is rollout_sampler:
        return True
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn((1, *shape), generator=gen), torch.randn((1, *shape), generator=gen)
    for k in range(len(sigmas) - 1):
        a = eval_sampler.deterministic_step(out, x, sigmas[k], sigmas[k + 1])
        b = rollout_sampler.deterministic_step(out, x, sigmas[k], sigmas[k + 1])
        if not torch.equal(torch.as_tensor(a), torch.as_tensor(b)):
            return False
    return True


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
