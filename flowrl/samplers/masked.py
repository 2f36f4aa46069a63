"""LLaDA-style masked-diffusion generation, recorded into a :class:`~flowrl.types.TokenTrajectory`.

The completion starts fully masked and is filled in semi-autoregressive blocks. Inside a block, each
step predicts every masked position at once and commits a few of them: the most confident ones
(``low_confidence``), random ones (``random``), every one above a confidence threshold (dynamic
decoding, Fast-dLLM), or a Plackett-Luce sample from a learned position scorer (``policy``, DCoLT; at
temperature 0 its top-k, greedy in positions as in tokens).
Committed tokens are never re-masked, so the record (final tokens + the step and order in which each
position was committed) replays every intermediate state exactly (``TokenTrajectory.state_at``).

``kv_cache``: ``none`` runs the whole sequence at every step (LLaDA). ``exact``, for a block-diffusion model (block-causal
attention, ``MaskedDiffusionLM.block_length``; BD3-LM / SDAR), keeps the prompt and the finished blocks in a key-value
cache and runs only the current block: the recorded log-probs are those of the full-sequence block-causal forward, so
every scoring path (which runs the full sequence) re-scores the rollout's own policy. A bidirectional model's prefix
cannot be cached exactly (its keys change when a later block changes; Fast-dLLM's prefix cache is an approximation),
so ``exact`` refuses one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..errors import FlowRLError
from ..sections import SamplerSection
from ..seeding import RowGenerators
from ..types import MaskedLM, TokenTrajectory

Remasking = Literal["low_confidence", "random", "policy"]
KVCache = Literal["none", "exact"]
# (logits (B, G, V), completion state (B, G)) -> position scores (B, G); higher = unmask sooner.
PositionScorer = Callable[[Tensor, Tensor], Tensor]


def transfer_schedule(n_masked: int, steps: int) -> list[int]:
    """Return how many tokens to unmask at each of ``steps`` steps, summing to ``n_masked``.

    ``base = n // steps`` per step with the remainder front-loaded (10 over 4 steps -> [3, 3, 2, 2]),
    as LLaDA's ``get_num_transfer_tokens``.
    """
    if steps <= 0 or n_masked < 0:
        raise ValueError(f"need steps > 0 and n_masked >= 0, got steps={steps}, n_masked={n_masked}")
    base, rem = divmod(n_masked, steps)
    return [base + 1] * rem + [base] * (steps - rem)


def _uniform(shape: torch.Size, generator: torch.Generator | RowGenerators | None, device: torch.device) -> Tensor:
    """float64 U(0, 1) of ``shape``; from :class:`~flowrl.seeding.RowGenerators`, row b from its own stream (training
    rollouts: a completion's draws do not depend on the process or batch it is generated in)."""
    if isinstance(generator, RowGenerators):
        return generator.rand(tuple(shape), dtype=torch.float64).to(device)
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float64)


def _gumbel(shape: torch.Size, generator: torch.Generator | RowGenerators | None, device: torch.device) -> Tensor:
    """Standard Gumbel noise in float64: -log(-log U), U ~ U(0, 1)."""
    u = _uniform(shape, generator, device)
    # U = 0 would give -inf noise; clamping keeps every category reachable and the noise finite.
    return -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float64).tiny)))


def _index(token: int, like: Tensor) -> Tensor:
    """Return the (1,) index tensor of ``token`` on ``like``'s device (for index_fill)."""
    return torch.tensor([token], device=like.device)


def gumbel_sample(
    logits: Tensor, temperature: float, generator: torch.Generator | RowGenerators | None = None, exclude: int | None = None
) -> Tensor:
    """Sample token ids (...,) from logits (..., V) at ``temperature`` (0 = argmax), never ``exclude``.

    Gumbel-max: argmax_v(log p_v / T + G_v) with i.i.d. standard Gumbel G_v is distributed as
    softmax(log p / T) = softmax(logits / T), because log p = logits - logsumexp(logits) differs from
    the logits by a per-row constant that the argmax ignores. LLaDA writes the same thing as
    argmax(exp(logits) / (-log U)^T) (raise to the power 1/T and take logs). It is computed in float64
    because in low precision the perturbed scores of near-tied tokens collapse and the sample is biased
    towards the lower index (LLaDA's observation on generation quality). ``exclude`` (the mask token)
    gets probability 0, i.e. the sample is from softmax(logits / T) conditioned on not being it.
    """
    if temperature == 0:
        if exclude is not None:
            logits = logits.index_fill(-1, _index(exclude, logits), float("-inf"))
        return logits.argmax(dim=-1)
    # logits / T rather than log_softmax(logits) / T: they differ by a per-row constant the argmax ignores,
    # and skipping the normalisation saves one (B, L, V) float64 tensor (V ~ 126k for LLaDA).
    z = logits.to(torch.float64) / temperature
    if exclude is not None:
        z.index_fill_(-1, _index(exclude, z), float("-inf"))
    z += _gumbel(z.shape, generator, z.device)
    return z.argmax(dim=-1)


