"""What each sampling path actually ran with, recorded while it runs: the rollout, the evaluation, ``Trainer.sample``
and ``flowrl sample``.

The settings are read from the calls the model received, not from the config: an image model's ``predict(x, sigma,
cond, guidance_scale)`` is the one place every path passes its time grid, its guidance and its latent shape through,
and ``unconditional`` is where CFG's other branch comes from (the prompt it encodes is the negative prompt: the
empty prompt, or a family's ``pipeline.negative_prompt``). A diffusion
LM's paths all call ``modality.generate(prompts, temperature, generator)``; its output says the steps and length it
ran. A path that dropped or changed a setting on its way to the model shows it here, whatever its config said.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Call:
    sigma: float
    guidance_scale: float
    latent_shape: tuple[int, ...]
    guidance_mode: str


@dataclass
class Recording:
    """The calls one path made: ``predict`` calls (images) or ``generate`` calls (text), and the unconditional
    conditions CFG asked for (a fingerprint each)."""

    calls: list[Call] = field(default_factory=list)
    unconditional: list[str] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)


class PathRecorder:
    """Records, per named path, what the model was called with; ``path(name)`` says which path is running."""

    def __init__(self):
        self.recordings: dict[str, Recording] = {}
        self.current: str | None = None

    @contextlib.contextmanager
    def path(self, name: str) -> Iterator[Recording]:
        previous, self.current = self.current, name
        try:
            yield self.recordings.setdefault(name, Recording())
        finally:
            self.current = previous

    def _recording(self) -> Recording | None:
        return self.recordings.setdefault(self.current, Recording()) if self.current is not None else None

    @contextlib.contextmanager
    def on_images(self, pipeline: Any) -> Iterator[None]:
        """Record ``pipeline.predict`` and ``pipeline.unconditional`` (instance attributes over the class's methods,
        removed afterwards)."""
        predict, unconditional, encode = pipeline.predict, getattr(pipeline, "unconditional", None), pipeline.encode
        negative: list[str] = []  # the prompts CFG's branch encodes, while it is being built

        def recorded_predict(x, sigma, cond, *args, **kwargs):
            rec = self._recording()
            if rec is not None and torch.as_tensor(sigma).numel() == 1:  # a per-sample sigma is a training-time draw
                scale = args[0] if args else kwargs.get("guidance_scale", 1.0)
                mode = str(getattr(pipeline, "guidance_mode", "cfg"))
                rec.calls.append(Call(float(sigma), float(scale), tuple(x.shape[1:]), mode))
            return predict(x, sigma, cond, *args, **kwargs)

        def recorded_encode(prompts, *args, **kwargs):
            negative.extend(prompts)
            return encode(prompts, *args, **kwargs)

        def recorded_unconditional(*args, **kwargs):
            negative.clear()
            pipeline.encode = recorded_encode
            try:
                out = unconditional(*args, **kwargs)
            finally:
                del pipeline.encode
            rec = self._recording()
            if rec is not None:  # the text it encoded, else (a family that builds it otherwise) a digest of it
                rec.unconditional.append(repr(negative[0]) if negative else f"a condition ({_fingerprint(out)})")
            return out

        pipeline.predict = recorded_predict
        if unconditional is not None:
            pipeline.unconditional = recorded_unconditional
        try:
            yield
        finally:
            for name in ("predict", "unconditional", "encode"):
                if name in vars(pipeline):
                    delattr(pipeline, name)

    @contextlib.contextmanager
    def on_text(self, modality: Any) -> Iterator[None]:
        """Record ``modality.generate``: the temperature asked for and what the generation ran (steps, length)."""
        generate = modality.generate

        def recorded_generate(prompts, temperature, generator, sampler=None):
            traj = generate(prompts, temperature, generator, sampler)
            rec = self._recording()
            if rec is not None:
                rec.generations.append(_generation(modality, traj, temperature, sampler))
            return traj

        modality.generate = recorded_generate
        try:
            yield
        finally:
            if "generate" in vars(modality):
                del modality.generate


def _fingerprint(cond: Any) -> str:
    """A short digest of a condition's first row (the batch repeats it): equal conditions give equal strings."""
    tensors = cond.values() if isinstance(cond, dict) else [cond]
    total = sum(float(t[:1].double().sum()) for t in tensors if isinstance(t, torch.Tensor))
    shapes = [tuple(t.shape[1:]) for t in tensors if isinstance(t, torch.Tensor)]
    return f"{total:.6g} {shapes}"


