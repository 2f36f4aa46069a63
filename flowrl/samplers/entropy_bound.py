"""DiffusionGemma's entropy-bound sampler (``transformers`` ``DiffusionGemmaGenerationMixin.generate``), recorded
into a :class:`~flowrl.types.CanvasTrajectory` with the exact log-probability of every policy choice.

The completion is made canvas by canvas (``canvas_length`` tokens, a KV cache of the prompt and of the finished
canvases). A canvas starts as uniformly random tokens; each of at most ``steps`` denoising steps (``cur_step`` = N ..
1, temperature T = t_min + (t_max - t_min) cur_step / N) runs the decoder on the canvas and on the previous step's
temperature-scaled logits (self-conditioning), then

1. samples a token at every position from softmax(logits / T) (the *denoiser canvas*),
2. keeps the lowest-entropy positions whose cumulative entropy minus the largest kept one stays under
   ``entropy_bound`` (transformers' ``EntropyBoundSampler.accept_canvas``; at least one position),
3. re-noises every other position with a uniformly random token,
4. stops the canvas early for a row whose argmax canvas is stable and whose mean entropy is under
   ``confidence_threshold`` (``StableAndConfidentStoppingCriteria``; a stopped row is frozen).

The canvas's output is the ARGMAX of its last step's logits (not the kept tokens); a row whose canvas holds an end
token is finished, and the tokens after it (and every later canvas) become padding.

What is in the log-probability. The state a step acts on is (canvas, self-conditioning logits); the next state's
canvas is the kept tokens at the kept positions and uniform noise elsewhere. So the exact transition probability is

    p(next | state) = prod_{i kept} softmax(logits_i / T)[token_i] * prod_{i not kept} 1 / V,

where which positions are kept is a deterministic function of the same logits. flowrl records, per step,
``sum_{i kept} log softmax(logits_i / T)[token_i]``: the policy's own choice. Left out: the 1 / V factors (uniform
re-noising is environment noise, independent of the weights), the selection of the kept positions and the stopping
decision (deterministic functions of the logits, piecewise constant in the weights: their gradient is zero almost
everywhere; re-scoring keeps the rollout's kept positions, which at unchanged weights are the ones the new logits
select, so the ratio is exactly 1), and the canvas output (the argmax, deterministic). Only steps whose kept tokens
reach the output count (``CanvasTrajectory.counted``): not a canvas's last executed step for a row (its sampled tokens
are discarded, the argmax is the output), not a frozen row's steps, not the canvases after a row's end token.
Re-scoring (:func:`step_log_probs`) replays the self-conditioning chain under the current weights, so the ratio is
the exact ratio of the two policies' transition probabilities and its gradient the exact score function (through the
self-conditioning inputs and the prompt's KV cache too).

Random draws. With one ``torch.Generator`` (or None: torch's global generator) every draw is generate's own call in
its order and shapes (``randint`` for the initial canvas, ``multinomial`` for the denoiser canvas, ``randint`` for the
re-noising, over the whole batch), so ``torch.manual_seed(s); model.generate(...)`` and this sampler with
``torch.Generator().manual_seed(s)`` give the same tokens (tested). With :class:`~flowrl.seeding.RowGenerators` (training
rollouts, evaluation) row b draws from its own stream only (the token by inverse CDF from one uniform per position),
and a frozen row draws nothing: a completion does not depend on the batch it is generated in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import Tensor

from ..sections import SamplerSection
from ..seeding import RowGenerators
from ..types import CanvasTrajectory
from .masked import _token_log_probs

Generator = torch.Generator | RowGenerators | None


@dataclass(frozen=True)
class EntropyBoundSettings:
    """The resolved settings of one generation (the section's, the checkpoint's generation config, transformers'
    defaults, in that order), kept with the record so re-scoring replays the same schedule."""

    gen_length: int  # max_new_tokens
    steps: int  # max_denoising_steps per canvas
    canvas_length: int
    vocab_size: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int | None
    confidence_threshold: float | None
    eos_token_ids: tuple[int, ...] | None
    pad_token_id: int | None

    @property
    def num_blocks(self) -> int:
        return math.ceil(self.gen_length / self.canvas_length)

    @property
    def completion_length(self) -> int:
        return self.num_blocks * self.canvas_length


def resolve_settings(lm, section: EntropyBoundSamplerConfig, temperature: float = 1.0) -> EntropyBoundSettings:
    """The settings ``generate`` would use with the section's non-None values as its keyword arguments; the
    temperature schedule scaled by ``temperature`` (1: the schedule itself)."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig as HFSamplerConfig

    overrides = {
        "max_new_tokens": section.gen_length,
        "max_denoising_steps": section.steps,
        "sampler_config": None if section.entropy_bound is None else HFSamplerConfig(entropy_bound=float(section.entropy_bound)),
        "t_min": section.t_min,
        "t_max": section.t_max,
        "stability_threshold": section.stability_threshold,
        "confidence_threshold": section.confidence_threshold,
    }
    config = lm.generation_config(**{k: v for k, v in overrides.items() if v is not None})
    eos = config.eos_token_id
    eos = None if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return EntropyBoundSettings(
        gen_length=int(config.max_new_tokens),
        steps=int(config.max_denoising_steps),
        canvas_length=lm.canvas_length,
        vocab_size=lm.vocab_size,
        entropy_bound=float(config.sampler_config.entropy_bound),
        t_min=config.t_min * temperature,
        t_max=config.t_max * temperature,
        stability_threshold=config.stability_threshold,
        confidence_threshold=config.confidence_threshold,
        eos_token_ids=eos,
        pad_token_id=config.pad_token_id,
    )


