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
from torch import Tensor

from ..samplers.entropy_bound import (
    CanvasState,
    _random_tokens,
    _Tools,
    decode_completions,
    denoising_step,
    finish_canvas,
    resolve_settings,
)
from ..samplers.text_generation import encode_prompts
from ..seeding import RowGenerators
from .masked_search import text_in_batches
from .masked_svdd import MaskedSVDDResult, check_svdd
from .search import TextSearchModel
from .text_candidates import TextScorer


class _CanvasSVDD:
    """One batch of prompts, each with ``m`` candidate rows, through DiffusionGemma's canvases (module docstring)."""

    def __init__(self, model: TextSearchModel, scorer: TextScorer, prompts: Sequence[str], m: int, generator: RowGenerators):
        self.settings = settings = resolve_settings(model.lm, model.sampler, model.temperature)
        self.tools, self.lm, self.scorer, self.generator = _Tools(settings), model.lm, scorer, generator
        ids, mask = encode_prompts(model.lm, prompts, model.prompt_length)
        self.p, self.length, self.device = ids.shape[0], settings.canvas_length, ids.device
        self.rows = torch.arange(self.p, device=self.device).repeat_interleave(m)  # candidate-major within an item
        self.first = torch.arange(self.p, device=self.device) * m
        self.m, self.candidate_streams = m, generator[self.rows.tolist()]
        self.prompts, self.prompts_m = list(prompts), [q for q in prompts for _ in range(m)]
        self.session = model.lm.session(ids[self.rows], mask[self.rows])
        filler = settings.pad_token_id if settings.pad_token_id is not None else (settings.eos_token_ids or (0,))[0]
        self.completion = torch.full((self.p, settings.completion_length), filler, dtype=torch.long, device=self.device)
        self.log_lik = torch.zeros(self.p, dtype=torch.float64, device=self.device)
        self.forwards, self.step_scores = 0, []

    def run(self) -> MaskedSVDDResult:
        finished = torch.zeros(self.p, dtype=torch.bool, device=self.device)
        for block in range(self.settings.num_blocks):
            state = self._denoise_canvas(block, finished)
            out, finished, _ = finish_canvas(state.argmax, finished, self.settings)
            self.completion[:, block * self.length : (block + 1) * self.length] = out
            if finished.all():
                break
            self.session.finish_canvas(out[self.rows])
        texts = decode_completions(self.lm.tokenizer, self.completion, self.settings.eos_token_ids)
        return MaskedSVDDResult(
            completions=texts,
            completion_ids=self.completion,
            scores=self.scorer(texts, self.prompts, self.log_lik.cpu()).double(),
            step_scores=self.step_scores,
            forwards=self.forwards,
        )

    def _forward(self, canvas: Tensor, self_conditioning: Tensor | None) -> Tensor:
        self.forwards += len(self.rows)
        return self.session.denoise(canvas, self_conditioning)

    def _denoise_canvas(self, block: int, finished: Tensor) -> CanvasState:
        """One canvas: at every step but its last, the best of M candidate next canvases by their look-ahead value."""
        settings, rows = self.settings, self.rows
        self.session.encode()
        every = torch.ones(self.p, dtype=torch.bool, device=self.device)
        canvas = _random_tokens((self.p, self.length), settings.vocab_size, self.generator, every, self.device)  # one per item
        state = CanvasState(canvas, canvas, None, torch.zeros(self.p, dtype=torch.bool, device=self.device))
        if self.tools.stopper is not None:
            self.tools.stopper.reset()  # one history per candidate row: an item's candidates see the same argmax, so agree
        logits = self._forward(state.canvas[rows], None)[self.first]
        for j, cur_step in enumerate(range(settings.steps, 0, -1)):
            outcome = denoising_step(
                self.tools, settings, logits[rows], state.rows(rows), cur_step, self.candidate_streams, self.session.embedding_dtype
            )
            new = outcome.state
            if new.frozen.all() or j == settings.steps - 1:  # the canvas's last step: its output is the shared argmax
                return new.rows(self.first)
            state, logits = self._keep_best(block, new, outcome.log_prob, finished)
        return state

    def _keep_best(self, block: int, new: CanvasState, log_prob: Tensor, finished: Tensor) -> tuple[CanvasState, Tensor]:
        """The best candidate of each item by its one-shot completion's score, and its look-ahead logits."""
        look = self._forward(new.canvas, new.self_conditioning)
        filled = self.completion[self.rows].clone()
        filled[:, block * self.length : (block + 1) * self.length] = torch.where(new.frozen[:, None], new.argmax, look.argmax(-1))
        texts = decode_completions(self.lm.tokenizer, filled, self.settings.eos_token_ids)
        value = self.scorer(texts, self.prompts_m, (self.log_lik[self.rows] + log_prob).cpu()).double().view(self.p, self.m)
        self.step_scores.append(value)
        chosen = self.first + torch.where(torch.isfinite(value), value, float("-inf")).argmax(1).to(self.device)
        state = new.rows(chosen)
        self.log_lik = self.log_lik + torch.where(state.frozen | finished, 0.0, log_prob[chosen])  # the counted steps
        stopper = self.tools.stopper
        if stopper is not None and stopper.argmax_canvas_history is not None:  # every candidate continues from the kept one
            stopper.argmax_canvas_history = stopper.argmax_canvas_history[:, chosen][:, self.rows]
        return state, look[chosen]


@torch.no_grad()
def canvas_svdd(model: TextSearchModel, scorer: TextScorer, prompts: Sequence[str], m: int, generator: RowGenerators) -> MaskedSVDDResult:
    """One completion per prompt by SVDD with ``m`` candidates per denoising step (batch = prompts x m rows)."""
    check_svdd(scorer, m, model.temperature, model.sampler.remasking)
    return _CanvasSVDD(model, scorer, prompts, m, generator).run()


def canvas_svdd_in_batches(model: TextSearchModel, scorer: TextScorer, prompts: Sequence[str], m: int, progress=None) -> MaskedSVDDResult:
    """:func:`canvas_svdd` over many prompts, ``model.batch_size // m`` prompts at a time, each with its own stream keyed by
    its text as the plain evaluation draws (M = 1 reproduces it)."""
    return text_in_batches(model, prompts, m, lambda batch, streams: canvas_svdd(model, scorer, batch, m, streams), progress)


__all__: Sequence[str] = ["canvas_svdd", "canvas_svdd_in_batches"]