def shift_logits(logits: Tensor) -> Tensor:
    """Shift logits (B, L, V) right by one position: position i gets the logits computed at i - 1.

    AR-adapted models (Dream) keep the next-token head, so the prediction for token i comes out at
    position i - 1; position 0 has no predecessor and keeps its own logits.
    """
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def _select(scores: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Choose the top-``k[b]`` positions of each row of scores (B, G).

    Returns (chosen (B, G) bool, order (B, G) int64: the rank of each position in descending score,
    ties broken towards the lower index so that the choice is deterministic).
    """
    idx = torch.sort(scores, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(scores.shape[1], device=scores.device).expand_as(idx)
    order = torch.empty_like(idx).scatter_(1, idx, ranks)
    return order < k[:, None], order


def _token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """Return float64 log_softmax(logits (B, G, V))[tokens (B, G)] without keeping a (B, G, V) float64 copy."""
    picked = logits.gather(-1, tokens[..., None]).squeeze(-1).to(torch.float64)
    return picked - torch.logsumexp(logits.to(torch.float64), dim=-1)


def _scores(
    logits: Tensor,
    log_p: Tensor,
    state: Tensor,
    remasking: str,
    position_scorer: PositionScorer | None,
    generator: torch.Generator | RowGenerators | None,
    temperature: float,
) -> Tensor:
    """Return float64 scores (B, G) ranking masked positions for unmasking (eligibility applied later).

    log_p: (B, G) float64 log-prob of each position's sampled token; its exp is LLaDA's confidence.
    ``policy`` at temperature 0 is greedy in the positions too (the top-k scores, the Plackett-Luce mode),
    as it is in the tokens: evaluation then measures the policy, not one draw of its order.
    """
    if remasking == "low_confidence":
        return log_p.exp()
    if remasking == "random":
        return _uniform(log_p.shape, generator, log_p.device)
    # Gumbel-top-k: sorting scores + i.i.d. Gumbel noise yields a Plackett-Luce sample without
    # replacement from softmax(scores); the sorted order is the sequential sampling order.
    s = position_scorer(logits, state).to(torch.float64)
    return s if temperature == 0 else s + _gumbel(s.shape, generator, s.device)


def _num_to_unmask(scores: Tensor, eligible: Tensor, scheduled: int, threshold: float | None, last_step: bool) -> Tensor:
    """Return (B,) how many eligible positions each row unmasks this step.

    Fixed schedule: ``scheduled`` for every row. Dynamic: every eligible position with score above
    ``threshold``, at least one, and all that remain on the block's last step so that the block is
    complete when the sampler moves on.
    """
    n_eligible = eligible.sum(dim=1)
    if threshold is None:
        return torch.full_like(n_eligible, scheduled).minimum(n_eligible)
    if last_step:
        return n_eligible
    above = (eligible & (scores > threshold)).sum(dim=1)
    return above.clamp_min(1).minimum(n_eligible)


@dataclass(frozen=True)
class _Denoising:
    """One generation's settings and the step both of its loops (the full sequence, the cached block) take: the block
    plan, how tokens are drawn and which positions a step commits, in one order, so both draw from the generator
    alike."""

    gen_length: int
    steps: int
    block_length: int
    mask_token_id: int
    temperature: float
    remasking: str
    threshold: float | None
    position_scorer: PositionScorer | None
    generator: torch.Generator | RowGenerators | None

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    def skips(self, eligible: Tensor, scheduled: int) -> bool:
        """Nothing to commit (no eligible position, or a fixed schedule's zero): the step's forward pass is skipped."""
        return not eligible.any() or (self.threshold is None and scheduled == 0)

    def step(
        self, logits: Tensor, state: Tensor, eligible: Tensor, scheduled: int, last_step: bool
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(tokens, their log-probs, scores, how many each row commits) of one step over the positions ``state`` (B, n)
        with ``logits`` (B, n, V); ineligible positions score -inf."""
        # The mask token is never a valid output: committing it would leave a hole the record calls filled.
        x0 = gumbel_sample(logits, self.temperature, self.generator, exclude=self.mask_token_id)
        log_p = _token_log_probs(logits, x0)
        scores = _scores(logits, log_p, state, self.remasking, self.position_scorer, self.generator, self.temperature)
        scores = scores.masked_fill(~eligible, float("-inf"))
        return x0, log_p, scores, _num_to_unmask(scores, eligible, scheduled, self.threshold, last_step)


@dataclass
class _Recorder:
    """The growing record of a generation: completion (B, G) and per-position unmask step, rank, log-prob."""

    completion: Tensor
    unmask_step: Tensor  # -1 while masked
    unmask_rank: Tensor
    token_log_probs: Tensor
    committed: Tensor  # (B,) positions committed so far: the rank offset of the next step

    @staticmethod
    def start(prompt_ids: Tensor, gen_length: int, mask_token_id: int) -> _Recorder:
        """Return the record of a fully masked completion."""
        batch, device = prompt_ids.shape[0], prompt_ids.device
        unset = torch.full((batch, gen_length), -1, dtype=torch.long, device=device)
        return _Recorder(
            completion=torch.full((batch, gen_length), mask_token_id, dtype=prompt_ids.dtype, device=device),
            unmask_step=unset,
            unmask_rank=unset.clone(),
            token_log_probs=torch.zeros((batch, gen_length), dtype=torch.float32, device=device),
            committed=torch.zeros(batch, dtype=torch.long, device=device),
        )

    def commit(self, x0: Tensor, log_p: Tensor, scores: Tensor, k: Tensor, step: int) -> None:
        """Commit the top-``k[b]`` scored positions of each row to their sampled tokens x0 (B, G) at ``step``.

        log_p: (B, G) the tokens' log-probs; scores: (B, G) with -inf at ineligible positions; k: (B,).
        """
        chosen, order = _select(scores, k)
        self.completion = torch.where(chosen, x0.to(self.completion.dtype), self.completion)
        self.unmask_step = torch.where(chosen, step, self.unmask_step)
        self.unmask_rank = torch.where(chosen, self.committed[:, None] + order, self.unmask_rank)
        self.token_log_probs = torch.where(chosen, log_p.float(), self.token_log_probs)
        self.committed = self.committed + k

    def trajectory(self, prompt_ids: Tensor, prompt_mask: Tensor, num_steps: int) -> TokenTrajectory:
        """Return the finished record; prompts, metadata and group_ids are placeholders for the caller."""
        return TokenTrajectory(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=self.completion,
            unmask_step=self.unmask_step,
            unmask_rank=self.unmask_rank,
            token_log_probs=self.token_log_probs,
            num_steps=num_steps,
            prompts=[],
            metadata=[],
            group_ids=torch.arange(prompt_ids.shape[0], device=prompt_ids.device),
        )


def _check_args(gen_length: int, steps: int, block_length: int, remasking: str, threshold, position_scorer) -> int:
    """Validate the configuration and return the number of blocks."""
    if gen_length <= 0 or block_length <= 0 or gen_length % block_length:
        raise FlowRLError(f"gen_length ({gen_length}) must be a positive multiple of block_length ({block_length}).")
    num_blocks = gen_length // block_length
    if steps <= 0 or steps % num_blocks:
        raise FlowRLError(f"steps ({steps}) must be a positive multiple of the number of blocks ({num_blocks}).")
    if remasking not in ("low_confidence", "random", "policy"):
        raise FlowRLError(f"unknown remasking '{remasking}'; use low_confidence, random or policy.")
    if remasking == "policy" and position_scorer is None:
        raise FlowRLError("remasking 'policy' needs a position_scorer.")
    if threshold is not None and remasking != "low_confidence":
        raise FlowRLError("a confidence threshold (dynamic decoding) needs remasking 'low_confidence'.")
    return num_blocks


def check_kv_cache(lm: MaskedLM, block_length: int, kv_cache: str, remasking: str, logit_shift: bool) -> None:
    """Refuse, in one sentence, a cache setting or block length the model's attention does not allow."""
    model_block = getattr(lm, "block_length", None)
    if model_block is not None and block_length != model_block:
        raise FlowRLError(
            f"sampler.block_length ({block_length}) must equal the model's block length ({model_block}): it attends block-causally (config diffusion_block_length)."
        )
    if kv_cache == "none":
        return
    if kv_cache != "exact":
        raise FlowRLError(f"unknown kv_cache '{kv_cache}'; use none or exact.")
    if model_block is None or not getattr(lm, "supports_cache", False):
        raise FlowRLError(
            "sampler.kv_cache=exact needs a block-diffusion model (block-causal attention, config diffusion_block_length, e.g. arith_bd3lm); this one attends bidirectionally, so a cached prefix would only approximate it."
        )
    if remasking == "policy" or logit_shift:
        raise FlowRLError("sampler.kv_cache=exact works with remasking low_confidence or random and unshifted logits.")


@torch.no_grad()
def generate(
    lm: MaskedLM,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    gen_length: int,
    steps: int,
    block_length: int,
    temperature: float = 0.0,
    remasking: Remasking = "low_confidence",
    threshold: float | None = None,
    position_scorer: PositionScorer | None = None,
    logit_shift: bool = False,
    generator: torch.Generator | RowGenerators | None = None,
    kv_cache: KVCache = "none",
) -> TokenTrajectory:
    """Generate completions (B, gen_length) for prompts (B, P) by masked diffusion and record the trajectory.

    The completion is split into ``gen_length / block_length`` blocks filled left to right, each in
    ``steps / num_blocks`` steps; no position outside the current block is ever unmasked. At each step
    the model sees ``cat([prompt_ids, completion])`` with attention mask ``cat([prompt_mask, 1])``,
    tokens are drawn for every masked position with :func:`gumbel_sample` at ``temperature``, and the
    positions to commit are chosen by ``remasking`` (see the module docstring). With ``threshold`` the
    per-step count is dynamic and a block whose positions are all committed ends early: its remaining
    step indices stay unused, so ``unmask_step`` always indexes the fixed grid of ``steps`` steps.

    ``logit_shift`` applies :func:`shift_logits` to the full sequence's logits, for adapters of
    AR-adapted models (Dream) that return unshifted logits.

    Recorded per completion position: ``unmask_step`` (global step index), ``unmask_rank`` (global
    commit order; within a step descending confidence, or the Plackett-Luce order for ``policy``), and
    ``token_log_probs`` = log_softmax(logits)[token] at the commit step, i.e. the log-prob under the
    model's distribution at temperature 1, whatever temperature was used to sample (the raw softmax, the
    same quantity a trainer recomputes; the mask token, never sampled, keeps its share of the normaliser).
    ``prompts``, ``metadata`` and ``group_ids`` are placeholders the caller overwrites.

    ``kv_cache="exact"`` (block-causal models only, :func:`check_kv_cache`): the same steps, but each forward runs the
    current block alone against a cache of the prompt and the finished blocks (:func:`_generate_cached`); its
    random draws cover the current block only, so at a temperature its samples differ from ``none``'s, while the
    greedy tokens and every recorded log-prob are those of the full-sequence block-causal forward.
    """
    _check_args(gen_length, steps, block_length, remasking, threshold, position_scorer)
    check_kv_cache(lm, block_length, kv_cache, remasking, logit_shift)
    run = _Denoising(gen_length, steps, block_length, lm.mask_token_id, temperature, remasking, threshold, position_scorer, generator)
    if kv_cache == "exact":
        return _generate_cached(lm, prompt_ids, prompt_mask, run)
    schedule = transfer_schedule(block_length, run.steps_per_block)
    rec = _Recorder.start(prompt_ids, gen_length, lm.mask_token_id)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(rec.completion, dtype=prompt_mask.dtype)], dim=1)
    positions = torch.arange(gen_length, device=prompt_ids.device)
    for block in range(run.num_blocks):
        in_block = (positions >= block * block_length) & (positions < (block + 1) * block_length)
        for s in range(run.steps_per_block):
            eligible = (rec.unmask_step < 0) & in_block
            if run.skips(eligible, schedule[s]):
                continue  # nothing to commit: skip the forward pass
            logits = lm.logits(torch.cat([prompt_ids, rec.completion], dim=1), attention_mask=attention_mask)
            logits = (shift_logits(logits) if logit_shift else logits)[:, prompt_ids.shape[1] :]
            x0, log_p, scores, k = run.step(logits, rec.completion, eligible, schedule[s], s == run.steps_per_block - 1)
            rec.commit(x0, log_p, scores, k, block * run.steps_per_block + s)
    return rec.trajectory(prompt_ids, prompt_mask, steps)


