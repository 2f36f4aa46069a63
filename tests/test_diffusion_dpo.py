"""Diffusion-DPO: the loss against hand-derived values and its sign, the noising and regression targets of
every prediction type against the samplers' own conversions, the pairs builder and files, the log 2
invariant and gradient at the reference weights, and two training iterations on flow and DDPM models."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import two_iterations_change_every_parameter

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.objectives.functional import diffusion_dpo_loss
from flowrl.preferences.pairs import PreferencePairs, build_pairs, read_pairs, write_pairs
from flowrl.samplers.forward_process import noised_and_target, training_sigmas

DPO = CONFIGS / "digits" / "diffusion_dpo.yaml"


def test_loss_hand_values_and_sign():
    # d_model = 0.30 - 0.50 = -0.2, d_ref = 0.40 - 0.45 = -0.05, beta = 10: z = -0.5 * 10 * (-0.15) = 0.75.
    loss = diffusion_dpo_loss(torch.tensor([0.30]), torch.tensor([0.50]), torch.tensor([0.40]), torch.tensor([0.45]), 10.0)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.75)), abs=1e-7)
    assert loss.item() < math.log(2)  # the winner is fitted better than the reference fits it: below log 2
    worse = diffusion_dpo_loss(torch.tensor([0.50]), torch.tensor([0.30]), torch.tensor([0.40]), torch.tensor([0.45]), 10.0)
    assert worse.item() > math.log(2)
    same = diffusion_dpo_loss(
        torch.tensor([0.3, 0.7]), torch.tensor([0.5, 0.1]), torch.tensor([0.3, 0.7]), torch.tensor([0.5, 0.1]), 5000.0
    )
    assert same.tolist() == pytest.approx([math.log(2)] * 2)


@pytest.fixture(scope="module")
def pipelines():
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline

    return {name: build_pipeline(PipelineConfig(pretrained=name), "cpu") for name in ("digits_flow", "digits_ddpm")}


def test_noised_inputs_and_targets_invert_like_the_samplers(pipelines):
    """The model's x0 recovered from (x_t, target) by the samplers' own formulas is the clean sample."""
    from flowrl.config import DDIMConfig
    from flowrl.samplers import build_sampler

    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(5, 1, 8, 8, generator=gen), torch.randn(5, 1, 8, 8, generator=gen)
    flow = pipelines["digits_flow"]
    sigma = training_sigmas(flow, 5, gen)
    assert ((sigma > 0) & (sigma <= 1)).all()
    x_t, v = noised_and_target(flow, x0, noise, sigma)
    torch.testing.assert_close(x_t - sigma.view(-1, 1, 1, 1) * v, x0)  # x0_hat = x - sigma v
    ddpm = pipelines["digits_ddpm"]
    sigma = training_sigmas(ddpm, 5, gen)
    assert torch.equal(sigma * ddpm.schedule.num_train_timesteps, torch.round(sigma * ddpm.schedule.num_train_timesteps))
    for prediction in ("epsilon", "v_prediction"):
        ddpm.prediction_type = prediction
        try:
            x_t, target = noised_and_target(ddpm, x0, noise, sigma)
            sampler = build_sampler(DDIMConfig(eta=0.0, clip_sample=None), ddpm)
            for i in range(5):  # the DDIM sampler's conversion of a model output to x0, one sigma at a time
                x0_hat = sampler.predicted_x0(target[i : i + 1], x_t[i : i + 1], sigma[i])
                torch.testing.assert_close(x0_hat.float(), x0[i : i + 1], atol=2e-5, rtol=1e-4)
        finally:
            ddpm.prediction_type = "epsilon"


def _pairs(tmp_path, config=DPO, n=24, **overrides):
    pairs, rewards, _ = build_pairs(
        load_config(config, [f"output_dir={tmp_path / 'unused'}", *[f"{k}={v}" for k, v in overrides.items()]]),
        n,
        torch.Generator().manual_seed(0),
    )
    return write_pairs(tmp_path / "pairs", pairs, rewards), pairs, rewards


@pytest.mark.slow
def test_builder_labels_by_the_reward_and_files_round_trip(tmp_path):
    from flowrl.config import PipelineConfig
    from flowrl.pipelines import build_pipeline
    from flowrl.reward_models import build_reward_from_config

    directory, pairs, rewards = _pairs(tmp_path)
    back = read_pairs(directory)
    assert torch.equal(back.winners, pairs.winners) and back.prompts == pairs.prompts and back.metadata == pairs.metadata
    assert (rewards[0] > rewards[1]).all()
    # Re-scoring the stored clean samples reproduces the labels.
    config = load_config(DPO, [])
    pipe, reward = build_pipeline(PipelineConfig(pretrained="digits_flow"), "cpu"), build_reward_from_config(config.reward)
    won = reward(pipe.decode(back.winners), back.prompts, back.metadata).scores
    lost = reward(pipe.decode(back.losers), back.prompts, back.metadata).scores
    torch.testing.assert_close(won.float(), rewards[0], atol=1e-5, rtol=0)
    assert (won > lost).all()
    with pytest.raises(FlowRLError, match="already exists"):
        write_pairs(directory, pairs)


def test_bad_pairs_fail_in_one_sentence(tmp_path):
    from flowrl.trainer import Trainer

    with pytest.raises(FlowRLError, match="not a pairs directory"):
        read_pairs(tmp_path)
    (tmp_path / "pairs.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "a 3"}\n')
    with pytest.raises(FlowRLError, match="could not read"):
        read_pairs(tmp_path)
    write_pairs(tmp_path / "p", PreferencePairs(torch.zeros(2, 3), torch.zeros(2, 3), ["a", "b"], [{}, {}]))
    with pytest.raises(FlowRLError, match="have shape"):
        Trainer(load_config(DPO, fast_overrides(tmp_path / "run", **{"prompts.pairs": str(tmp_path / "p")})))
    with pytest.raises(FlowRLError, match="set prompts.pairs"):
        Trainer(load_config(DPO, fast_overrides(tmp_path / "run2", **{"prompts.pairs": "null"})))


def test_first_loss_is_log2_and_gradient_is_hand_derived(tmp_path):
    """At the reference weights every pair's loss is log 2 and the gradient is (beta / 4) * grad mean(err_w - err_l),
    from d/dz -log sigmoid(z) = -1/2 at z = 0 and z = -beta/2 (d_model - d_ref)."""
    from flowrl.trainer import Trainer

    directory, _, _ = _pairs(tmp_path, n=8)
    trainer = Trainer(load_config(DPO, fast_overrides(tmp_path / "run", **{"prompts.pairs": str(directory), "objective.beta": 50.0})))
    batch = trainer.objective.prepare(trainer.collect(0))
    params = trainer.trainable_parameters()
    (out,) = trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(3))
    assert out.metrics["loss/policy"].item() == pytest.approx(math.log(2), abs=1e-6)
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    # The same draws, by hand: sigma per pair, then noise per pair.
    gen = torch.Generator().manual_seed(3)
    x0 = batch.latents[:, -1]
    sigma = training_sigmas(trainer.pipeline, len(x0) // 2, gen).repeat_interleave(2)
    noise = torch.randn(x0[0::2].shape, generator=gen).repeat_interleave(2, dim=0)
    x_t, target = noised_and_target(trainer.pipeline, x0, noise, sigma)
    err = (trainer.pipeline.predict(x_t, sigma, batch.cond) - target).pow(2).flatten(1).mean(1)
    expected = torch.autograd.grad(50.0 / 4 * (err[0::2] - err[1::2]).mean(), params, allow_unused=True)
    for g, e in zip(grads, expected):
        if e is not None:
            torch.testing.assert_close(g, e, atol=1e-8, rtol=1e-4)


@pytest.mark.parametrize("model", ["digits_flow", "digits_ddpm"])
@pytest.mark.slow
def test_two_iterations_change_every_parameter(tmp_path, model, one_thread):
    config = DPO
    if model == "digits_ddpm":  # the epsilon model: its config names the DDIM sampler (unused by training, built all the same)
        config = tmp_path / "ddpm.yaml"
        config.write_text(
            DPO.read_text()
            .replace("  name: flow_sde\n  diffusion: flow_grpo\n  noise_level: 0.7", "  name: ddim\n  eta: 1.0")
            .replace("pretrained: digits_flow", "pretrained: digits_ddpm")
        )
    directory, _, _ = _pairs(tmp_path, config, n=8)
    overrides = fast_overrides(
        tmp_path / "run", **{"prompts.pairs": str(directory), "train.learning_rate": 1e-3, "train.weight_decay": 0.0}
    )
    trainer = two_iterations_change_every_parameter(overrides, config)
    rows = trainer.logger.records()
    assert {"dpo/pair_accuracy", "dpo/implicit_margin", "loss/policy", "reward/mean"} <= set(rows[1])


@pytest.mark.parametrize("objective", ["diffusion_dpo", "d3po"])
@pytest.mark.slow
def test_resume_continues_exactly_with_the_initial_reference(tmp_path, objective, one_thread):
    """Both preference objectives keep the frozen initial model as reference: an interrupted run resumed to
    the end logs the same metrics and ends with the same weights as an uninterrupted one."""
    import json

    from safetensors.torch import load_file

    from flowrl.trainer import Trainer

    config = DPO if objective == "diffusion_dpo" else CONFIGS / "digits" / "d3po.yaml"
    extra = {"train.iterations": 4, "eval.every": 2, "log.checkpoint_every": 2, "train.learning_rate": 1e-3}
    if objective == "diffusion_dpo":
        extra["prompts.pairs"] = str(_pairs(tmp_path, n=8)[0])
    Trainer(load_config(config, fast_overrides(tmp_path / "full", **extra))).fit()
    Trainer(load_config(config, fast_overrides(tmp_path / "cut", **extra, **{"train.stop_after": 3}))).fit()
    assert Trainer(load_config(config, fast_overrides(tmp_path / "cut", **extra, resume_from="latest"))).fit()["iterations_completed"] == 4

    def metrics(run):
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]

    assert metrics(tmp_path / "cut") == metrics(tmp_path / "full")
    a = load_file(tmp_path / "full" / "checkpoints" / "step_000004" / "denoiser.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoints" / "step_000004" / "denoiser.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
