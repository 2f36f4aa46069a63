"""Roll a sampler out into a :class:`~flowrl.types.Trajectory`.

The loop is flowrl's, not a diffusers pipeline's ``__call__``: the pipeline only predicts, the
sampler only steps. Steps inside the SDE window are sampled stochastically and carry a log-prob;
steps outside it (MixGRPO) use the sampler's deterministic step and are not trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..seeding import RowGenerators
from ..types import Pipeline, Sampler, Trajectory


def sde_window(num_steps: int, size: int | None, start: int = 0, slide_every: int = 0, iteration: int = 0) -> Tensor:
    """Return (K,) bool: which steps are stochastic.

    ``size=None`` makes every step stochastic. Otherwise a window of ``size`` consecutive steps starting
    at ``start``; with ``slide_every > 0`` it moves one step later every ``slide_every`` iterations and
    wraps around (MixGRPO's sliding window, progressing from noise towards data).
    """
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if size is None or size >= num_steps:
        return ~mask
    shift = iteration // slide_every if slide_every > 0 else 0
    first = (start + shift) % (num_steps - size + 1)
    mask[first : first + size] = True
    return mask


def group_noise(pipeline: Pipeline, group_ids: Tensor, generator: torch.Generator, shared: bool) -> Tensor:
    """Initial noise; with ``shared`` every member of a prompt group starts from the same x_1
    (DanceGRPO ``init_same_noise``, Flow-GRPO ``same_latent``), so rewards differ only by the SDE noise."""
    if not shared:
        return pipeline.initial_noise(group_ids.shape[0], generator)
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return pipeline.initial_noise(unique.shape[0], generator)[inverse]


def keyed_noise(pipeline: Pipeline, generators: RowGenerators) -> Tensor:
    """Initial noise, row b from its own stream (rows that share a key, a group's members under
    ``same_noise_in_group``, get the same x_1), so a row's noise does not depend on its batch."""
    return torch.cat([pipeline.initial_noise(1, g) for g in generators.generators])


def start_noise(pipeline: Pipeline, count: int, generator: torch.Generator | RowGenerators) -> Tensor:
    """``count`` initial noises: from one generator in turn, or row b from per-row stream b (``keyed_noise``)."""
    if isinstance(generator, RowGenerators):
        if len(generator) != count:
            raise ValueError(f"{count} initial noises asked of {len(generator)} row streams")
        return keyed_noise(pipeline, generator)
    return pipeline.initial_noise(count, generator)


def rows_of(generator: torch.Generator | RowGenerators, index) -> torch.Generator | RowGenerators:
    """The streams of the rows ``index`` (a slice or indices): a per-row generator is cut with the batch;
    a single generator serves every chunk in turn."""
    return generator[index] if isinstance(generator, RowGenerators) else generator


def padded_rows(
    rows: list[int], size: int, generator: torch.Generator | RowGenerators
) -> tuple[list[int], torch.Generator | RowGenerators]:
    """``rows`` filled up to ``size`` with copies of the last one, and their streams (the copies draw from throw-away
    streams of their own, so the real rows' streams are not advanced): a batch of a fixed shape, whose padding the
    caller drops, so that a row's bits do not depend on how many rows share its batch."""
    full = rows + [rows[-1]] * (size - len(rows))
    streams = rows_of(generator, rows)
    if isinstance(streams, RowGenerators):
        streams = RowGenerators(streams.generators + [torch.Generator() for _ in full[len(rows) :]])
    return full, streams


def padded_samples(
    pipeline: Pipeline,
    sampler: Sampler,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    rows: list[int],
    size: int,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float,
    noise: Tensor,
) -> Tensor:
    """The samples of items ``rows`` (indices into ``prompts``, ``metadata``, ``noise`` and the streams of
    ``generator``) from their start noise, drawn in one batch of exactly ``size`` rows (``padded_rows``): what the
    held-out evaluation and every search over start noises sample, so a sample's bits do not depend on its batch."""
    everything, streams = padded_rows(rows, size, generator)
    traj = rollout(
        pipeline,
        sampler,
        [prompts[i] for i in everything],
        [metadata[i] for i in everything],
        torch.tensor(everything),
        sigmas,
        streams,
        guidance_scale,
        initial_noise=noise[everything],
    )
    return traj.samples[: len(rows)]


@torch.no_grad()
def rollout(
    pipeline: Pipeline,
    sampler: Sampler,
    prompts: Sequence[str],
    metadata: Sequence[dict[str, Any]],
    group_ids: Tensor,
    sigmas: Tensor,
    generator: torch.Generator | RowGenerators,
    guidance_scale: float = 1.0,
    stochastic_steps: Tensor | None = None,
    initial_noise: Tensor | None = None,
    same_noise_in_group: bool = True,
    decode: bool = True,
    record_means: bool = False,
) -> Trajectory:
    """Sample B trajectories and record every state and transition log-prob.

    sigmas: (K+1,) time grid from 1 (noise) to 0. stochastic_steps: (K,) bool; default all steps when
    the sampler is stochastic. A step whose transition std is 0 (e.g. CPS or DDIM into sigma = 0) is
    recorded as deterministic. ``decode=False`` leaves ``samples`` as the final latents (a B2-DiffuRL
    prefix that only its branches continue, so a VAE decode would be wasted). ``record_means``: also keep
    the mean each stochastic step was sampled from (``Trajectory.step_means``; GRPO-Guard's exact shift).
    """
    num_steps = sigmas.shape[0] - 1
    if stochastic_steps is None:
        stochastic_steps = torch.full((num_steps,), sampler.stochastic, dtype=torch.bool)
    stochastic_steps = stochastic_steps.clone() & sampler.stochastic
    # image-to-video adapters condition on metadata too (the first frame): they set needs_metadata
    cond = pipeline.encode(list(prompts), list(metadata)) if getattr(pipeline, "needs_metadata", False) else pipeline.encode(list(prompts))
    if initial_noise is None and isinstance(generator, RowGenerators):
        raise ValueError("rollout with per-row generators needs initial_noise (keyed_noise)")
    x = initial_noise if initial_noise is not None else group_noise(pipeline, group_ids, generator, same_noise_in_group)
    x = x.float()
    states, log_probs, means = [x], [], []
    for k in range(num_steps):
        sigma, sigma_next = sigmas[k], sigmas[k + 1]
        model_output = pipeline.predict(x, sigma, cond, guidance_scale)
        log_prob = None
        if stochastic_steps[k]:
            out = sampler.step(model_output, x, sigma, sigma_next, generator=generator)
            x, log_prob = out.x_next, out.log_prob
            if record_means and log_prob is not None:
                means.append(out.mean)
        else:
            x = sampler.deterministic_step(model_output, x, sigma, sigma_next)
        if log_prob is None:
            stochastic_steps[k] = False
            log_prob = torch.full((x.shape[0],), float("nan"), device=x.device)
        states.append(x)
        log_probs.append(log_prob)
    return Trajectory(
        latents=torch.stack(states, dim=1),  # (B, K+1, *S)
        sigmas=sigmas,
        log_probs=torch.stack(log_probs, dim=1),  # (B, K)
        stochastic=stochastic_steps,
        cond=cond,
        prompts=list(prompts),
        metadata=[dict(m) for m in metadata],
        group_ids=group_ids,
        samples=pipeline.decode(x) if decode else x,
        step_means=recorded_means(means, states[0]) if record_means else None,
        guidance_scale=guidance_scale,
    )


def recorded_means(means: list[Tensor], x: Tensor) -> Tensor:
    """The stochastic steps' means stacked on dim 1, (B, Ks, *S) float32; (B, 0, *S) when no step was stochastic."""
    return torch.stack(means, dim=1) if means else x.new_zeros(x.shape[0], 0, *x.shape[1:])


@torch.no_grad()
def sample(
    pipeline: Pipeline,
    sampler: Sampler,
    prompts: Sequence[str],
    num_samples: int,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int = 0,
    metadata: Sequence[dict[str, Any]] | None = None,
) -> Trajectory:
    """``num_samples`` samples of each prompt (prompt-major), every one from its own noise drawn from one generator
    seeded ``seed``: what ``flowrl sample`` and ``Trainer.sample`` draw."""
    prompts = [p for p in prompts for _ in range(num_samples)]
    metadata = [dict(m) for m in (metadata or [{}] * (len(prompts) // num_samples)) for _ in range(num_samples)]
    device = pipeline.device if hasattr(pipeline, "device") else torch.device("cpu")
    sigmas = pipeline.schedule.sigmas(num_inference_steps).to(device)
    return rollout(
        pipeline,
        sampler,
        prompts,
        metadata,
        torch.arange(len(prompts)),
        sigmas,
        torch.Generator().manual_seed(seed),
        guidance_scale,
        same_noise_in_group=False,
    )
