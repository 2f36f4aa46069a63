"""Counted cost of an inference-time search: denoiser calls and rows, verifier calls and rows, and wall seconds split
into denoiser and verifier, measured (never derived from a formula) by wrapping the model and the reward a search runs.

Flash-BoN's point (arXiv 2607.04461) is that a search that looks better per denoiser call can lose once the
verifier's own time is counted; so every ``flowrl eval`` search reports all of these (``SearchCost.record``).

What is counted where:

* denoiser: ``pipeline.predict`` (image / video: one row = one sample through the model once, the classifier-free
  guidance pair counted as one row, as the papers count NFEs) or ``lm.logits`` (diffusion LMs: one row = one sequence
  through the model once). A call is one batched forward.
* verifier: the reward (image / video: ``reward(samples, prompts, metadata)``) or a diffusion LM's selection score
  (``--select``: likelihood, which reads log-probs already computed, or a reward), one row = one candidate scored.
  The VAE / frame decode (``pipeline.decode``) is timed as verifier time: a search decodes only to show the
  verifier pixels (the last decode of the returned samples is in it too, a single batch).
  A diffusion LM's held-out grader (which reads the gold answer) measures, it never selects, so it is not counted.
* wall: the whole search, measured around it; ``other_seconds`` = wall - denoiser - verifier (sampler steps,
  noise, bookkeeping).
* CPU seconds (``time.process_time``, this process's CPU time, every thread) beside each wall time: on a CPU shared
  with other jobs the wall clock also counts the time others held the cores, the CPU time only this search's work
  (on a GPU the wall times are the ones to read).

Rows include the padding rows a search runs to keep its batch shapes fixed (what was paid). On a GPU the clock is
read after a ``torch.cuda.synchronize`` so that asynchronous kernels land in the part that launched them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def _sync(t) -> None:
    if isinstance(t, torch.Tensor) and t.is_cuda:
        torch.cuda.synchronize(t.device)


@dataclass
class SearchCost:
    """Totals over one search; ``record(items)`` is what ``flowrl eval`` prints (per item and in total)."""

    denoiser_calls: int = 0
    denoiser_rows: int = 0
    verifier_calls: int = 0
    verifier_rows: int = 0
    denoiser_seconds: float = 0.0
    verifier_seconds: float = 0.0
    wall_seconds: float = 0.0
    denoiser_cpu_seconds: float = 0.0
    verifier_cpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    _start: tuple[float, float] | None = field(default=None, repr=False)

    def __enter__(self) -> SearchCost:
        self._start = (time.perf_counter(), time.process_time())
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_seconds += time.perf_counter() - self._start[0]
        self.cpu_seconds += time.process_time() - self._start[1]

    def add(self, part: str, wall: float, cpu: float) -> None:
        """Time spent in the denoiser or the verifier (``part``)."""
        setattr(self, f"{part}_seconds", getattr(self, f"{part}_seconds") + wall)
        setattr(self, f"{part}_cpu_seconds", getattr(self, f"{part}_cpu_seconds") + cpu)

    def record(self, items: int) -> dict:
        """Per item (mean over the ``items`` searched) and totals. Counts are exact integers of this run; seconds
        are this machine's and are never part of an evaluation spec's compared result."""
        other = max(0.0, self.wall_seconds - self.denoiser_seconds - self.verifier_seconds)
        return {
            "items": items,
            "denoiser_rows_per_item": round(self.denoiser_rows / items, 4),
            "verifier_rows_per_item": round(self.verifier_rows / items, 4),
            "denoiser_seconds_per_item": round(self.denoiser_seconds / items, 6),
            "verifier_seconds_per_item": round(self.verifier_seconds / items, 6),
            "wall_seconds_per_item": round(self.wall_seconds / items, 6),
            "denoiser_calls": self.denoiser_calls,
            "denoiser_rows": self.denoiser_rows,
            "verifier_calls": self.verifier_calls,
            "verifier_rows": self.verifier_rows,
            "denoiser_seconds": round(self.denoiser_seconds, 6),
            "verifier_seconds": round(self.verifier_seconds, 6),
            "other_seconds": round(other, 6),
            "wall_seconds": round(self.wall_seconds, 6),
            "denoiser_cpu_seconds_per_item": round(self.denoiser_cpu_seconds / items, 6),
            "verifier_cpu_seconds_per_item": round(self.verifier_cpu_seconds / items, 6),
            "cpu_seconds_per_item": round(self.cpu_seconds / items, 6),
        }


class _Proxy:
    """Every attribute of the wrapped object, some methods metered."""

    def __init__(self, inner, cost: SearchCost) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_cost", cost)

    def _timed(self, part: str, fn, first, *args, **kwargs):
        """``fn(first, *args, **kwargs)``, its wall and CPU time added to ``part`` (GPU work finished on both sides)."""
        _sync(first)
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn(first, *args, **kwargs)
        _sync(getattr(out, "scores", out))
        self._cost.add(part, time.perf_counter() - wall, time.process_time() - cpu)
        return out

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value) -> None:
        setattr(self._inner, name, value)


class MeteredPipeline(_Proxy):
    """An image / video pipeline whose ``predict`` is denoiser work and whose ``decode`` is verifier work."""

    def predict(self, x, *args, **kwargs):
        self._cost.denoiser_calls += 1
        self._cost.denoiser_rows += x.shape[0]
        return self._timed("denoiser", self._inner.predict, x, *args, **kwargs)

    def decode(self, x):
        return self._timed("verifier", self._inner.decode, x)


class MeteredLM(_Proxy):
    """A masked diffusion LM whose ``logits`` forward is denoiser work."""

    def logits(self, ids, *args, **kwargs):
        self._cost.denoiser_calls += 1
        self._cost.denoiser_rows += ids.shape[0]
        return self._timed("denoiser", self._inner.logits, ids, *args, **kwargs)

    def session(self, *args, **kwargs):
        """DiffusionGemma's block loop (pipelines/diffusion_gemma.py): its decoder calls on a canvas are the denoiser
        work (one row = one canvas through the decoder once); the encoder's pass per finished canvas is in other_seconds."""
        return _MeteredSession(self._inner.session(*args, **kwargs), self._cost)


class _MeteredSession(_Proxy):
    def denoise(self, canvas, *args, **kwargs):
        self._cost.denoiser_calls += 1
        self._cost.denoiser_rows += canvas.shape[0]
        return self._timed("denoiser", self._inner.denoise, canvas, *args, **kwargs)


class MeteredVerifier(_Proxy):
    """A reward or a selection score: each call is verifier work, its rows the candidates it scored (the first argument)."""

    def __call__(self, candidates, *args, **kwargs):
        self._cost.verifier_calls += 1
        self._cost.verifier_rows += len(candidates)
        return self._timed("verifier", self._inner, candidates, *args, **kwargs)


def metered(cost: SearchCost, pipeline=None, lm=None, verifiers=()) -> tuple:
    """The metered stand-ins (the same objects underneath) for what a search runs: ``(pipeline or lm, *verifiers)``."""
    model = MeteredPipeline(pipeline, cost) if pipeline is not None else MeteredLM(lm, cost)
    return (model, *[MeteredVerifier(v, cost) for v in verifiers])