class _Tools:
    """transformers' own deterministic pieces of the step: the temperature schedule, the entropy-bound selection and
    the stopping criterion (stateful: reset at every canvas)."""

    def __init__(self, settings: EntropyBoundSettings):
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            EntropyBoundSampler,
            EntropyBoundSamplerConfig,
            LinearTemperatureScheduleLogitsProcessor,
            StableAndConfidentStoppingCriteria,
        )

        self.temperature = LinearTemperatureScheduleLogitsProcessor(settings.t_min, settings.t_max, settings.steps)
        self.selection = EntropyBoundSampler(
            EntropyBoundSamplerConfig(entropy_bound=settings.entropy_bound), settings.canvas_length, settings.vocab_size, settings.steps
        )
        has_stop = settings.stability_threshold is not None and settings.confidence_threshold is not None
        self.stopper = StableAndConfidentStoppingCriteria(settings.stability_threshold, settings.confidence_threshold) if has_stop else None

    def scaled(self, raw_logits: Tensor, cur_step: int) -> Tensor:
        """logits / T at ``cur_step`` (steps remaining), computed as generate computes it (an int32 step tensor)."""
        step = torch.tensor(cur_step, device=raw_logits.device, dtype=torch.int32)
        return self.temperature(None, raw_logits, cur_step=step)

    def kept(self, canvas: Tensor, processed: Tensor, cur_step: int) -> Tensor:
        """(B, L) bool: the positions the entropy bound keeps (a function of the logits alone)."""
        step = torch.tensor(cur_step, device=processed.device, dtype=torch.int32)
        self.selection.accept_canvas(canvas, canvas, processed, step)
        return self.selection.accepted_token_mask


def _random_tokens(shape: tuple[int, int], vocab: int, generator: Generator, rows: Tensor, device: torch.device) -> Tensor:
    """Uniform tokens (B, L): generate's ``torch.randint`` over the batch, or row b's own stream for the ``rows`` that draw."""
    if isinstance(generator, RowGenerators):
        out = torch.zeros(shape, dtype=torch.long)
        for b in torch.nonzero(rows.cpu()).flatten().tolist():
            out[b] = torch.randint(0, vocab, shape[1:], generator=generator.generators[b])
        return out.to(device)
    gen_device = generator.device if generator is not None else device
    return torch.randint(0, vocab, shape, generator=generator, device=gen_device).to(device)


def _sample_tokens(probs: Tensor, generator: Generator, rows: Tensor) -> Tensor:
    """A token per position from probs (B, L, V): generate's ``torch.multinomial`` over the flattened batch, or, per
    row stream, the inverse CDF at one uniform per position (the same distribution, one draw per token)."""
    batch, length, vocab = probs.shape
    if isinstance(generator, RowGenerators):
        out = torch.zeros((batch, length), dtype=torch.long, device=probs.device)  # a row that does not draw: unused
        for b in torch.nonzero(rows.cpu()).flatten().tolist():  # one row's float64 CDF at a time (L x V, not B x L x V)
            u = 1.0 - torch.rand((length,), generator=generator.generators[b], dtype=torch.float64)  # (0, 1]
            cdf = probs[b].to(torch.float64).cumsum(-1)
            target = u.to(probs.device)[:, None] * cdf[:, -1:]
            out[b] = torch.searchsorted(cdf, target).squeeze(-1).clamp_max(vocab - 1)
        return out
    flat = probs.view(-1, vocab)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(flat.to(generator.device), 1, generator=generator).to(probs.device).view(batch, length)
    return torch.multinomial(flat, 1, generator=generator).view(batch, length)


