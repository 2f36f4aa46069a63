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
from ..samplers.masked import (
    MaskedSamplerConfig,
    _check_args,
    _num_to_unmask,
    _scores,
    _token_log_probs,
    decode_completions,
    gumbel_sample,
    shift_logits,
    transfer_schedule,
)
from ..samplers.masked import _Recorder as Recorder
from ..samplers.text_generation import candidate_streams, encode_prompts
from ..seeding import RowGenerators
from ..types import MaskedLM
from .masked_svdd import _keep
from .smc import (
    check_smc_arguments,
    draw_one,
    effective_sample_size,
    normalise,
    potential,
    resample_indices,
    reweight,
    tempering_schedule,
)
from .text_candidates import MAJORITY, TextScorer, check_candidates_differ


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
    ess: Tensor  # (S, P) ESS after the reweighting at each executed step, before any resampling
    resampled: Tensor  # (S, P) bool
    lambdas: list[float]  # (S,) lambda_j used at each executed step (the last is lambda)
    denoiser_calls: int  # rows through lm.logits per item
    reward_calls: int  # rows scored per item

    @property
    def resample_count(self) -> Tensor:
        return self.resampled.sum(0)


@torch.no_grad()
def masked_smc(
    lm: MaskedLM,
    sampler: MaskedSamplerConfig,
    prompt_length: int | None,
    scorer: TextScorer,
    prompts: Sequence[str],
    n: int,
    temperature: float,
    generator: torch.Generator | RowGenerators,
    lam: float = 1.0,
    ess_threshold: float = 0.5,
    tempering: str | Sequence[float] = "linear",
    resampling: str = "systematic",
    position_scorer=None,
) -> MaskedSMCResult:
    """One completion per prompt by SMC with ``n`` particles (batch = prompts x n rows); with per-prompt streams, prompt
    i's particles draw in turn from prompt i's stream, then its resampling and final uniforms."""
    check_smc_arguments(n, ess_threshold, resampling)
    if getattr(scorer, "name", None) == MAJORITY:
        raise FlowRLError("SMC weights each particle by its own score; majority voting needs a set of finished answers, use --best-of.")
    check_candidates_differ("--smc", n, temperature, sampler.remasking)
    sc = sampler
    num_blocks = _check_args(sc.gen_length, sc.steps, sc.block_length, sc.remasking, sc.threshold, position_scorer)
    steps_per_block = sc.steps // num_blocks
    schedule = transfer_schedule(sc.block_length, steps_per_block)
    lambdas = tempering_schedule(tempering, lam, sc.steps)
    ids, mask = encode_prompts(lm, prompts, prompt_length)
    p, length = ids.shape
    dev = ids.device
    rows = torch.arange(p, device=dev).repeat_interleave(n)  # particle b of item i is row i n + b
    part_gen = generator[rows.tolist()] if isinstance(generator, RowGenerators) else generator
    ids_n, prompts_n = ids[rows], [q for q in prompts for _ in range(n)]
    attention_mask = torch.cat([mask[rows], torch.ones((p * n, sc.gen_length), dtype=mask.dtype, device=dev)], dim=1)
    rec = _keep(Recorder.start(ids, sc.gen_length, lm.mask_token_id), rows)
    positions = torch.arange(sc.gen_length, device=dev)
    forwards = scored = 0

    def completion_logits(completion: Tensor, keep_rows: Tensor | None) -> Tensor:
        nonlocal forwards
        x_ids = ids_n if keep_rows is None else ids_n[keep_rows]
        x_mask = attention_mask if keep_rows is None else attention_mask[keep_rows]
        forwards += completion.shape[0]
        logits = lm.logits(torch.cat([x_ids, completion], dim=1), attention_mask=x_mask)
        return (shift_logits(logits) if sc.logit_shift else logits)[:, length:]

    log_w = torch.zeros(p, n, dtype=torch.float64)
    phi = torch.zeros(p, n, dtype=torch.float64)
    values = torch.zeros(p, n, dtype=torch.float64)
    ess, resampled, used = [], [], []
    logits = None  # each particle's logits (P N, G, V), carried over from the forward that valued its state
    for block in range(num_blocks):
        in_block = (positions >= block * sc.block_length) & (positions < (block + 1) * sc.block_length)
        for s in range(steps_per_block):
            eligible = (rec.unmask_step < 0) & in_block
            if not eligible.any() or (sc.threshold is None and schedule[s] == 0):
                continue  # nothing to commit, as in generate
            if logits is None:  # only the first step: every particle of an item is the same fully masked state
                first = torch.arange(p, device=dev) * n
                logits = completion_logits(rec.completion[first], first)[torch.arange(p, device=dev).repeat_interleave(n)]
            # the sampler's own transition for every particle, drawing randomness in generate's order and shapes
            x0 = gumbel_sample(logits, temperature, part_gen, exclude=lm.mask_token_id)
            log_p = _token_log_probs(logits, x0)
            scores = _scores(logits, log_p, rec.completion, sc.remasking, position_scorer, part_gen, temperature)
            scores = scores.masked_fill(~eligible, float("-inf"))
            k = _num_to_unmask(scores, eligible, schedule[s], sc.threshold, s == steps_per_block - 1)
            rec.commit(x0, log_p, scores, k, block * steps_per_block + s)
            remaining = rec.unmask_step < 0
            done = not bool(remaining.any())
            lam_j = lam if done else float(lambdas[block * steps_per_block + s + 1])
            look = None if done else completion_logits(rec.completion, None)  # the next step's forward, and the look-ahead
            if lam_j != 0 or done:
                if look is not None:  # one-shot completion: every masked position filled with its most likely token
                    fill = gumbel_sample(look, 0.0, exclude=lm.mask_token_id)
                    filled = torch.where(remaining, fill.to(rec.completion.dtype), rec.completion)
                    log_lik = torch.where(remaining, _token_log_probs(look, fill), rec.token_log_probs.double()).sum(1)
                else:
                    filled, log_lik = rec.completion, rec.token_log_probs.double().sum(1)
                texts = decode_completions(lm.tokenizer, filled, lm.eos_token_id)
                scored += len(texts)
                values = scorer(texts, prompts_n, log_lik).double().cpu().view(p, n)
            phi_new = potential(lam_j, values)
            log_w = reweight(log_w, phi, phi_new)
            phi = phi_new
            used.append(lam_j)
            ess.append(effective_sample_size(log_w))
            low = ess[-1] < ess_threshold * n if not done and n > 1 else torch.zeros(p, dtype=torch.bool)
            resampled.append(low)
            logits = look
            if low.any():
                items = low.nonzero().squeeze(1).tolist()
                ancestors = resample_indices(log_w[items], items, generator, resampling)
                take = torch.arange(p * n).view(p, n)
                take[items] = torch.tensor(items)[:, None] * n + ancestors
                take = take.flatten()
                rec = _keep(rec, take.to(dev))
                logits = logits[take.to(dev)]
                phi, values = phi.flatten()[take].view(p, n), values.flatten()[take].view(p, n)
                log_w[items] = 0.0
    log_w = normalise(log_w)
    chosen = draw_one(log_w, generator)
    pick = torch.arange(p) * n + chosen
    texts = decode_completions(lm.tokenizer, rec.completion, lm.eos_token_id)
    return MaskedSMCResult(
        completions=[texts[int(i)] for i in pick],
        completion_ids=rec.completion[pick.to(dev)],
        chosen=chosen,
        scores=values.gather(1, chosen[:, None]).squeeze(1),
        particles=[texts[i * n : (i + 1) * n] for i in range(p)],
        particle_ids=rec.completion.view(p, n, -1),
        log_weights=log_w,
        values=values,
        ess=torch.stack(ess) if ess else torch.zeros(0, p, dtype=torch.float64),
        resampled=torch.stack(resampled) if resampled else torch.zeros(0, p, dtype=torch.bool),
        lambdas=used,
        denoiser_calls=forwards // p,
        reward_calls=scored // p,
    )


