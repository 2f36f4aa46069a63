"""B2-DiffuRL (rollout.branching): the backward progressive window schedule, branch-based sampling with an
exactly shared prefix, training only the window, GRPO and DDPO on flow and DDPM models, resume; and the
sparse binary reward (reward.binary) with hand-computed scores."""

from __future__ import annotations

import json

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.reward_models import build_reward_from_config
from flowrl.reward_models.binary import AllOfReward
from flowrl.reward_models.image_stats import InkReward
from flowrl.samplers.branching import trained_steps, trained_window
from flowrl.trainer import Trainer
from flowrl.types import RewardOutput
from tests.conftest import CONFIGS, fast_overrides
from tests.test_family_stable_diffusion import build_tiny_sd
from tests.tiny_components import family_config, rescoring_ratio_is_one, two_iterations_change_every_parameter

pytestmark = pytest.mark.usefixtures("one_thread")

B2 = CONFIGS / "digits" / "b2_diffurl.yaml"


# -- the window schedule ------------------------------------------------------------------------------


def test_window_grows_from_the_data_end_in_equal_stages():
    # K = 10, 2 -> 10 trained steps: 9 stages of 2 iterations each over 18 iterations
    assert [trained_steps(i, 18, 10, 2) for i in range(18)] == [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10]
    # end_steps caps it: 2 -> 6 in 5 stages over 10 iterations; past the last iteration it stays at the end
    assert [trained_steps(i, 10, 10, 2, 6) for i in range(12)] == [2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 6, 6]
    # more stages than iterations: n(i) = 1 + floor(i * 10 / 4) -> 1, 3, 6, 8
    assert [trained_steps(i, 4, 10, 1) for i in range(4)] == [1, 3, 6, 8]
    assert trained_window(5, 2).tolist() == [False, False, False, True, True]
    assert trained_window(3, 3).tolist() == [True, True, True]


# -- branch-based sampling on the embedded flow model -----------------------------------------------


def b2_trainer(tmp_path, **extra) -> Trainer:
    overrides = {"train.iterations": 6, "rollout.branching.start_steps": 1, **extra}
    return Trainer(load_config(B2, fast_overrides(tmp_path, **overrides)))


def test_branches_share_the_prefix_exactly_and_differ_after_it(tmp_path):
    trainer = b2_trainer(tmp_path)  # K = 4, 1 -> 4 trained steps over 6 iterations: n = 1, 1, 2, 3, 3, 4
    for iteration, trained in [(0, 1), (2, 2), (3, 3), (5, 4)]:
        traj = trainer.collect(iteration)
        b = 4 - trained
        assert traj.stochastic.tolist() == trained_window(4, trained).tolist()
        assert torch.isnan(traj.log_probs[:, :b]).all() and torch.isfinite(traj.log_probs[:, b:]).all()
        for g in traj.group_ids.unique():
            members = traj.latents[traj.group_ids == g]  # (4, K + 1, *S)
            assert torch.equal(members[:, : b + 1], members[:1, : b + 1].expand_as(members[:, : b + 1])), (iteration, int(g))
            after = members[:, b + 1].flatten(1)
            assert torch.cdist(after, after)[~torch.eye(len(after), dtype=torch.bool)].min() > 1e-3  # every pair of branches differs
        # the two prompt groups have different prefixes (their own noise)
        first = [traj.latents[traj.group_ids == g][0, 0] for g in traj.group_ids.unique()]
        assert not torch.equal(first[0], first[1])


def test_ratio_is_one_at_unchanged_weights_and_only_window_steps_are_trained(tmp_path):
    trainer = b2_trainer(tmp_path, **{"rollout.branching.start_steps": 2})
    rescoring_ratio_is_one(trainer)  # the window steps of iteration 0 (steps 2 and 3 of 4) re-scored
    batch = trainer.collect(0)
    out = trainer.modality.collector.score(batch, trainer.reward)[0]
    batch.rewards = out.scores
    batch = trainer.objective.prepare(batch)
    trained = []
    for loss in trainer.objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0)):
        trained += [int(k[-2:]) for k in loss.metrics if k.startswith("policy/ratio_mean/step_")]
        assert abs(float(loss.metrics[f"policy/ratio_mean/step_{trained[-1]:02d}"]) - 1.0) < 1e-5  # first update: ratio 1
    assert trained == [2, 3]


