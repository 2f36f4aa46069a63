"""SVDD (soft value-based decoding, Li et al. 2024) for DiffusionGemma's entropy-bound sampler: per denoising step,
best-of-M next canvases valued by a one-shot look-ahead.

At every denoising step each item draws M candidate next canvases from the sampler's own transition
(``samplers/entropy_bound.py::denoising_step``: tokens sampled at the step's temperature, the entropy-bound positions
kept, the rest re-noised). The M candidates share the step's logits, so they share its kept positions, its argmax
and its stopping decision, and differ only in the kept tokens and the noise. Each candidate is valued by a
verifier-free score (``text_candidates``: the likelihood, the policy's log-probability of its choices so far, or a
reward that never sees the gold answer) of its one-shot completion: the finished canvases, then the argmax of one
decoder pass on the candidate (with this step's logits as self-conditioning), which is the canvas's output were the
next step its last; later canvases are not looked at. The best candidate is kept and its look-ahead pass is exactly
the next step's forward, so it is reused. A canvas's last step (or the step after which every item stopped) needs no
choice: its output is the argmax of logits the candidates share.

Denoiser work, in rows through the decoder per item and canvas: M at the canvas's first step (the item's state is
run once per candidate row, all equal), then M per step that leaves another step to run; the plain sampler does 1 per
step. With M = 1 nothing is selected and the result is exactly the plain sampler's with the same per-item streams
(tested): the candidates draw in the plain sampler's order, and item i's M candidates draw in turn from item i's stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import FlowRLError
from ..samplers.entropy_bound import (
    CanvasState,
    EntropyBoundSamplerConfig,
    _random_tokens,
    _Tools,
    decode_completions,
    denoising_step,
    finish_canvas,
    resolve_settings,
)
from ..samplers.text_generation import candidate_streams, encode_prompts
from ..seeding import RowGenerators
from .masked_svdd import MaskedSVDDResult
from .text_candidates import MAJORITY, TextScorer, check_candidates_differ


@torch.no_grad()
def canvas_svdd(
    lm,
    sampler: EntropyBoundSamplerConfig,
    prompt_length: int | None,
    scorer: TextScorer,
    prompts: Sequence[str],
    m: int,
    temperature: float,
    generator: RowGenerators,
) -> MaskedSVDDResult:
    """One completion per prompt by SVDD with ``m`` candidates per denoising step (batch = prompts x m rows)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if getattr(scorer, "name", None) == MAJORITY:
        raise FlowRLError("SVDD values each candidate on its own; majority voting needs a set of finished answers, use --best-of.")
    settings = resolve_settings(lm, sampler, temperature)
    tools = _Tools(settings)
    ids, mask = encode_prompts(lm, prompts, prompt_length)
    p, length, device = ids.shape[0], settings.canvas_length, ids.device
    rows = torch.arange(p, device=device).repeat_interleave(m)  # candidate-major within an item
    cand_gen = generator[rows.tolist()]
    prompts_m = [q for q in prompts for _ in range(m)]
    session = lm.session(ids[rows], mask[rows])
    every = torch.ones(p, dtype=torch.bool, device=device)
    finished = torch.zeros(p, dtype=torch.bool, device=device)
    filler = settings.pad_token_id if settings.pad_token_id is not None else (settings.eos_token_ids or (0,))[0]
    completion = torch.full((p, settings.completion_length), filler, dtype=torch.long, device=device)
    log_lik = torch.zeros(p, dtype=torch.float64, device=device)
    forwards, step_scores = 0, []
    first = torch.arange(p, device=device) * m
    for block in range(settings.num_blocks):
        session.encode()
        canvas = _random_tokens((p, length), settings.vocab_size, generator, every, device)  # one initial canvas per item
        state = CanvasState(canvas, canvas, None, torch.zeros(p, dtype=torch.bool, device=device))
        if tools.stopper is not None:
            tools.stopper.reset()  # one history per candidate row: an item's candidates see the same argmax, so agree
        logits = session.denoise(state.canvas[rows], None)[first]
        forwards += p * m
        for j, cur_step in enumerate(range(settings.steps, 0, -1)):
            cand = state.rows(rows)
            outcome = denoising_step(tools, settings, logits[rows], cand, cur_step, cand_gen, session.embedding_dtype)
            new = outcome.state
            if new.frozen.all() or j == settings.steps - 1:  # the canvas's last step: its output is the shared argmax
                state = new.rows(first)
                break
            look = session.denoise(new.canvas, new.self_conditioning)
            forwards += p * m
            filled = completion[rows].clone()
            filled[:, block * length : (block + 1) * length] = torch.where(new.frozen[:, None], new.argmax, look.argmax(-1))
            texts = decode_completions(lm.tokenizer, filled, settings.eos_token_ids)
            value = scorer(texts, prompts_m, (log_lik[rows] + outcome.log_prob).cpu()).double().view(p, m)
            step_scores.append(value)
            best = torch.where(torch.isfinite(value), value, float("-inf")).argmax(1).to(device)
            chosen = first + best
            state, logits = new.rows(chosen), look[chosen]
            log_lik = log_lik + torch.where(state.frozen | finished, 0.0, outcome.log_prob[chosen])  # the counted steps
            if tools.stopper is not None and tools.stopper.argmax_canvas_history is not None:  # every candidate continues from the kept one
                history = tools.stopper.argmax_canvas_history
                tools.stopper.argmax_canvas_history = history[:, chosen][:, rows]
        out, finished, _ = finish_canvas(state.argmax, finished, settings)
        completion[:, block * length : (block + 1) * length] = out
        if finished.all():
            break
        session.finish_canvas(out[rows])
    texts = decode_completions(lm.tokenizer, completion, settings.eos_token_ids)
    return MaskedSVDDResult(
        completions=texts,
        completion_ids=completion,
        scores=scorer(texts, list(prompts), log_lik.cpu()).double(),
        step_scores=step_scores,
        forwards=forwards,
    )


def canvas_svdd_in_batches(
    lm,
    sampler: EntropyBoundSamplerConfig,
    prompt_length: int | None,
    scorer: TextScorer,
    prompts: Sequence[str],
    m: int,
    temperature: float,
    seed: int,
    batch_size: int,
    position_scorer=None,
    progress=None,
) -> MaskedSVDDResult:
    """:func:`canvas_svdd` over many prompts, ``batch_size // m`` prompts at a time, each with its own stream keyed by
    its text as the plain evaluation draws (M = 1 reproduces it). ``position_scorer``: unused (masked samplers only)."""
    check_candidates_differ("--svdd", m, temperature, sampler.remasking)
    chunk = max(1, batch_size // m)
    parts = []
    for i in range(0, len(prompts), chunk):
        batch = prompts[i : i + chunk]
        parts.append(canvas_svdd(lm, sampler, prompt_length, scorer, batch, m, temperature, candidate_streams(seed, batch, 0)))
        if progress is not None:
            progress(len(batch))
    return MaskedSVDDResult(
        completions=[c for r in parts for c in r.completions],
        completion_ids=torch.cat([r.completion_ids for r in parts]),
        scores=torch.cat([r.scores for r in parts]),
        step_scores=[],
        forwards=sum(r.forwards for r in parts),
    )


__all__: Sequence[str] = ["canvas_svdd", "canvas_svdd_in_batches"]
