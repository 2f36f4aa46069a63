"""Train-inference consistency: re-scoring a stored rollout at unchanged weights gives ratio == 1.

For every (embedded pipeline, sampler) pair, roll out with one batch size and re-score with other
minibatch sizes (batch-size-dependent kernels are a known cause of r != 1), with CFG on, through the
objective's own loss path.
"""

from __future__ import annotations

import pytest
import torch
from tiny_components import rescoring_in_minibatches_ratio_is_one

from flowrl.config import DDIMConfig, FlowCPSConfig, FlowMemorylessConfig, FlowSDEConfig, PipelineConfig
from flowrl.objectives.grpo import GRPOConfig
from flowrl.pipelines import build_pipeline
from flowrl.samplers import build_sampler
from flowrl.samplers.rollout import rollout

CASES = [
    ("digits_flow", FlowSDEConfig(diffusion="flow_grpo", noise_level=0.7)),
    ("digits_flow", FlowSDEConfig(diffusion="dance_grpo", noise_level=0.3)),
    ("digits_flow", FlowCPSConfig(noise_level=0.7)),
    ("digits_flow", FlowMemorylessConfig()),
    ("digits_flow", FlowSDEConfig(noise_level=0.7, reduction="sum")),
    ("digits_ddpm", DDIMConfig(eta=1.0)),
    ("digits_ddpm", DDIMConfig(eta=0.5, clip_sample=1.0)),
]
_PIPELINES: dict[str, object] = {}


def _pipeline(name: str):
    if name not in _PIPELINES:
        _PIPELINES[name] = build_pipeline(PipelineConfig(pretrained=name), "cpu")
    return _PIPELINES[name]


def _rollout(pipeline, sampler, guidance: float = 2.0, window=None):
    prompts = ["a handwritten seven", "digit 3", "the digit zero", "a picture of a two"] * 2
    gen = torch.Generator().manual_seed(0)
    return rollout(
        pipeline,
        sampler,
        prompts,
        [{}] * 8,
        torch.arange(8) // 2,
        pipeline.schedule.sigmas(6),
        gen,
        guidance_scale=guidance,
        stochastic_steps=window,
    )


@pytest.mark.parametrize("model,sampler_config", CASES, ids=lambda c: getattr(c, "name", c) if not isinstance(c, str) else c)
def test_rescore_ratio_is_one(model, sampler_config):
    pipeline = _pipeline(model)
    sampler = build_sampler(sampler_config, pipeline)
    traj = _rollout(pipeline, sampler)
    assert traj.stochastic.any()
    rescoring_in_minibatches_ratio_is_one(pipeline, sampler, traj)


@pytest.mark.parametrize("model,sampler_config", CASES[:1] + CASES[4:5], ids=["flow_sde", "ddim"])
def test_objective_first_update_is_on_policy(model, sampler_config):
    """Through GRPO's own loss path: ratio_mean 1 and clip fraction 0 on the first pass (clip 1e-4)."""
    pipeline = _pipeline(model)
    sampler = build_sampler(sampler_config, pipeline)
    traj = _rollout(pipeline, sampler)
    traj.rewards = torch.arange(8, dtype=torch.float32)
    objective = GRPOConfig(clip_range=1e-4).build()
    batch = objective.prepare(traj)[torch.arange(3)]
    metrics = [lo.metrics for lo in objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0))]
    assert len(metrics) == int(traj.stochastic.sum())
    for m in metrics:
        assert float(m["policy/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
        assert float(m["policy/clipfrac"]) == 0.0


def test_sde_window_only_window_steps_carry_log_probs():
    pipeline = _pipeline("digits_flow")
    sampler = build_sampler(FlowSDEConfig(), pipeline)
    window = torch.tensor([False, True, True, False, False, False])
    traj = _rollout(pipeline, sampler, window=window)
    assert traj.stochastic.tolist() == window.tolist()
    assert torch.isnan(traj.log_probs[:, ~window]).all() and torch.isfinite(traj.log_probs[:, window]).all()
    # Outside the window the step is the deterministic Euler step of the same model output.
    with torch.no_grad():
        v = pipeline.predict(traj.latents[:, 0], traj.sigmas[0], traj.cond, traj.guidance_scale)
    assert torch.allclose(traj.latents[:, 1], sampler.deterministic_step(v, traj.latents[:, 0], traj.sigmas[0], traj.sigmas[1]), atol=1e-6)


def test_shared_initial_noise_within_group():
    pipeline = _pipeline("digits_flow")
    traj = _rollout(pipeline, build_sampler(FlowSDEConfig(), pipeline))
    x1 = traj.latents[:, 0]
    assert torch.equal(x1[0], x1[1]) and torch.equal(x1[2], x1[3])  # group ids 0,0,1,1,...
    assert not torch.equal(x1[0], x1[2])
    assert not torch.equal(traj.latents[0, -1], traj.latents[1, -1])  # the SDE noise still differs