def test_identical_rewards_in_a_branch_group_give_zero_grpo_advantage(tmp_path):
    trainer = b2_trainer(tmp_path)
    batch = trainer.collect(0)
    batch.rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # group 0 all passed, group 1 two of four
    adv = trainer.objective.prepare(batch).advantages
    assert torch.equal(adv[:4], torch.zeros(4))
    # group 1: mean 0.5, unbiased std sqrt(1/3): -+sqrt(3)/2
    assert torch.allclose(adv[4:], torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 3**0.5 / 2, atol=1e-6)


@pytest.mark.parametrize("objective", ["grpo", "ddpo"])
@pytest.mark.slow
def test_two_iterations_on_the_digits_flow_model(tmp_path, objective):
    config = B2 if objective == "grpo" else CONFIGS / "digits" / "ddpo.yaml"  # DDPO's preset, branching switched on
    trainer = two_iterations_change_every_parameter(fast_overrides(tmp_path, **{"rollout.branching.start_steps": 1}), config=config)
    assert trainer.objective.name == objective


@pytest.mark.slow
def test_two_iterations_on_the_ddpm_digits_model_with_ddim(tmp_path):
    overrides = fast_overrides(tmp_path, **{"rollout.branching.start_steps": 2})  # DDPO on the embedded DDPM model, DDIM eta = 1
    trainer = two_iterations_change_every_parameter(overrides, config=CONFIGS / "digits" / "ddpo_ddpm.yaml")
    # DDIM's step into clean data (sigma = 0) has no noise, so the window's last step is recorded deterministic
    assert trainer.collect(0).stochastic.tolist() == [False, False, True, False]
    rescoring_ratio_is_one(trainer)
    one_step = Trainer(
        load_config(CONFIGS / "digits" / "ddpo_ddpm.yaml", fast_overrides(tmp_path / "one", **{"rollout.branching.start_steps": 1}))
    )
    with pytest.raises(FlowRLError, match="has no stochastic step on sampler 'ddim'; raise rollout.branching.start_steps"):
        one_step.collect(0)
    rescoring_ratio_is_one(trainer)


@pytest.mark.slow
def test_stable_diffusion_family_with_ddim_and_branches(tmp_path):
    directory = build_tiny_sd(tmp_path / "sd")
    overrides = family_config("stable_diffusion", directory, tmp_path / "run", sampler="ddim", **{"rollout.branching": "{start_steps: 2}"})
    trainer = two_iterations_change_every_parameter(overrides)
    traj = trainer.collect(0)  # 3 steps, 2 trained: the prefix is step 0
    assert traj.stochastic.tolist() == [False, True, True]
    assert torch.equal(traj.latents[0, :2], traj.latents[1, :2]) and not torch.equal(traj.latents[0, 2], traj.latents[1, 2])
    rescoring_ratio_is_one(trainer)


