"""Flow-DPPO: the divergence-masked surrogate against hand-derived values, both sides of the drop rule, the exact KL's
per-dimension-mean reduction, ratio 1 and zero KL when re-scoring at unchanged weights, the old policy's means after
the weights moved, and two iterations on the embedded model through the real Trainer."""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from tiny_components import two_iterations_change_every_parameter

from flowrl.config import FlowSDEConfig, PipelineConfig, load_config
from flowrl.errors import FlowRLError
from flowrl.objectives import OBJECTIVES
from flowrl.objectives.flow_dppo import FlowDPPOConfig, divergence_masked_surrogate, trust_region_drop
from flowrl.objectives.functional import gaussian_kl
from flowrl.pipelines import build_pipeline
from flowrl.samplers import build_sampler
from flowrl.samplers.log_prob import gaussian_log_prob
from flowrl.samplers.rollout import rollout

DPPO = CONFIGS / "digits" / "flow_dppo.yaml"


def test_loss_hand_value_and_drop_rule():
    # threshold delta = 0.1. Per sample: advantage A, ratio r, exact KL D; dropped iff D > delta and the ratio moved the
    # way A pushes it (r > 1 with A > 0, or r < 1 with A < 0); a kept term is -A r, a dropped one 0.
    #   s0: A = +1, r = 2,   D = 0.5  -> over, pushed with A (r > 1, A > 0)  -> dropped:          0
    #   s1: A = +1, r = 0.5, D = 0.5  -> over, moving against A (back)       -> kept:   -1 * 0.5 = -0.5
    #   s2: A = -2, r = 0.5, D = 0.05 -> pushed with A but under delta        -> kept:   +2 * 0.5 = +1
    #   s3: A = -2, r = 0.5, D = 0.5  -> over, pushed with A (r < 1, A < 0)  -> dropped:          0
    #   s4: A = -1, r = 2,   D = 0.5  -> over, moving against A              -> kept:   +1 * 2   = +2
    #   s5: A = +3, r = 1.5, D = 0.1  -> D == delta is not over (paper: D > delta) -> kept: -3 * 1.5 = -4.5
    # loss = (0 - 0.5 + 1 + 0 + 2 - 4.5) / 6 = -1/3 (dropped samples stay in the denominator with 0).
    # d loss / d log p = (-A r if kept else 0) / 6 = [0, -0.5, 1, 0, 2, -4.5] / 6.
    ratio = torch.tensor([2.0, 0.5, 0.5, 0.5, 2.0, 1.5])
    adv = torch.tensor([1.0, 1.0, -2.0, -2.0, -1.0, 3.0])
    kl = torch.tensor([0.5, 0.5, 0.05, 0.5, 0.5, 0.1])
    log_prob = torch.log(ratio).requires_grad_(True)
    loss, stats = divergence_masked_surrogate(log_prob, torch.zeros(6), adv, kl, 0.1)
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-6)
    loss.backward()
    assert log_prob.grad.tolist() == pytest.approx([0.0, -0.5 / 6, 1 / 6, 0.0, 2 / 6, -4.5 / 6], abs=1e-6)
    assert trust_region_drop(ratio, adv, kl, 0.1).tolist() == [True, False, False, True, False, False]
    assert stats["dppo/dropped"].item() == pytest.approx(2 / 6)
    assert stats["dppo/over_threshold"].item() == pytest.approx(4 / 6)  # s0, s1, s3, s4
    assert stats["policy/ratio_mean"].item() == pytest.approx(7 / 6)  # (2 + 0.5 + 0.5 + 0.5 + 2 + 1.5) / 6
    assert stats["dppo/kl_mean"].item() == pytest.approx(2.15 / 6) and stats["dppo/kl_max"].item() == pytest.approx(0.5)
    # s5 masked out (a non-finite reward): (0 - 0.5 + 1 + 0 + 2) / 5 = 0.5
    valid = torch.tensor([True, True, True, True, True, False])
    assert divergence_masked_surrogate(torch.log(ratio), torch.zeros(6), adv, kl, 0.1, valid)[0].item() == pytest.approx(0.5)
    # no clip: far outside any PPO range, an unpushed sample keeps its full ratio (A = -1, r = 10: loss 10)
    assert divergence_masked_surrogate(torch.log(torch.tensor([10.0])), torch.zeros(1), -torch.ones(1), torch.ones(1), 0.1)[
        0
    ].item() == pytest.approx(10.0)
    # r == 1 or A == 0 is never dropped, whatever the KL
    assert not trust_region_drop(torch.tensor([1.0, 2.0, 0.5]), torch.tensor([1.0, 0.0, 0.0]), torch.full((3,), 9.0), 0.1).any()