@dataclass
class CanvasState:
    """What one denoising step reads and writes for a batch of rows."""

    canvas: Tensor  # (B, L) the tokens the decoder sees
    argmax: Tensor  # (B, L) the argmax of the latest logits: the canvas's output if it stopped now
    self_conditioning: Tensor | None  # (B, L, V) the previous step's logits / T (None at a canvas's first step)
    frozen: Tensor  # (B,) bool: stopped early (the stopping criterion), state kept as it is

    def rows(self, index: Tensor) -> CanvasState:
        sc = None if self.self_conditioning is None else self.self_conditioning[index]
        return CanvasState(self.canvas[index], self.argmax[index], sc, self.frozen[index])


@dataclass
class StepOutcome:
    state: CanvasState  # after the step
    kept: Tensor  # (B, L) bool
    log_prob: Tensor  # (B,) float64: sum of the kept tokens' log softmax(logits / T)
    processed: Tensor  # (B, L, V) this step's logits / T


def denoising_step(
    tools: _Tools, settings: EntropyBoundSettings, raw_logits: Tensor, state: CanvasState, cur_step: int, generator: Generator, dtype
) -> StepOutcome:
    """One step of ``DiffusionGemmaGenerationMixin._denoising_step`` from the decoder's logits (B, L, V), with its
    random draws from ``generator`` (module docstring) and the kept tokens' log-probability recorded."""
    processed = tools.scaled(raw_logits, cur_step)
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    drawing = ~state.frozen
    denoiser = _sample_tokens(probs, generator, drawing)
    new_argmax = torch.argmax(processed, dim=-1)
    kept = tools.kept(state.canvas, processed, cur_step)
    log_prob = (_token_log_probs(processed, denoiser) * kept).sum(-1)
    noise = _random_tokens(tuple(state.canvas.shape), settings.vocab_size, generator, drawing, state.canvas.device)
    new_canvas = torch.where(kept, denoiser, noise)
    frozen, scaled = state.frozen, processed
    if tools.stopper is not None:
        if frozen.any():  # a stopped row keeps its output, canvas and self-conditioning, as generate keeps them
            new_argmax = torch.where(frozen[:, None], state.argmax, new_argmax)
            new_canvas = torch.where(frozen[:, None], state.canvas, new_canvas)
            scaled = torch.where(frozen[:, None, None], state.self_conditioning, processed)
        frozen = frozen | tools.stopper(new_argmax, scaled)
    return StepOutcome(CanvasState(new_canvas, new_argmax, scaled.to(dtype), frozen), kept, log_prob, processed)


def finish_canvas(canvas: Tensor, finished: Tensor, settings: EntropyBoundSettings) -> tuple[Tensor, Tensor, Tensor]:
    """generate's ``_finalize_canvas`` on a canvas's output (B, L): rows whose canvas holds an end token are finished;
    earlier-finished rows' canvas and every token after a row's first end token become padding. Returns (canvas,
    finished, finished before this canvas)."""
    before = finished
    if settings.eos_token_ids is None:
        return canvas, finished, before
    eos = torch.tensor(settings.eos_token_ids, device=canvas.device)
    now = torch.isin(canvas, eos).any(-1)
    finished = before | now
    if settings.pad_token_id is not None and finished.any():
        canvas = canvas.clone()
        canvas[before] = settings.pad_token_id
        if now.any():
            is_eos = torch.isin(canvas, eos)
            count = is_eos.cumsum(dim=-1)
            canvas[(count > 0) & ~((count == 1) & is_eos)] = settings.pad_token_id
    return canvas, finished, before


