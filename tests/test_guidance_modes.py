"""The guidance modes give the gradients docs/guidance.md states, on a real denoiser (the embedded
digits UNet): with c = conditional and u = unconditional outputs and scale s,

    cfg                  value u + s (c - u),  gradient (1 - s) du + s dc
    cfg_detached_uncond  value u + s (c - u),  gradient s dc
    cfg_rollout_only     rollout value u + s (c - u); training re-scores c alone: gradient dc
"""

from __future__ import annotations

import pytest
import torch

from flowrl.config import PipelineConfig
from flowrl.pipelines import build_pipeline
from flowrl.pipelines.guidance import guided_prediction, training_guidance_scale

pytestmark = pytest.mark.usefixtures("one_thread")
SCALE = 3.0


@pytest.fixture(scope="module")
def pipe():
    return build_pipeline(PipelineConfig(pretrained="digits_flow", device="cpu"), "cpu")


def _grad(pipe, mode: str, scale: float, weights: torch.Tensor, x, sigma, cond) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, gradient of <weights, prediction> w.r.t. all denoiser parameters, flattened)."""
    pipe.guidance_mode = mode
    pipe.denoiser.zero_grad(set_to_none=True)
    out = pipe.predict(x, sigma, cond, scale)
    (out * weights).sum().backward()
    grad = torch.cat([p.grad.flatten() for p in pipe.denoiser.parameters()])
    pipe.guidance_mode = "cfg"
    return out.detach(), grad


def test_cfg_modes_give_the_documented_values_and_gradients(pipe):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, 8, 8, generator=gen)
    weights = torch.randn(2, 1, 8, 8, generator=gen)
    sigma = torch.tensor(0.6)
    cond = pipe.encode(["the digit 3", "a 7"])
    uncond = pipe.unconditional(2)

    # the two branches alone (scale 1 = one conditional forward)
    c_val, dc = _grad(pipe, "cfg", 1.0, weights, x, sigma, cond)
    u_val, du = _grad(pipe, "cfg", 1.0, weights, x, sigma, uncond)
    expected_value = u_val + SCALE * (c_val - u_val)

    value, grad = _grad(pipe, "cfg", SCALE, weights, x, sigma, cond)
    torch.testing.assert_close(value, expected_value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, (1 - SCALE) * du + SCALE * dc, atol=1e-4, rtol=1e-4)

    value, grad = _grad(pipe, "cfg_detached_uncond", SCALE, weights, x, sigma, cond)
    torch.testing.assert_close(value, expected_value, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, SCALE * dc, atol=1e-4, rtol=1e-4)

    # rollout only: the rollout is guided, training re-scores with the scale the trainer passes (1)
    train_scale = training_guidance_scale("cfg_rollout_only", SCALE)
    assert train_scale == 1.0 and training_guidance_scale("cfg", SCALE) == SCALE
    with torch.no_grad():
        pipe.guidance_mode = "cfg_rollout_only"
        torch.testing.assert_close(pipe.predict(x, sigma, cond, SCALE), expected_value, atol=1e-5, rtol=1e-5)
    value, grad = _grad(pipe, "cfg_rollout_only", train_scale, weights, x, sigma, cond)
    torch.testing.assert_close(grad, dc, atol=1e-5, rtol=1e-5)
    assert (grad - SCALE * dc).abs().max() > 1e-3  # the modes really differ


def test_guided_prediction_counts_forwards():
    calls = []

    def forward(x, c):
        calls.append(x.shape[0])
        return x * c["e"]

    x, cond, uncond = torch.ones(3, 2), {"e": torch.full((3, 1), 2.0)}, {"e": torch.zeros(3, 1)}
    torch.testing.assert_close(guided_prediction(forward, x, cond, uncond, 4.0, "cfg"), torch.full((3, 2), 8.0))
    assert calls == [6]  # one batched forward over both branches
    calls.clear()
    torch.testing.assert_close(guided_prediction(forward, x, cond, uncond, 4.0, "cfg_detached_uncond"), torch.full((3, 2), 8.0))
    assert calls == [3, 3]
    calls.clear()
    torch.testing.assert_close(guided_prediction(forward, x, cond, uncond, 4.0, "embedded"), torch.full((3, 2), 2.0))
    assert calls == [3]  # the scale is the model's input, not an extrapolation


def test_rollout_only_training_is_off_policy_at_unchanged_weights(tmp_path):
    """Guided rollout, unguided re-scoring: the first ratio is not 1 (documented), unlike mode cfg."""
    from flowrl.config import load_config
    from flowrl.trainer import Trainer
    from tests.conftest import fast_overrides

    trainer = Trainer(
        load_config(None, fast_overrides(tmp_path, **{"rollout.guidance_scale": 3.0, "rollout.guidance_mode": "cfg_rollout_only"}))
    )
    traj = trainer.collect(0)
    k = 1
    with torch.no_grad():
        for scale, should_match in ((traj.guidance_scale, True), (training_guidance_scale("cfg_rollout_only", traj.guidance_scale), False)):
            out = trainer.pipeline.predict(traj.latents[:, k], traj.sigmas[k], traj.cond, scale)
            lp = trainer.sampler.step(out, traj.latents[:, k], traj.sigmas[k], traj.sigmas[k + 1], x_next=traj.latents[:, k + 1]).log_prob
            gap = float((lp - traj.log_probs[:, k]).abs().max())
            assert (gap < 1e-5) == should_match, gap