def _generate_cached(lm: MaskedLM, prompt_ids: Tensor, prompt_mask: Tensor, run: _Denoising) -> TokenTrajectory:
    """:func:`generate` with the prompt and finished blocks in a key-value cache (block-causal models).

    One forward puts the prompt in the cache. Each step then runs only the current block's tokens; the first step of
    a block also runs the block just finished (clean), which appends its keys and values to the cache, so finishing a
    block costs no extra forward. After each step the current block's own keys and values are dropped again, since
    its tokens change. Block-causal attention makes every kept key and value exactly what the full sequence gives.
    """
    block_length, gen_length, P = run.block_length, run.gen_length, prompt_ids.shape[1]
    schedule = transfer_schedule(block_length, run.steps_per_block)
    rec = _Recorder.start(prompt_ids, gen_length, lm.mask_token_id)
    keys = torch.cat([prompt_mask, torch.ones_like(rec.completion, dtype=prompt_mask.dtype)], dim=1)
    cache = lm.new_cache()
    lm.cached_logits(prompt_ids, keys[:, :P], cache)
    finished = 0  # completion positions whose keys and values are in the cache
    for block in range(run.num_blocks):
        lo, hi = block * block_length, (block + 1) * block_length
        for s in range(run.steps_per_block):
            eligible = rec.unmask_step[:, lo:hi] < 0
            if run.skips(eligible, schedule[s]):
                continue
            logits = lm.cached_logits(rec.completion[:, finished:hi], keys[:, : P + hi], cache)[:, -block_length:]
            lm.drop_from_cache(cache, block_length)  # keep the finished block just run, drop the current one
            finished = lo
            x0, log_p, scores, k = run.step(logits, rec.completion[:, lo:hi], eligible, schedule[s], s == run.steps_per_block - 1)
            rec.commit(
                _widen(x0, lo, gen_length, 0),
                _widen(log_p, lo, gen_length, 0.0),
                _widen(scores, lo, gen_length, float("-inf")),
                k,
                block * run.steps_per_block + s,
            )
    return rec.trajectory(prompt_ids, prompt_mask, run.steps)


