"""The re-score: the rollout's per-step log-probs computed again through the update path, at unchanged weights.

Training's importance ratio r = exp(log p_new - log p_old) must start at 1: the update re-scores each recorded step
with the same weights that sampled it. Anything else (a different sampler noise, guidance, time grid, dtype, a
batch-size-dependent kernel, dropout left on) makes the first ratio differ from 1 and biases every update.

Nothing here re-implements the update. ``loop.iteration(0)`` runs as training runs it, with two things swapped for
the iteration (``rescoring``): the engine, whose ``step`` consumes the objective's losses without a backward or an
optimizer step (so every minibatch, every inner epoch, is scored at the rollout's weights), and the sampler the
update hands the objective, a pass-through that keeps each step's new log-prob beside the old one it is compared
with. Diffusion LMs' objectives compute their ratio over tokens or steps inside ``losses``; their own metrics
(``policy/ratio_mean``, ``policy/approx_kl``) are read, and DiffusionGemma's recorded sampling-time log-probs are
compared with the update's replay of them step by step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# float32 resolves a log-prob of magnitude L to ~L * 1.2e-7 and a re-score in another batch size moves it by a few
# ULPs (tests/tiny_components.py measured up to 2.3e-5 on a summed log-prob of ~80): an absolute and a relative part.
# bf16 / fp16 carry 8 / 11 mantissa bits, so their model outputs, and the log-probs through them, move ~1e3 times more.
TOLERANCE = {"float32": (1e-4, 1e-6), "reduced": (1e-2, 1e-3)}

NOT_APPLICABLE = {  # Objective.trains_on -> why an objective without per-step log-probs has no ratio to re-score
    "rollouts": "regresses on the rollouts' clean samples (no per-step log-probs: it takes deterministic ODE rollouts too)",
    "offline_pairs": "trains on offline preference pairs, never on the model's own rollouts",
    "reward_gradient_rollouts": "trains on the reward's gradient through the rollout (a matching loss, no likelihood ratio)",
    "reference_rollouts": "regresses on reference rollouts and dataset winners (a denoising loss, no likelihood ratio)",
}


@dataclass
class StepScore:
    """One denoising step (or, for diffusion LMs, one counted quantity) of the re-score: log r = new - old per row."""

    step: str
    rows: int
    mean: float  # of log r
    std: float
    max_abs: float  # max |log r|
    tolerance: float  # the largest |log r| allowed at this step (absolute + relative to |log p|)

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.tolerance


@dataclass
class Rescore:
    """The re-score of one prompt group: per-step log-ratio statistics, or why it does not apply."""

    applies: bool
    precision: str  # "float32" or "reduced" (bf16 / fp16 anywhere in the model or the update)
    steps: list[StepScore] = field(default_factory=list)
    note: str = ""  # what was compared (or why nothing was)
    intended: str | None = None  # an off-policy re-score by design (cfg_rollout_only): reported, not a failure

    @property
    def failures(self) -> list[str]:
        if not self.applies or self.intended is not None:
            return []
        if not self.steps:  # an objective with log-probs whose update compared none: nothing shows the ratio is 1
            return ["the update re-scored none of the rollout's recorded steps, so its ratio cannot be checked"]
        bad = [s for s in self.steps if not s.passed]
        return [
            f"re-scoring step {s.step} at unchanged weights gives max |log ratio| {s.max_abs:.3g}, above the "
            f"{self.precision} tolerance {s.tolerance:.3g} (ratio {math.exp(s.mean):.6f} on average)"
            for s in bad
        ]


def precision_of(config) -> str:
    """``reduced`` when the model or the update runs in bf16 / fp16, where the re-score is only as exact as they are."""
    dtype = getattr(config.pipeline, "dtype", "float32")
    return "reduced" if config.train.mixed_precision != "no" or dtype not in ("float32", "fp32", None) else "float32"


def score(step: str, new: torch.Tensor, old: torch.Tensor, precision: str) -> StepScore:
    """The statistics of log r = new - old over the rows where both are finite."""
    new, old = new.detach().double().cpu().flatten(), old.detach().double().cpu().flatten()
    ok = torch.isfinite(new) & torch.isfinite(old)
    diff, scale = (new - old)[ok], old[ok].abs()
    absolute, relative = TOLERANCE[precision]
    if diff.numel() == 0:
        return StepScore(step, 0, float("nan"), float("nan"), float("nan"), absolute)
    return StepScore(
        step,
        int(diff.numel()),
        float(diff.mean()),
        float(diff.std(unbiased=False)),
        float(diff.abs().max()),
        float(absolute + relative * scale.max()),
    )


class StepLogProbs:
    """The sampler the update hands the objective during the re-score: every call goes to the real sampler; a call
    that re-scores a recorded step of the current minibatch (``x_next`` given, the minibatch's rows, a scalar sigma
    on its grid) has its new log-prob kept beside the minibatch's recorded one. The first such call per step is the
    policy's (a KL term's reference or an old-policy call comes after it)."""

    def __init__(self, sampler: Any):
        self._sampler = sampler
        self.minibatch: Any = None
        self.pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._seen: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)

    def bind(self, minibatch: Any) -> None:
        self.minibatch, self._seen = minibatch, set()

    def step(self, model_output, x, sigma, sigma_next, x_next=None, generator=None):
        out = self._sampler.step(model_output, x, sigma, sigma_next, x_next=x_next, generator=generator)
        found = self._recorded_step(x, sigma, sigma_next, x_next, out)
        if found is not None and found[0] not in self._seen:
            k, rows = found
            self._seen.add(k)
            self.pairs.setdefault(k, []).append((out.log_prob.detach(), self.minibatch.log_probs[rows, k].detach()))
        return out

    def _recorded_step(self, x, sigma, sigma_next, x_next, out) -> tuple[int, torch.Tensor] | None:
        """(step, the minibatch rows the call's rows re-score) of a call that re-scores recorded transitions, or None.
        The rows are found by their recorded next state, since an objective may re-score some rows only, in its own
        order (TreeGRPO: one row per tree edge)."""
        mb = self.minibatch
        if mb is None or x_next is None or out.log_prob is None or x.shape[0] > len(mb):
            return None
        if torch.as_tensor(sigma).numel() != 1 or torch.as_tensor(sigma_next).numel() != 1:
            return None  # a per-sample time (a denoising-loss objective), not a recorded step
        grid = mb.sigmas.detach().cpu().double()
        s, s_next = float(sigma), float(sigma_next)
        for k in range(grid.shape[0] - 1):
            if float(grid[k]) == s and float(grid[k + 1]) == s_next and bool(mb.stochastic[k]):
                rows = _rows_of(x_next, mb.latents[:, k + 1])
                return None if rows is None else (k, rows)
        return None


def _rows_of(states: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor | None:
    """For each row of ``states``, the index of a row of ``recorded`` equal to it bit for bit; None if one has none."""
    if states.shape[1:] != recorded.shape[1:]:
        return None
    if states.shape[0] == recorded.shape[0] and torch.equal(states, recorded.to(states.device)):
        return torch.arange(states.shape[0])
    equal = (states.flatten(1)[:, None, :] == recorded.to(states.device).flatten(1)[None]).all(-1)
    return equal.float().argmax(1).cpu() if bool(equal.any(1).all()) else None


class ScoringEngine:
    """``engine.step`` without a backward or an optimizer step: the update's losses are computed (each minibatch, each
    inner epoch) and their metrics recorded, at the weights that rolled out."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.metrics: list[dict[str, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self, roles, losses, record) -> dict[str, torch.Tensor]:
        for loss_out in losses:
            record(loss_out)
            self.metrics.append({k: float(v) for k, v in loss_out.metrics.items() if torch.as_tensor(v).numel() == 1})
        return {}