def masked_smc_in_batches(
    lm: MaskedLM,
    sampler: MaskedSamplerConfig,
    prompt_length: int | None,
    scorer: TextScorer,
    prompts: Sequence[str],
    n: int,
    temperature: float,
    seed: int,
    batch_size: int,
    lam: float = 1.0,
    ess_threshold: float = 0.5,
    tempering: str | Sequence[float] = "linear",
    resampling: str = "systematic",
    position_scorer=None,
    progress=None,
) -> MaskedSMCResult:
    """:func:`masked_smc` over many prompts, ``max(1, batch_size // n)`` prompts (x ``n`` particles) at a time, each prompt
    with its own stream keyed by its text as the plain evaluation draws (N = 1 reproduces it exactly). ``progress``:
    called with the number of prompts done after each chunk."""
    chunk = max(1, batch_size // n)
    parts = []
    for i in range(0, len(prompts), chunk):
        batch = prompts[i : i + chunk]
        parts.append(
            masked_smc(
                lm,
                sampler,
                prompt_length,
                scorer,
                batch,
                n,
                temperature,
                candidate_streams(seed, batch, 0),
                lam,
                ess_threshold,
                tempering,
                resampling,
                position_scorer,
            )
        )
        if progress is not None:
            progress(len(batch))
    same_steps = len({r.ess.shape[0] for r in parts}) == 1
    if len({r.denoiser_calls for r in parts}) != 1:  # dynamic decoding: chunks may run different numbers of steps
        calls, rewards = sum(r.denoiser_calls * len(r.chosen) for r in parts), sum(r.reward_calls * len(r.chosen) for r in parts)
        denoiser_calls, reward_calls = round(calls / len(prompts)), round(rewards / len(prompts))
    else:
        denoiser_calls, reward_calls = parts[0].denoiser_calls, parts[0].reward_calls
    return MaskedSMCResult(
        completions=[c for r in parts for c in r.completions],
        completion_ids=torch.cat([r.completion_ids for r in parts]),
        chosen=torch.cat([r.chosen for r in parts]),
        scores=torch.cat([r.scores for r in parts]),
        particles=[row for r in parts for row in r.particles],
        particle_ids=torch.cat([r.particle_ids for r in parts]),
        log_weights=torch.cat([r.log_weights for r in parts]),
        values=torch.cat([r.values for r in parts]),
        ess=torch.cat([r.ess for r in parts], 1) if same_steps else torch.zeros(0, len(prompts), dtype=torch.float64),
        resampled=torch.cat([r.resampled for r in parts], 1) if same_steps else torch.zeros(0, len(prompts), dtype=torch.bool),
        lambdas=parts[0].lambdas if same_steps else [],
        denoiser_calls=denoiser_calls,
        reward_calls=reward_calls,
    )


__all__: Sequence[str] = ["MaskedSMCResult", "masked_smc", "masked_smc_in_batches"]