def test_kl_is_per_dimension_mean_and_the_mean_of_minus_log_ratio():
    # Two dims, old mean 0, new mean d = (0.1, 0.3), std s = 0.5:
    # per-dim KL d^2 / (2 s^2) = (0.01, 0.09) / 0.5 = (0.02, 0.18); mean-reduced 0.1 (sum-reduced 0.2).
    d, s = torch.tensor([[0.1, 0.3]]), torch.tensor(0.5)
    assert gaussian_kl(d, torch.zeros(1, 2), s).item() == pytest.approx(0.1)
    assert gaussian_kl(d, torch.zeros(1, 2), s, "sum").item() == pytest.approx(0.2)
    # With x_next = mu_old + s z the (mean-reduced) log-ratio is mean(z d) / s - KL (paper Eq. 13): for z = (1, -1),
    # mean(z d) / s = (0.1 - 0.3) / 2 / 0.5 = -0.2, so log r = -0.2 - 0.1 = -0.3; over z ~ N(0, I) its mean is -KL.
    x_next = s * torch.tensor([[1.0, -1.0]])
    log_r = gaussian_log_prob(x_next, d, s) - gaussian_log_prob(x_next, torch.zeros(1, 2), s)
    assert log_r.item() == pytest.approx(-0.3, abs=1e-6)


