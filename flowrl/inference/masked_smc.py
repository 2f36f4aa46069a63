"""Sequential Monte Carlo for masked-diffusion LMs: N particles per item toward p_sampler(x) exp(lambda s(x)) / Z.

The image SMC of :mod:`flowrl.inference.smc` (twisted / Feynman-Kac SMC: TDS, Wu et al. 2023; FK steering, Singhal et
al. 2025; see that module for what is paper-derived) on the masked sampler. A particle is a partially unmasked
completion; it moves with the sampler's own transition (the step of ``samplers/masked.py::generate``: tokens at the
temperature for every masked position, the positions to commit by the remasking rule), so the proposal is the base
sampler and the incremental weight is the ratio of successive potentials. The potential after step j is
exp(lambda_j s(x0_hat_j)), where s is a verifier-free score (``text_candidates``: the model's likelihood, or a reward
that never sees the gold answer) and x0_hat_j the particle's *one-shot completion*, every still-masked position filled
with its most likely token from one forward pass on the particle's state (as ``masked_svdd`` values a candidate).
Once every particle is complete its one-shot completion is the completion itself and lambda_j = lambda, so the final
weight telescopes to exp(lambda s(x)) and the weighted set targets the tilted distribution of the sampler's own
output at its temperature, however rough the look-ahead is.

Tempering: lambda_j on the sampler's fixed grid of ``steps`` steps (``smc.tempering_schedule``: ``"linear"`` lambda j /
steps, ``"final"``, or the values), and lambda at the step after which no particle has a mask left (dynamic
decoding can finish early). Resampling (systematic or multinomial) when ESS < ``ess_threshold`` N, never after the
final weighting. The output completion of an item is one particle drawn by its final weight.

Work per item, counted: denoiser rows through ``lm.logits`` 1 + N (K - 1) for K executed steps (the first state is
the same fully masked prompt for every particle: one forward; the forward that values a particle's state is its next
step's forward), as SVDD with M = N; scorer rows N x (the steps with lambda_j != 0, and the last): N K for the linear
schedule. With N = 1 the result is exactly ``generate`` with the same streams (tested): the particles draw their
randomness in the plain sampler's order and shapes, and an item of one particle never resamples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import FlowRLError
from ..seeding import RowGenerators
from .batching import PER_ITEM, STEPS, joined
from .masked_search import UnmaskingBatch, keep_rows, text_in_batches
from .search import Items, SearchOutcome, TextSearchModel, TextVerifier
from .smc import ParticleWeights, _weighted_mean, draw_one, normalise, smc_summary, tempering_schedule
from .text_candidates import MAJORITY, TextScorer, check_candidates_differ, grade_choices, progress_bar


@dataclass
class MaskedSMCResult:
    completions: list[str]  # (P,) the drawn particle's decoded completion
    completion_ids: Tensor  # (P, G)
    chosen: Tensor  # (P,) which particle was drawn
    scores: Tensor  # (P,) float64 its verifier-free score
    particles: list[list[str]]  # (P, N) every final particle, decoded
    particle_ids: Tensor  # (P, N, G)
    log_weights: Tensor  # (P, N) float64, normalised per item
    values: Tensor  # (P, N) float64 every final particle's score
    ess: Tensor = joined(STEPS)  # (S, P) ESS after the reweighting at each executed step, before any resampling
    resampled: Tensor = joined(STEPS)  # (S, P) bool
    lambdas: list[float] = joined(STEPS)  # (S,) lambda_j used at each executed step (the last is lambda)
    denoiser_calls: int = joined(PER_ITEM)  # rows through lm.logits per item
    reward_calls: int = joined(PER_ITEM)  # rows scored per item

    @property
    def resample_count(self) -> Tensor:
        return self.resampled.sum(0)


@torch.no_grad()
def masked_smc(
    model: TextSearchModel, scorer: TextScorer, prompts: Sequence[str], smc, generator: torch.Generator | RowGenerators
) -> MaskedSMCResult:
    """One completion per prompt by SMC with ``smc.n`` particles toward p_base exp(``smc.lam`` score) (``smc``: an
    :class:`~flowrl.inference.sections.SMCConfig`, its lambda given; batch = prompts x n rows); with per-prompt streams,
    prompt i's particles draw in turn from prompt i's stream, then its resampling and final uniforms."""
    n = smc.n
    if getattr(scorer, "name", None) == MAJORITY:
        raise FlowRLError("SMC weights each particle by its own score; majority voting needs a set of finished answers, use --best-of.")
    check_candidates_differ("--smc", n, model.temperature, model.sampler.remasking)
    lambdas = tempering_schedule(smc.tempering, smc.lam, model.sampler.steps)
    batch = UnmaskingBatch(model, prompts, n, generator)
    p = batch.items
    batch.rec = keep_rows(batch.start(), batch.rows)
    weights = ParticleWeights.start(p, n, torch.float64)
    used, scored = [], 0
    logits = None  # each particle's logits (P N, G, V), carried over from the forward that valued its state
    for step, s, eligible in batch.steps():
        rec = batch.rec
        if logits is None:  # only the first step: every particle of an item is the same fully masked state
            first = torch.arange(p, device=batch.device) * n
            logits = batch.logits(rec.completion[first], first)[torch.arange(p, device=batch.device).repeat_interleave(n)]
        batch.transition(logits, rec, eligible, s, step)  # every particle's own step, in generate's order and shapes
        done = not bool((rec.unmask_step < 0).any())
        lam_j = smc.lam if done else float(lambdas[step + 1])
        logits = None if done else batch.logits(rec.completion)  # the next step's forward, and the look-ahead
        values = None
        if lam_j != 0 or done:
            values = batch.value(scorer, rec, logits)
            scored += p * n
        used.append(lam_j)
        low = weights.reweight(lam_j, values, None if done else smc.ess_threshold)
        if low.any():
            take = weights.resample(low, generator, smc.resampling)
            batch.rec = keep_rows(rec, take.to(batch.device))
            logits = logits[take.to(batch.device)]
    return _masked_smc_result(batch, batch.rec, weights, used, generator, scored)


def _masked_smc_result(batch: UnmaskingBatch, rec, weights: ParticleWeights, used: list[float], generator, scored: int) -> MaskedSMCResult:
    """Every item's weighted particles, and one of each drawn by its final weight."""
    p, n = batch.items, batch.width
    log_w = normalise(weights.log_w)
    chosen = draw_one(log_w, generator)
    pick = torch.arange(p) * n + chosen
    texts = batch.decode(rec)
    ess, resampled = weights.history(p)
    return MaskedSMCResult(
        completions=[texts[int(i)] for i in pick],
        completion_ids=rec.completion[pick.to(batch.device)],
        chosen=chosen,
        scores=weights.values.gather(1, chosen[:, None]).squeeze(1),
        particles=[texts[i * n : (i + 1) * n] for i in range(p)],
        particle_ids=rec.completion.view(p, n, -1),
        log_weights=log_w,
        values=weights.values,
        ess=ess,
        resampled=resampled,
        lambdas=used,
        denoiser_calls=batch.forwards // p,
        reward_calls=scored // p,
    )