@contextlib.contextmanager
def rescoring(trainer) -> Iterator[tuple[ScoringEngine, StepLogProbs | None]]:
    """For the iteration inside: the scoring engine, and for an image objective with per-step log-probs the
    pass-through sampler, bound to each minibatch as the objective receives it."""
    loop, modality, objective = trainer.loop, trainer.modality, trainer.objective
    from ..modalities.images import ImageModality

    engine = ScoringEngine(loop.engine)
    images = isinstance(modality, ImageModality)  # a diffusion LM's objectives compute their ratio inside losses
    sampler = StepLogProbs(modality.sampler) if images and objective.needs_log_probs else None
    original_losses, original_sampler = objective.losses, modality.sampler

    def losses(pipeline, step_sampler, batch, generator):
        if sampler is not None:
            sampler.bind(batch)
        yield from original_losses(pipeline, step_sampler, batch, generator)

    loop.engine = engine
    _set(objective, "losses", losses)
    if sampler is not None:
        modality.sampler = sampler
    try:
        yield engine, sampler
    finally:
        loop.engine = trainer.engine
        _unset(objective, "losses")
        modality.sampler = original_sampler


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass objective too


def _unset(obj: Any, name: str) -> None:
    if name in vars(obj):
        object.__delattr__(obj, name)


def image_steps(sampler: StepLogProbs, precision: str) -> list[StepScore]:
    """Per recorded step: the statistics of log r over every row the update re-scored at it."""
    return [
        score(str(k), torch.cat([n.flatten().cpu() for n, _ in pairs]), torch.cat([o.flatten().cpu() for _, o in pairs]), precision)
        for k, pairs in sorted(sampler.pairs.items())
    ]


def text_steps(batch: Any, engine: ScoringEngine, precision: str) -> list[StepScore]:
    """A diffusion LM's re-score: DiffusionGemma's sampling-time log-probs against the update's replay of each step
    (``old_log_probs``, computed at collect by the function the update calls), then the ratio the objective's own
    ``losses`` reported over every minibatch (its mean, and DDPO's approx_kl = 0.5 mean (log r)^2 where logged)."""
    rows = []
    recorded, replayed = getattr(batch, "step_log_probs", None), getattr(batch, "old_log_probs", None)
    if recorded is not None and replayed is not None and recorded.shape == replayed.shape:
        counted = batch.counted
        for s in range(recorded.shape[1]):
            if counted[:, s].any():
                rows.append(score(f"{s} (sampled vs replayed)", replayed[counted[:, s], s], recorded[counted[:, s], s], precision))
    absolute, _ = TOLERANCE[precision]
    for i, m in enumerate(engine.metrics):
        if "policy/ratio_mean" in m:
            log_mean = math.log(m["policy/ratio_mean"]) if m["policy/ratio_mean"] > 0 else float("-inf")
            rms = math.sqrt(2 * m["policy/approx_kl"]) if "policy/approx_kl" in m else abs(log_mean)
            rows.append(StepScore(f"loss {i + 1} (ratio over its minibatch)", len(batch), log_mean, float("nan"), rms, absolute))
    return rows
