"""What the searches on a masked-diffusion LM share (SVDD, SMC): a batch in which every item's prompt stands ``width``
times (its candidates or particles), the sampler's own unmasking transition on it, and the one-shot value of a
partial completion.

The transition is ``samplers/masked.py::generate``'s step, drawing its randomness in the same order and shapes, so a
search of width 1 is exactly the plain sampler (tested for SVDD and SMC). The value of a state is a verifier-free
score of its one-shot completion: one forward pass on the state with every still-masked position filled with its most
likely token; that forward pass is also the next step's, so valuing a state costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from ..samplers.masked import (
    _check_args,
    _num_to_unmask,
    _Recorder,
    _scores,
    _token_log_probs,
    decode_completions,
    gumbel_sample,
    shift_logits,
    transfer_schedule,
)
from ..samplers.text_generation import candidate_streams, encode_prompts
from ..seeding import RowGenerators
from .batching import in_batches
from .search import TextSearchModel


def keep_rows(rec: _Recorder, rows: Tensor) -> _Recorder:
    """The record of the rows ``rows`` (candidates kept, particles resampled)."""
    return _Recorder(
        completion=rec.completion[rows],
        unmask_step=rec.unmask_step[rows],
        unmask_rank=rec.unmask_rank[rows],
        token_log_probs=rec.token_log_probs[rows],
        committed=rec.committed[rows],
    )


class UnmaskingBatch:
    """``prompts``, each ``width`` times in a row (row i width + b), on ``model``; ``generator``: the items' streams
    (item i's rows draw in turn from stream i) or one generator. ``forwards`` counts the rows run through the model."""

    def __init__(self, model: TextSearchModel, prompts: Sequence[str], width: int, generator: torch.Generator | RowGenerators):
        sc = self.sampler = model.sampler
        self.model, self.width = model, width
        self.num_blocks = _check_args(sc.gen_length, sc.steps, sc.block_length, sc.remasking, sc.threshold, model.position_scorer)
        self.steps_per_block = sc.steps // self.num_blocks
        self.schedule = transfer_schedule(sc.block_length, self.steps_per_block)
        self.ids, mask = encode_prompts(model.lm, prompts, model.prompt_length)
        self.items, self.prompt_length = self.ids.shape
        self.device = self.ids.device
        self.rows = torch.arange(self.items, device=self.device).repeat_interleave(width)  # item-major
        self.generator = generator[self.rows.tolist()] if isinstance(generator, RowGenerators) else generator
        self.row_ids = self.ids[self.rows]
        self.prompts = [q for q in prompts for _ in range(width)]
        ones = torch.ones((len(self.rows), sc.gen_length), dtype=mask.dtype, device=self.device)
        self.attention_mask = torch.cat([mask[self.rows], ones], dim=1)
        self.forwards = 0
        self.rec: _Recorder | None = None  # the search's record: every item's kept state (SVDD) or its particles (SMC)

    def start(self) -> _Recorder:
        """Each item's fully masked completion, once per item: the record :meth:`steps` starts from."""
        self.rec = _Recorder.start(self.ids, self.sampler.gen_length, self.model.lm.mask_token_id)
        return self.rec

    def logits(self, completion: Tensor, rows: Tensor | None = None) -> Tensor:
        """The completion positions' logits of the rows ``rows`` (default all) holding ``completion``."""
        ids, mask = self.row_ids, self.attention_mask
        if rows is not None:
            ids, mask = ids[rows], mask[rows]
        self.forwards += completion.shape[0]
        logits = self.model.lm.logits(torch.cat([ids, completion], dim=1), attention_mask=mask)
        return (shift_logits(logits) if self.sampler.logit_shift else logits)[:, self.prompt_length :]

    def steps(self) -> Iterator[tuple[int, int, Tensor]]:
        """(step, s, eligible) for every step that commits something, as ``generate`` runs them: the step's index
        overall, its index in its block and the positions ``rec``, the record as the caller left it, may commit."""
        sc = self.sampler
        positions = torch.arange(sc.gen_length, device=self.device)
        for block in range(self.num_blocks):
            in_block = (positions >= block * sc.block_length) & (positions < (block + 1) * sc.block_length)
            for s in range(self.steps_per_block):
                eligible = (self.rec.unmask_step < 0) & in_block
                if eligible.any() and (sc.threshold is not None or self.schedule[s] != 0):  # else nothing to commit
                    yield block * self.steps_per_block + s, s, eligible

    def transition(self, logits: Tensor, rec: _Recorder, eligible: Tensor, s: int, step: int) -> None:
        """The sampler's own step on every row of ``rec``: tokens at the temperature, positions by the remasking rule."""
        sc, temperature = self.sampler, self.model.temperature
        x0 = gumbel_sample(logits, temperature, self.generator, exclude=self.model.lm.mask_token_id)
        log_p = _token_log_probs(logits, x0)
        scores = _scores(logits, log_p, rec.completion, sc.remasking, self.model.position_scorer, self.generator, temperature)
        scores = scores.masked_fill(~eligible, float("-inf"))
        k = _num_to_unmask(scores, eligible, self.schedule[s], sc.threshold, s == self.steps_per_block - 1)
        rec.commit(x0, log_p, scores, k, step)

    def value(self, scorer, rec: _Recorder, look: Tensor | None, width: int | None = None) -> Tensor:
        """(items, width) float64 the score of every row's one-shot completion: every masked position filled with its
        most likely token under ``look`` (the rows' logits; None when nothing is masked: the completion itself);
        ``width``: rows per item in ``rec`` (default the batch's; 1 for one kept row per item)."""
        if look is not None:
            remaining = rec.unmask_step < 0
            fill = gumbel_sample(look, 0.0, exclude=self.model.lm.mask_token_id)
            filled = torch.where(remaining, fill.to(rec.completion.dtype), rec.completion)
            log_lik = torch.where(remaining, _token_log_probs(look, fill), rec.token_log_probs.double()).sum(1)
        else:
            filled, log_lik = rec.completion, rec.token_log_probs.double().sum(1)
        texts = decode_completions(self.model.lm.tokenizer, filled, self.model.lm.eos_token_id)
        width = self.width if width is None else width
        return scorer(texts, self.prompts[:: self.width // width], log_lik).double().cpu().view(self.items, width)

    def decode(self, rec: _Recorder) -> list[str]:
        return decode_completions(self.model.lm.tokenizer, rec.completion, self.model.lm.eos_token_id)


def text_in_batches(model: TextSearchModel, prompts: Sequence[str], width: int, run, progress=None):
    """``run(chunk_prompts, streams)`` on ``model.batch_size // width`` prompts at a time (x ``width`` rows each), every
    prompt with its own stream keyed by its text, as the plain evaluation draws (width 1 reproduces it exactly);
    ``progress``: told the prompts done after each chunk."""

    def chunk(rows: list[int]):
        batch = [prompts[i] for i in rows]
        return run(batch, candidate_streams(model.seed, batch, 0))

    return in_batches(len(prompts), model.batch_size // width, chunk, progress)


__all__ = ["UnmaskingBatch", "keep_rows", "text_in_batches"]