def masked_smc_in_batches(model: TextSearchModel, scorer: TextScorer, prompts: Sequence[str], smc, progress=None) -> MaskedSMCResult:
    """:func:`masked_smc` over many prompts, ``max(1, model.batch_size // n)`` prompts (x ``n`` particles) at a time, each
    prompt with its own stream keyed by its text as the plain evaluation draws (N = 1 reproduces it exactly). Chunks
    that ran different numbers of steps (dynamic decoding) leave ``ess``, ``resampled`` and ``lambdas`` empty."""
    return text_in_batches(model, prompts, smc.n, lambda batch, streams: masked_smc(model, scorer, batch, smc, streams), progress)


def text_smc_search(section, model: TextSearchModel, verifier: TextVerifier, items: Items) -> SearchOutcome:
    """``flowrl eval --smc N`` on a diffusion LM: the run's reward of the drawn completions, and the weighted estimate
    of the ``--select`` score under the tilted target."""
    n, lam, threshold, rule = section.n, float(section.lam), float(section.ess_threshold), section.rules[0]
    with progress_bar(f"smc-{n}", len(items), "item") as progress:
        result = masked_smc_in_batches(model, verifier.scorers[0], items.prompts, section, progress=progress)
    metrics, rows = grade_choices(verifier, items, result.completions, result.scores, f"smc{n}", rule)
    for row, particles, log_w in zip(rows, result.particles, result.log_weights):
        row.update(particles=particles, weights=[round(float(w), 6) for w in log_w.exp()])
    weighted = _weighted_mean(result.log_weights, result.values)
    metrics[f"eval/smc{n}/weighted_{rule}"] = float(weighted.nanmean())  # the self-normalised estimate of E_target[score]
    metrics[f"eval/smc{n}/resamples_per_item"] = float(result.resample_count.double().mean())
    calls = (result.denoiser_calls, result.reward_calls)
    measured = f"run's reward of the drawn completions {metrics[f'eval/reward/mean@smc{n}/{rule}']:.4f}"
    return SearchOutcome(
        metrics=metrics,
        lines=[smc_summary(section, len(items), metrics[f"eval/smc{n}/resamples_per_item"], calls, measured)],
        extra={"denoiser_calls_per_item": calls[0], "reward_calls_per_item": calls[1]},
        settings={"smc": n, "lambda": lam, "ess_threshold": threshold, "select": rule},
        rows=rows,
    )


__all__: Sequence[str] = ["MaskedSMCResult", "masked_smc", "masked_smc_in_batches", "text_smc_search"]
