"""The embedded text-to-video model ("moving digits"): its data, the shipped weights, the adapter, and
GRPO on it (re-scoring consistency, two trainer iterations)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import rescoring_in_minibatches_ratio_is_one, two_iterations_change_every_parameter

from flowrl.config import FlowSDEConfig, LoraConfig, ODEConfig, PipelineConfig
from flowrl.data import digits_video as data
from flowrl.errors import FlowRLError
from flowrl.objectives.grpo import GRPOConfig
from flowrl.pipelines import build_pipeline
from flowrl.pipelines.embedded_adapter import ASSETS
from flowrl.prompts import prompt_pool
from flowrl.samplers import build_sampler
from flowrl.samplers.rollout import rollout

ASSET = ASSETS / "digits_video"
# Measured on the shipped weights (docs/digits_video.md): 80 held-out prompts x 4 seeds, ODE 10 steps, no
# CFG: every clip moved in the prompted direction (1.000; chance 0.25). The test samples 40 of them and
# allows a few misses.
MEASURED_DIRECTION_ACCURACY = 1.0
DIRECTION_FLOOR = 0.9


@pytest.fixture(scope="module")
def pipeline(one_thread):
    return build_pipeline(PipelineConfig(name="digits_video", pretrained="digits_video"), "cpu")


# -- data -------------------------------------------------------------------------------------------
def test_clips_move_the_digit_in_the_named_direction():
    videos, digits, directions = data.example_clips(seed=0, batch=64)
    assert videos.shape == (64, 1, data.NUM_FRAMES, data.CANVAS, data.CANVAS)
    assert videos.min() >= 0 and videos.max() <= 1
    assert set(directions) == set(data.DIRECTION_NAMES) and len(set(digits)) > 5
    travel = data.SPEED * (data.NUM_FRAMES - 1)
    for shift, name in zip(data.displacement(videos), directions):
        dy, dx = data.DIRECTIONS[name]
        assert torch.allclose(shift, torch.tensor([dy * travel, dx * travel], dtype=torch.float32), atol=1e-4)
    assert data.measured_directions(videos) == directions
    # Every frame is the first one translated (exact pixel copies, nothing leaves the canvas).
    for v, name in zip(videos, directions):
        dy, dx = data.DIRECTIONS[name]
        for t in range(1, data.NUM_FRAMES):
            shifted = torch.roll(v[0, 0], shifts=(dy * data.SPEED * t, dx * data.SPEED * t), dims=(0, 1))
            assert torch.equal(v[0, t], shifted)
    again, _, _ = data.example_clips(seed=0, batch=64)
    assert torch.equal(videos, again)  # deterministic for a seed


def test_crops_are_recognised_by_the_digit_classifier():
    from flowrl.reward_models import build_reward

    videos, digits, _ = data.example_clips(seed=1, batch=64)
    out = build_reward("digit_classifier")(data.digit_crops(videos, frame=-1), [""] * 64, [{"digit": d} for d in digits])
    assert float(out.extras["accuracy"].mean()) > 0.9


def test_prompt_splits():
    train, held_out = prompt_pool("digits_video", "train"), prompt_pool("digits_video", "eval")
    assert len(train) == 4 * 10 * 4 and len(held_out) == 2 * 10 * 4
    assert not {p for p, _ in train} & {p for p, _ in held_out}
    assert held_out[0] == ("the number zero drifting left", {"digit": 0, "direction": "left"})
    tokenizer = data.build_tokenizer()
    for prompt, _ in train + held_out:
        ids = tokenizer(prompt).input_ids
        assert len(ids) <= data.MAX_PROMPT_TOKENS and tokenizer.unk_token_id not in ids
    with pytest.raises(FlowRLError, match="does not exist for dataset 'digits_video'"):
        prompt_pool("digits_video", "test")


# -- the shipped model --------------------------------------------------------------------------------
def test_shipped_model_is_small_and_documented(pipeline):
    from diffusers import CogVideoXTransformer3DModel

    assert isinstance(pipeline.denoiser, CogVideoXTransformer3DModel)
    assert pipeline.prediction_type == "flow"
    size = sum(f.stat().st_size for f in ASSET.rglob("*") if f.is_file())
    assert size < 5e6, size
    info = json.loads((ASSET / "training_info.json").read_text())
    assert info["command"].startswith("python -m flowrl.pipelines.embedded.train_digits_video")
    assert info["train_seconds"] > 0 and info["final_loss_ema"] > 0


@pytest.mark.slow
def test_ode_samples_move_in_the_prompted_direction(pipeline):
    held_out = prompt_pool("digits_video", "eval")[:40]  # digits 0-9, every direction, one phrasing
    prompts, metadata = [p for p, _ in held_out], [m for _, m in held_out]
    gen = torch.Generator().manual_seed(0)
    traj = rollout(pipeline, build_sampler(ODEConfig(), pipeline), prompts, metadata, torch.arange(40), pipeline.schedule.sigmas(10), gen)
    videos = traj.samples
    assert videos.shape == (40, 1, 4, 16, 16) and videos.dtype == torch.float32
    assert videos.min() >= 0 and videos.max() <= 1
    rate = data.direction_accuracy(videos, [m["direction"] for m in metadata])
    assert rate >= DIRECTION_FLOOR, f"direction accuracy {rate} (measured on the shipped weights: {MEASURED_DIRECTION_ACCURACY})"


def test_bad_paths_fail_in_one_sentence(tmp_path):
    with pytest.raises(FlowRLError, match="neither an embedded model"):
        build_pipeline(PipelineConfig(name="digits_video", pretrained=str(tmp_path / "missing")), "cpu")
    (tmp_path / "transformer").mkdir()
    with pytest.raises(FlowRLError, match="lacks the component folder"):
        build_pipeline(PipelineConfig(name="digits_video", pretrained=str(tmp_path)), "cpu")


# -- GRPO -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rescore_ratio_is_one_at_unchanged_weights(pipeline):
    sampler = build_sampler(FlowSDEConfig(noise_level=0.7), pipeline)
    prompts = [p for p, _ in prompt_pool("digits_video", "train")[:4] for _ in range(2)]
    traj = rollout(
        pipeline,
        sampler,
        prompts,
        [{}] * 8,
        torch.arange(8) // 2,
        pipeline.schedule.sigmas(4),
        torch.Generator().manual_seed(0),
        guidance_scale=2.0,
    )
    assert traj.latents.shape == (8, 5, 1, 4, 16, 16) and traj.stochastic.all()
    rescoring_in_minibatches_ratio_is_one(pipeline, sampler, traj)
    # Through GRPO's own loss path: first pass on-policy.
    traj.rewards = torch.arange(8, dtype=torch.float32)
    objective = GRPOConfig(clip_range=1e-4).build()
    batch = objective.prepare(traj)[torch.arange(3)]
    for lo in objective.losses(pipeline, sampler, batch, torch.Generator().manual_seed(0)):
        assert float(lo.metrics["policy/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_two_iterations_change_every_parameter(tmp_path, one_thread):
    trainer = two_iterations_change_every_parameter(
        fast_overrides(tmp_path, **{"train.weight_decay": 0.0, "train.learning_rate": 1e-3, "log.grid_prompts": 2}),
        CONFIGS / "digits_video" / "grpo.yaml",
    )
    assert all(p.requires_grad for p in trainer.module.parameters())  # full fine-tuning: every parameter moved
    summary = json.loads((tmp_path / "summary.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "reward/motion_quality" in records[1] and "eval/reward/motion_quality" in records[-1]
    assert summary["eval_reward_initial"] is not None and (tmp_path / "samples_after.png").is_file()


def test_lora_trains_only_the_adapters_and_the_reference_is_the_base(pipeline):
    lora = build_pipeline(PipelineConfig(name="digits_video", pretrained="digits_video", lora=LoraConfig(r=4, alpha=8)), "cpu")
    names = [n for n, p in lora.denoiser.named_parameters() if p.requires_grad]
    assert names and all("lora" in n for n in names)
    x = lora.initial_noise(2, torch.Generator().manual_seed(0))
    cond = lora.encode(["digit 3 going up", "a five moves left"])
    with torch.no_grad():
        base = pipeline.predict(x, torch.tensor(0.5), cond)
        for p in lora.trainable_parameters():
            p.add_(0.05)
        lora.enable_reference()
        with lora.reference():
            assert torch.allclose(lora.predict(x, torch.tensor(0.5), cond), base, atol=1e-5)
        assert not torch.allclose(lora.predict(x, torch.tensor(0.5), cond), base, atol=1e-3)