def _generation(modality: Any, traj: Any, temperature: float, sampler: Any = None) -> dict[str, Any]:
    settings = getattr(traj, "settings", None)  # DiffusionGemma's resolved settings
    if settings is not None and dataclasses.is_dataclass(settings):
        resolved = {k: v for k, v in dataclasses.asdict(settings).items() if k != "temperature" and not isinstance(v, list | tuple)}
    else:
        resolved = {"steps": int(traj.num_steps), "gen_length": int(traj.completion_ids.shape[1])}
    # the settings the path handed generate_texts (the run's sampler, or an objective's own rollout sampler); what the
    # generation ran wins
    section = sampler or modality.config.sampler
    kept = {k: v for k, v in section.model_dump(mode="json").items() if k not in ("temperature", "eval_temperature", "name")}
    return {
        "sampler": section.name,
        "temperature": float(temperature),
        **{k: v for k, v in kept.items() if v is not None},
        **resolved,
        "position_scorer": modality.position_scorer is not None,
    }


# -- the settings a recording shows ----------------------------------------------------------------------------------
def first_pass(calls: list[Call]) -> list[Call]:
    """The calls of the first pass over the grid: a chunk or a branch that starts again from a noisier sigma ends it."""
    run: list[Call] = []
    for call in calls:
        if run and call.sigma > run[-1].sigma:
            break
        run.append(call)
    return run


def image_settings(rec: Recording, sampler: Any, schedule: Any) -> dict[str, Any]:
    """The settings row of one image path: its sampler, steps, time grid (against the model's schedule at that many
    steps: a dropped or changed shift shows here), guidance, guidance mode, latent shape, unconditional branch."""
    run = first_pass(rec.calls)
    if not run:
        return {}
    sigmas = [c.sigma for c in run]
    expected = [float(s) for s in schedule.sigmas(len(run))[:-1]]
    same = len(expected) == len(sigmas) and all(abs(a - b) <= 1e-6 for a, b in zip(expected, sigmas, strict=True))
    shift = getattr(schedule, "shift", None)
    grid = f"the model's schedule{f' (shift {shift:g})' if isinstance(shift, float | int) else ''}" if same else _short(sigmas)
    return {
        "sampler": describe_sampler(sampler),
        "steps": len(run),
        "time grid": grid,
        "guidance scale": _one_or_all(c.guidance_scale for c in rec.calls),
        "guidance mode": _one_or_all(c.guidance_mode for c in rec.calls),
        "latent shape": _one_or_all("x".join(map(str, c.latent_shape)) for c in rec.calls),
        "negative prompt": _one_or_all(rec.unconditional) if rec.unconditional else "none (no CFG call)",
    }


def text_settings(rec: Recording) -> dict[str, Any]:
    """The settings row of one diffusion-LM path: what its first generation ran with."""
    return dict(rec.generations[0]) if rec.generations else {}


def describe_sampler(sampler: Any) -> str:
    """``name(param=value, ...)`` of a built sampler, an ODE sampler with the family sampler it steps with."""
    if sampler is None:
        return "none"
    fields = dataclasses.fields(sampler) if dataclasses.is_dataclass(sampler) else []
    params = []
    for f in fields:
        value = getattr(sampler, f.name)
        if dataclasses.is_dataclass(value) and hasattr(value, "name"):  # a sampler inside (the ODE's family sampler)
            params.append(describe_sampler(value))
        elif isinstance(value, bool | int | float | str) or value is None:
            params.append(f"{f.name}={value}")
    return f"{sampler.name}({', '.join(params)})"


def _one_or_all(values) -> Any:
    seen = list(dict.fromkeys(values))
    return seen[0] if len(seen) == 1 else seen


def _short(sigmas: list[float]) -> str:
    shown = [f"{s:.4f}" for s in sigmas]
    return "[" + (", ".join(shown) if len(shown) <= 6 else ", ".join(shown[:3] + ["..."] + shown[-2:])) + "]"