def _rollout(pipeline, sampler, n=8):
    prompts = ["a handwritten seven", "digit 3", "the digit zero", "a picture of a two"] * (n // 4)
    traj = rollout(
        pipeline, sampler, prompts, [{}] * n, torch.arange(n) // 4, pipeline.schedule.sigmas(4), torch.Generator().manual_seed(0)
    )
    traj.rewards = torch.arange(n, dtype=torch.float32)
    return traj


@pytest.mark.slow
def test_rescore_at_unchanged_weights_then_the_old_means_after_a_step(one_thread):
    pipeline = build_pipeline(PipelineConfig(pretrained="digits_flow"), "cpu")
    sampler = build_sampler(FlowSDEConfig(noise_level=0.7), pipeline)
    traj = _rollout(pipeline, sampler)
    objective = FlowDPPOConfig(kl_threshold=0.0).build()  # any positive KL would be over the threshold
    batch = objective.prepare(traj)
    gen = torch.Generator().manual_seed(0)
    first = [lo.metrics for lo in objective.losses(pipeline, sampler, batch, gen)]
    assert len(first) == int(traj.stochastic.sum()) == 4
    for m in first:  # the weights that produced the rollout: ratio 1, KL exactly 0, nothing over or dropped
        assert float(m["policy/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
        assert float(m["dppo/kl_mean"]) == 0.0 and float(m["dppo/kl_max"]) == 0.0
        assert float(m["dppo/over_threshold"]) == 0.0 and float(m["dppo/dropped"]) == 0.0
    # again without a new rollout, now through the copied weights swapped in: still exactly the same means
    for lo in objective.losses(pipeline, sampler, batch, gen):
        assert float(lo.metrics["dppo/kl_max"]) == 0.0 and float(lo.metrics["dppo/dropped"]) == 0.0
    # Move the weights (as an optimizer step would) without a new rollout: mu_old stays the rollout weights' mean.
    params = pipeline.trainable_parameters()
    old_means = [_step(pipeline, sampler, batch, k).mean for k in range(4)]
    with torch.no_grad():
        for p in params:
            p.add_(1e-3 * torch.randn(p.shape, generator=gen))
    after = [lo.metrics for lo in objective.losses(pipeline, sampler, batch, gen)]
    dropped = 0.0
    for k, m in enumerate(after):
        out = _step(pipeline, sampler, batch, k)
        expected = gaussian_kl(out.mean, old_means[k], out.std).mean()  # per-dimension mean, then over the batch
        assert float(m["dppo/kl_mean"]) == pytest.approx(float(expected), rel=1e-4) and float(m["dppo/kl_mean"]) > 0
        assert float(m["dppo/over_threshold"]) == 1.0
        # every row is over the threshold, so exactly the rows whose ratio moved the way their advantage pushes drop
        ratio, adv = torch.exp(out.log_prob - batch.log_probs[:, k]), batch.advantages
        assert float(m["dppo/dropped"]) == pytest.approx(float((((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0))).float().mean()))
        dropped += float(m["dppo/dropped"])
    assert 0.0 < dropped / 4 < 1.0
    # a new rollout (prepare) takes the current weights as the old policy again
    objective.prepare(batch)
    assert all(float(m["dppo/kl_mean"]) == 0.0 for m in (lo.metrics for lo in objective.losses(pipeline, sampler, batch, gen)))


def _step(pipeline, sampler, batch, k):
    with torch.no_grad():
        x, s, s_next = batch.latents[:, k], batch.sigmas[k], batch.sigmas[k + 1]
        return sampler.step(pipeline.predict(x, s, batch.cond, batch.guidance_scale), x, s, s_next, x_next=batch.latents[:, k + 1])


@pytest.mark.slow
def test_two_iterations_through_the_trainer(tmp_path, one_thread):
    # beta > 0 also runs the KL to the frozen initial model
    overrides = fast_overrides(tmp_path, **{"train.learning_rate": 1e-3, "train.batch_size": 4, "objective.beta": 0.01})
    trainer = two_iterations_change_every_parameter(overrides, DPPO)
    assert trainer.objective.name == "flow_dppo" and trainer.objective.reference == "initial"
    rows = trainer.logger.records()
    assert {"loss/policy", "loss/kl", "policy/ratio_mean", "dppo/kl_mean", "dppo/dropped", "dppo/over_threshold"} <= set(rows[1])
    assert rows[1]["dppo/kl_mean"] > 0  # the second minibatch of an iteration is off the rollout policy


# The defaults and the released code they come from (docs/objectives/flow_dppo.md, "Defaults and where they come from"):
# UniRL (Tencent-Hunyuan/UniRL at 1a7b501) unirl/algorithms/flowdppo.py line 32 and the recipe
# examples/diffusion/sd3_flowdppo.yaml line 116 set kl_mask_threshold 1e-5, and verl-omni (a1139ba)
# verl_omni/workers/config/diffusion/actor.py line 47 too; the recipe's adv_use_global_std: true (line 27) is std: global;
# verl-omni's Flow-GRPO advantage adds epsilon 1e-4 (diffusion_algos.py line 195); neither code clips the advantage
# nor adds a reference KL; UniRL trains every stochastic step of its rollout.
CITED_DEFAULTS = {
    "kl_threshold": 1e-5,
    "std": "global",
    "std_eps": 1e-4,
    "adv_clip_max": None,
    "beta": 0.0,
    "timestep_fraction": 1.0,
    "timestep_order": "random",
    "multi_reward": "weighted_sum",
}


def test_defaults_are_the_cited_ones():
    config = FlowDPPOConfig()
    assert {key: getattr(config, key) for key in CITED_DEFAULTS} == CITED_DEFAULTS
    assert set(FlowDPPOConfig.model_fields) - {"name"} == set(CITED_DEFAULTS)  # a new field needs its source here too
    # the docs' table names every field with this default and a source
    doc = (CONFIGS.parent / "docs" / "objectives" / "flow_dppo.md").read_text()
    table = doc.split("## Defaults and where they come from", 1)[1].split("\n\n")[2]
    rows = {line.split("|")[1].strip(" `"): line.split("|")[2].strip(" `") for line in table.splitlines()[2:]}
    assert set(rows) == set(CITED_DEFAULTS)
    for key, value in CITED_DEFAULTS.items():
        assert rows[key] == "none" if value is None else (float(rows[key]) == value if isinstance(value, float) else rows[key] == value)
    assert all(len(line.split("|")[3].strip()) > 20 for line in table.splitlines()[2:])  # each row cites a source
    assert "line 32" in table and "line 116" in table and "line 47" in table  # the threshold's, by line


def test_registered_and_config_refuses_bad_values():
    assert "flow_dppo" in OBJECTIVES.builtin_names()
    config = load_config(DPPO)
    assert config.objective.name == "flow_dppo" and config.objective.kl_threshold == 1e-4  # the preset: tuned to digits
    with pytest.raises(FlowRLError, match="objective.kl_threshold"):
        load_config(DPPO, ["objective.kl_threshold=-1"])
    with pytest.raises(FlowRLError, match="unknown config key 'objective.clip_range'"):
        load_config(DPPO, ["objective.clip_range=0.1"])