def _widen(block_values: Tensor, start: int, length: int, fill: float) -> Tensor:
    """(B, length) holding ``block_values`` (B, n) at [start, start + n) and ``fill`` elsewhere."""
    out = block_values.new_full((block_values.shape[0], length), fill)
    out[:, start : start + block_values.shape[1]] = block_values
    return out


def decode_completions(tokenizer, completion_ids: Tensor, eos_token_id: int | None) -> list[str]:
    """Decode completions (B, G) to text, cutting each row at its first EOS and skipping special tokens.

    Everything after the first EOS is discarded (LLaDA fills the tail of a short answer with EOS, and a
    model may write text after it that is not part of the answer).
    """
    texts = []
    for row in completion_ids.tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


__all__: Sequence[str] = ["check_kv_cache", "decode_completions", "generate", "gumbel_sample", "shift_logits", "transfer_schedule"]


class MaskedSamplerConfig(SamplerSection):
    """LLaDA-style masked-diffusion generation: ``sampler.name: masked`` for diffusion LMs. The section itself is
    what generation reads (:func:`flowrl.samplers.text_generation.generate_texts`)."""

    name: str = "masked"
    gen_length: int = Field(16, ge=1, description="Tokens generated per completion (a multiple of block_length).")
    steps: int = Field(8, ge=1, description="Denoising steps per completion, shared equally by its blocks.")
    block_length: int = Field(16, ge=1, description="Tokens per semi-autoregressive block, filled in one after the other.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of the tokens in rollouts (> 0 for diverse groups).")
    eval_temperature: float = Field(0.0, ge=0, description="Sampling temperature in evaluation; 0: greedy.")
    remasking: Remasking = Field(
        "low_confidence",
        description="Which masked positions a step commits: the most confident, random ones, or a learned scorer's (policy, DCoLT).",
    )
    threshold: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Dynamic decoding: commit every position whose confidence is above this; None: a fixed count per step.",
    )
    logit_shift: bool = Field(False, description="Read position i's prediction at i - 1 (AR-adapted models such as Dream).")
    # exact runs only the current block: block-diffusion models only (a bidirectional prefix cannot be cached exactly)
    kv_cache: KVCache = Field(
        "none", description="exact: keep the prompt and finished blocks in a key-value cache; none: run the whole sequence."
    )
    modality: ClassVar[str] = "text"
    prediction_types: ClassVar[tuple[str, ...]] = ("masked",)

    @model_validator(mode="after")
    def _blocks(self):
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length ({self.gen_length}) must be a multiple of block_length ({self.block_length})")
        if self.steps % (self.gen_length // self.block_length):
            raise ValueError("steps must be a multiple of the number of blocks (gen_length / block_length)")
        return self

    def build(self, pipeline: Any = None) -> MaskedSamplerConfig:
        return self