class _Record:
    """The growing record: every step's input canvas, kept positions, frozen rows and kept-token log-probs."""

    def __init__(self, batch: int, settings: EntropyBoundSettings, device: torch.device):
        s, length = settings.num_blocks * settings.steps, settings.canvas_length
        filler = settings.pad_token_id if settings.pad_token_id is not None else (settings.eos_token_ids or (0,))[0]
        self.canvases = torch.zeros((batch, s, length), dtype=torch.long, device=device)
        self.kept = torch.zeros((batch, s, length), dtype=torch.bool, device=device)
        self.frozen = torch.ones((batch, s), dtype=torch.bool, device=device)  # a step never run counts as frozen
        self.log_probs = torch.zeros((batch, s), dtype=torch.float64, device=device)
        self.done_before = torch.zeros((batch, settings.num_blocks), dtype=torch.bool, device=device)
        self.completion = torch.full((batch, settings.completion_length), filler, dtype=torch.long, device=device)

    def step(self, s: int, state: CanvasState, outcome: StepOutcome) -> None:
        self.canvases[:, s], self.frozen[:, s] = state.canvas, state.frozen
        self.kept[:, s], self.log_probs[:, s] = outcome.kept, outcome.log_prob

    def trajectory(self, prompt_ids: Tensor, prompt_mask: Tensor, settings: EntropyBoundSettings) -> CanvasTrajectory:
        return CanvasTrajectory(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=self.completion,
            canvases=self.canvases,
            kept=self.kept,
            frozen=self.frozen,
            counted=counted_steps(self.frozen, self.done_before, settings.steps),
            step_log_probs=self.log_probs,
            settings=settings,
            prompts=[],
            metadata=[],
            group_ids=torch.arange(prompt_ids.shape[0], device=prompt_ids.device),
        )


def counted_steps(frozen: Tensor, done_before: Tensor, steps: int) -> Tensor:
    """(B, S) bool: the steps whose kept tokens reach the output. Step s of a canvas counts when the row runs it and
    also runs step s + 1 of the same canvas (which reads them), in a canvas that starts before the row's end token."""
    batch, total = frozen.shape
    runs = ~frozen.view(batch, -1, steps)
    reads_next = torch.zeros_like(runs)
    reads_next[..., :-1] = runs[..., 1:]
    return (runs & reads_next & ~done_before[..., None]).view(batch, total)


@torch.no_grad()
def generate(lm, prompt_ids: Tensor, prompt_mask: Tensor, settings: EntropyBoundSettings, generator: Generator = None) -> CanvasTrajectory:
    """Generate completions (B, ``settings.completion_length``) for left-padded prompts (B, P) as
    ``DiffusionGemmaGenerationMixin.generate`` does, and record the trajectory (module docstring). Canvases never run
    (every row finished) are padding in ``completion_ids``."""
    batch, device = prompt_ids.shape[0], prompt_ids.device
    tools, rec = _Tools(settings), _Record(batch, settings, device)
    session = lm.session(prompt_ids, prompt_mask)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    everyone = torch.ones(batch, dtype=torch.bool, device=device)
    length = settings.canvas_length
    for block in range(settings.num_blocks):
        session.encode()
        canvas = _random_tokens((batch, length), settings.vocab_size, generator, everyone, device)
        state = CanvasState(canvas, canvas, None, torch.zeros(batch, dtype=torch.bool, device=device))
        if tools.stopper is not None:
            tools.stopper.reset()
        for j, cur_step in enumerate(range(settings.steps, 0, -1)):
            outcome = denoising_step(
                tools, settings, session.denoise(state.canvas, state.self_conditioning), state, cur_step, generator, session.embedding_dtype
            )
            rec.step(block * settings.steps + j, state, outcome)
            state = outcome.state
            if state.frozen.all():
                break
        out, finished, rec.done_before[:, block] = finish_canvas(state.argmax, finished, settings)
        rec.completion[:, block * length : (block + 1) * length] = out
        if finished.all():
            break
        session.finish_canvas(out)
    return rec.trajectory(prompt_ids, prompt_mask, settings)