@pytest.mark.slow
def test_resume_keeps_the_schedule_and_the_run(tmp_path):
    extra = {"train.iterations": 4, "log.checkpoint_every": 2, "rollout.branching.start_steps": 1}
    full = b2_trainer(tmp_path / "full", **extra)
    full.fit()
    b2_trainer(tmp_path / "cut", **extra, **{"train.stop_after": 2}).fit()
    resumed = b2_trainer(tmp_path / "cut", **extra, resume_from="latest")
    assert resumed.fit()["iterations_completed"] == 4
    # iteration 2 of 4 with 1 -> 4 steps: n = 1 + floor(2 * 4 / 4) = 3 (a function of the iteration, not of the process)
    assert resumed.collect(2).stochastic.tolist() == full.collect(2).stochastic.tolist() == [False, True, True, True]

    def metrics(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    assert metrics(tmp_path / "cut") == metrics(tmp_path / "full")


@pytest.mark.parametrize(
    "config, override, needle",
    [
        ("d3po", "rollout.branching.start_steps=2", "policy-gradient objective"),
        ("b2_diffurl", "rollout.sde_window_size=2", "sde_window_size"),
        ("b2_diffurl", "rollout.branching.start_steps=5", "start_steps (5) <= end_steps (4) <= num_inference_steps (4)"),
        ("b2_diffurl", "train.num_generations=1", "num_generations >= 2"),
    ],
)
def test_bad_branching_configs_are_refused(tmp_path, config, override, needle):
    with pytest.raises(FlowRLError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_config(CONFIGS / "digits" / f"{config}.yaml", fast_overrides(tmp_path) + [override])


# -- the sparse binary reward -------------------------------------------------------------------------


class FirstPixel:
    """A real reward with a closed form: the first pixel's value (NaN passes through)."""

    name, differentiable = "first_pixel", False

    def __call__(self, samples, prompts, metadata):
        return RewardOutput(scores=samples.flatten(1)[:, 0].float())


def images(values_and_first: list[tuple[float, float]]) -> torch.Tensor:
    x = torch.stack([torch.full((1, 4, 4), v) for v, _ in values_and_first])
    x[:, 0, 0, 0] = torch.tensor([f for _, f in values_and_first])
    return x


def test_all_of_is_one_only_when_every_score_passes_its_threshold():
    # ink = mean intensity = (15 v + first) / 16; first pixel as given
    x = images([(0.5, 0.9), (0.5, 0.1), (0.1, 0.9), (0.5, float("nan"))])
    reward = AllOfReward({"ink": InkReward(), "first_pixel": FirstPixel()}, {"ink": 0.4, "first_pixel": 0.5})
    out = reward(x, [""] * 4, [{}] * 4)
    ink = torch.tensor([(7.5 + 0.9) / 16, (7.5 + 0.1) / 16, (1.5 + 0.9) / 16])
    assert torch.allclose(out.extras["ink"][:3], ink)
    assert out.extras["ink/pass"][:3].tolist() == [1.0, 1.0, 0.0] and out.extras["first_pixel/pass"][:3].tolist() == [1.0, 0.0, 1.0]
    assert out.scores[:3].tolist() == [1.0, 0.0, 0.0] and torch.isnan(out.scores[3])  # a NaN score is not a miss
    # the threshold is strict: ink exactly at it does not pass
    at = AllOfReward({"ink": InkReward()}, {"ink": 0.25})(torch.full((1, 1, 2, 2), 0.25), [""], [{}])
    assert at.scores.tolist() == [0.0]


def test_binary_reward_from_a_config():
    from flowrl.config import RewardConfig

    config = RewardConfig(components={"bold": 2.0}, binary={"bold": {"all_of": {"ink": 0.4}}})
    out = build_reward_from_config(config)(torch.stack([torch.full((1, 2, 2), v) for v in (0.3, 0.5)]), ["", ""], [{}, {}])
    assert out.scores.tolist() == [0.0, 2.0]  # weight 2 times 0 / 1
    for bad, needle in [
        ({"components": {"bold": 1.0}, "binary": {"bold": {"all_of": {"nope": 0.4}}}}, "unknown reward 'nope'"),
        ({"components": {"bold": 1.0}, "binary": {"bold": {"all_of": {}}}}, "all_of"),
        ({"components": {"bold": 1.0}, "binary": {"bold": {"all_of": {"bold": 0.1}}}}, "unknown reward 'bold'"),
    ]:
        with pytest.raises(Exception, match=needle):
            RewardConfig(**bad)


def test_the_presets_reward_is_the_sparse_one():
    config = load_config(B2)
    assert config.reward.binary["bold_digit"].all_of == {"ink": 0.36, "digit_classifier": 0.5}
    assert load_config(CONFIGS / "digits" / "grpo_sparse.yaml").reward == config.reward