def step_log_probs(lm, traj: CanvasTrajectory) -> Tensor:
    """(B, S) float64: every counted step's kept-token log-probability under ``lm``'s current weights (0 elsewhere),
    replaying the recorded canvases with the self-conditioning chain recomputed; differentiable when grad is on."""
    settings, steps, length = traj.settings, traj.settings.steps, traj.settings.canvas_length
    tools = _Tools(settings)
    session = lm.session(traj.prompt_ids, traj.prompt_mask)
    batch, total = traj.counted.shape
    columns: list[Tensor] = [traj.step_log_probs.new_zeros(batch)] * total
    for block in range(settings.num_blocks):
        counted = traj.counted[:, block * steps : (block + 1) * steps]
        if not traj.counted[:, block * steps :].any():
            break  # nothing later reaches the output
        session.encode()
        sc = None
        last = int(torch.nonzero(counted.any(0)).max()) if counted.any() else -1
        for j in range(last + 1):
            s = block * steps + j
            processed = tools.scaled(session.denoise(traj.canvases[:, s], sc), steps - j)
            columns[s] = (_token_log_probs(processed, traj.canvases[:, s + 1]) * (traj.kept[:, s] & counted[:, j, None])).sum(-1)
            frozen = traj.frozen[:, s]
            sc = (torch.where(frozen[:, None, None], sc, processed) if sc is not None and frozen.any() else processed).to(
                session.embedding_dtype
            )
        session.finish_canvas(traj.completion_ids[:, block * length : (block + 1) * length])
    return torch.stack(columns, 1)


def decode_completions(tokenizer, completion_ids: Tensor, eos_token_ids: Sequence[int] | None) -> list[str]:
    """Decode completions (B, G), each cut at its first end token, special tokens skipped."""
    texts = []
    for row in completion_ids.tolist():
        cut = [i for i, t in enumerate(row) if eos_token_ids and t in eos_token_ids]
        texts.append(tokenizer.decode(row[: cut[0]] if cut else row, skip_special_tokens=True))
    return texts


class EntropyBoundSamplerConfig(SamplerSection):
    """``sampler.name: entropy_bound``: DiffusionGemma's own sampler (pipeline diffusion_gemma). A None setting is
    the checkpoint's generation config, else transformers' default (48 steps, entropy bound 0.1, t 0.8 -> 0.4,
    stability 1, confidence 0.005, 256 new tokens)."""

    name: str = "entropy_bound"
    gen_length: int | None = Field(None, ge=1, description="New tokens generated at most (max_new_tokens).")
    steps: int | None = Field(None, ge=1, description="Denoising steps per canvas at most (max_denoising_steps).")
    entropy_bound: float | None = Field(
        None, gt=0, description="A step keeps the lowest-entropy positions whose summed entropy stays under this."
    )
    t_min: float | None = Field(None, ge=0, description="Temperature at a canvas's last step (the schedule falls from t_max).")
    t_max: float | None = Field(None, gt=0, description="Temperature at a canvas's first step.")
    stability_threshold: int | None = Field(
        None, ge=0, description="Stop a canvas early once its argmax canvas stayed unchanged this many steps (and is confident)."
    )
    confidence_threshold: float | None = Field(
        None, gt=0, description="Stop a canvas early when its mean entropy is under this (and it is stable)."
    )
    # DiffusionGemma has no greedy mode (the canvases are always sampled, the output is the last step's argmax), so
    # evaluation samples too.
    temperature: float = Field(1.0, gt=0, description="Factor on the temperature schedule in rollouts (1: generate's own).")
    eval_temperature: float = Field(1.0, gt=0, description="Factor on the temperature schedule in evaluation (1: generate's own).")
    remasking: ClassVar[str] = "entropy_bound"  # what decides the kept tokens (read where the masked sampler's rule is)
    modality: ClassVar[str] = "text"

    @model_validator(mode="after")
    def _schedule(self):
        if self.t_min is not None and self.t_max is not None and self.t_max <= self.t_min:
            raise ValueError(f"t_max ({self.t_max}) must be above t_min ({self.t_min}): the temperature falls from t_max to t_min")
        return self

    def check_run(self, config: Any) -> None:
        if config.pipeline.name != "diffusion_gemma":
            raise ValueError(f"sampler entropy_bound is DiffusionGemma's (pipeline.name diffusion_gemma), not '{config.pipeline.name}''s")
        if config.objective.name != "step_grpo":
            raise ValueError(
                f"sampler entropy_bound trains with objective.name step_grpo (exact per-step log-probs), not '{config.objective.name}': "
                "the masked-diffusion estimators assume an absorbing mask token"
            )

    def build(self, pipeline: Any = None) -> EntropyBoundSamplerConfig:
        return self


__all__: Sequence[str] = [
    "CanvasState",
    "EntropyBoundSamplerConfig",
    "EntropyBoundSettings",
    "counted_steps",
    "decode_completions",
    "denoising_step",
    "finish_canvas",
    "generate",
    "resolve_settings",
    "step_log_probs",
]
