"""rollout.overlap_reward (issue #29 item 3): each rollout chunk is decoded and scored on a worker thread while the
next one is generated. Nothing changes numerically (weights and metrics bit for bit), the reward really runs during
the rollout, the perf/* split is logged, and what it cannot overlap is refused in one sentence."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl import Trainer, load_config
from flowrl.errors import FlowRLError
from flowrl.modalities.reward_overlap import RolloutScoring
from flowrl.reward_models import build_reward_from_config
from flowrl.types import RewardOutput

GRPO = CONFIGS / "digits" / "grpo.yaml"
# 2 groups of 4 samples in rollout chunks of 4: two chunks, the second generated while the first is scored
SMALL = {"train.prompts_per_iteration": 2, "train.num_generations": 4, "rollout.batch_size": 4, "rollout.num_inference_steps": 3}
PERF_KEYS = {"perf/rollout_s", "perf/decode_s", "perf/score_s", "perf/reward_wait_s", "perf/reward_hidden_s", "perf/update_s"}


def _two_iterations(tmp_path, overlap: bool):
    trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path, **SMALL, **{"rollout.overlap_reward": overlap})))
    rows = [trainer.train_iteration(i) for i in range(2)]
    return rows, {k: v.clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.slow
def test_overlap_on_and_off_train_the_same_bits(tmp_path):
    serial, serial_weights = _two_iterations(tmp_path / "off", False)
    overlapped, overlapped_weights = _two_iterations(tmp_path / "on", True)
    assert serial_weights.keys() == overlapped_weights.keys()
    assert all(torch.equal(serial_weights[k], overlapped_weights[k]) for k in serial_weights)
    no_perf = [[{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows] for rows in (serial, overlapped)]
    assert no_perf[0] == no_perf[1] and "reward/mean" in no_perf[0][1]
    for rows, overlap in ((serial, False), (overlapped, True)):
        for r in rows:
            assert PERF_KEYS <= r.keys() and all(r[k] >= 0 for k in PERF_KEYS)
            if overlap:  # only reward work can be hidden, and only what the worker did
                assert r["perf/reward_hidden_s"] <= r["perf/decode_s"] + r["perf/score_s"] + 1e-9
            else:  # serial: the loop waits for all of it and hides nothing
                assert r["perf/reward_hidden_s"] == 0.0 and r["perf/reward_wait_s"] == r["perf/score_s"]


class _HandShake:
    """A reward and a denoiser hook that wait for each other: the reward of the first rollout chunk returns only once
    the denoiser has run for the next chunk, and that run starts only once the reward has started. Both waits end
    (with a timeout, as a failure) unless the reward and the rollout really run at the same time."""

    def __init__(self, inner, steps_per_chunk: int):
        self.inner, self.steps_per_chunk = inner, steps_per_chunk
        self.armed, self.calls, self.denoiser_calls = False, 0, 0
        self.reward_started, self.next_chunk_denoised = threading.Event(), threading.Event()
        self.saw_next_chunk = self.saw_reward_start = None

    def denoised(self, *args) -> None:
        if not self.armed:
            return
        self.denoiser_calls += 1
        if self.denoiser_calls == self.steps_per_chunk + 1:  # the next chunk's first step
            self.saw_reward_start = self.reward_started.wait(timeout=60)
            self.next_chunk_denoised.set()

    def __call__(self, samples, prompts, metadata) -> RewardOutput:
        if self.armed:
            self.calls += 1
            if self.calls == 1:
                self.reward_started.set()
                self.saw_next_chunk = self.next_chunk_denoised.wait(timeout=60)
        return self.inner(samples, prompts, metadata)


@pytest.mark.usefixtures("one_thread")
def test_the_first_chunk_is_scored_while_the_next_is_generated(tmp_path):
    config = load_config(GRPO, fast_overrides(tmp_path, **SMALL, **{"rollout.overlap_reward": True}))
    shake = _HandShake(build_reward_from_config(config.reward), SMALL["rollout.num_inference_steps"])
    trainer = Trainer(config, reward={"watched": shake})
    trainer.pipeline.denoiser.register_forward_hook(shake.denoised)
    shake.armed = True
    metrics = trainer.train_iteration(0)
    assert shake.saw_reward_start is True and shake.saw_next_chunk is True
    assert shake.calls == 2  # one reward call per chunk
    assert metrics["perf/reward_hidden_s"] > 0  # all of the first chunk's reward ran before the rollout ended


@pytest.mark.filterwarnings("ignore:rollout.overlap_reward scores each rollout chunk by itself")
def test_a_failed_chunk_stops_the_rollout_with_the_rewards_error():
    failures = []

    def reward(samples, prompts, metadata):
        if prompts[0] == "b":
            failures.append(prompts[0])
            raise FlowRLError("the reward server answered 500 for chunk b.")
        return RewardOutput(samples.sum(1), {"twice": 2 * samples.sum(1)})

    scoring = RolloutScoring(reward, overlap=True)
    scoring.chunk(lambda: torch.ones(2, 3), ["a", "a"], [{}, {}])
    scoring.chunk(lambda: torch.ones(2, 3), ["b", "b"], [{}, {}])
    scoring._futures[-1].exception(timeout=30)  # chunk b has failed
    with pytest.raises(FlowRLError, match="500 for chunk b"):  # the next hand-over raises it, before generating more
        scoring.chunk(lambda: torch.ones(2, 3), ["c", "c"], [{}, {}])
    assert failures == ["b"]

    late = RolloutScoring(reward, overlap=True)  # a failure in the last chunk is raised by the join
    late.chunk(lambda: torch.ones(2, 3), ["b", "b"], [{}, {}])
    with pytest.raises(FlowRLError, match="500 for chunk b"):
        late.join()

    ok = RolloutScoring(reward, overlap=True)
    for rows in (2, 3):
        ok.chunk(lambda rows=rows: torch.arange(rows * 2.0).view(rows, 2), ["a"] * rows, [{}] * rows)
    ok.generated()
    samples, out = ok.join()
    assert [s.shape[0] for s in samples] == [2, 3]  # in chunk order
    assert out.scores.tolist() == [1.0, 5.0, 1.0, 5.0, 9.0] and out.extras["twice"].tolist() == [2.0, 10.0, 2.0, 10.0, 18.0]


@pytest.mark.parametrize(
    ("preset", "extra", "reason"),
    [
        ("adjoint_matching", {}, "trains on the reward's gradient"),
        ("b2_diffurl", {}, "rollout.branching rolls out a shared prefix"),
    ],
)
@pytest.mark.usefixtures("one_thread")
def test_what_cannot_overlap_is_refused_in_one_sentence(tmp_path, preset, extra, reason):
    overrides = fast_overrides(tmp_path, **{"rollout.overlap_reward": True, **extra})
    with pytest.raises(FlowRLError, match=reason) as caught:
        Trainer(load_config(CONFIGS / "digits" / f"{preset}.yaml", overrides))
    assert "set rollout.overlap_reward=false" in str(caught.value)


@pytest.mark.usefixtures("one_thread")
def test_text_overlap_scores_while_the_log_likelihoods_are_computed_with_the_same_bits(tmp_path):
    """A diffusion LM generates the whole batch at once; the reward of its completions runs while the rollout
    policy's log-likelihood estimates are computed, on the whole batch, so the bits cannot move."""
    results = {}
    for overlap in (False, True):
        overrides = [f"output_dir={tmp_path / str(overlap)}", "train.prompts_per_iteration=2", "train.num_generations=4"]
        overrides += ["train.batch_size=4", "prompts.eval_size=4", "log.progress=false", f"rollout.overlap_reward={overlap}"]
        trainer = Trainer(load_config(CONFIGS / "dllm" / "diffu_grpo.yaml", overrides))
        metrics = trainer.train_iteration(0)
        assert {"perf/reward_wait_s", "perf/reward_hidden_s"} <= metrics.keys()
        results[overlap] = ({k: v for k, v in metrics.items() if not k.startswith("perf/")}, trainer.module.state_dict())
    assert results[False][0] == results[True][0] and "reward/mean" in results[True][0]
    assert all(torch.equal(results[False][1][k], results[True][1][k]) for k in results[False][1])


def test_a_small_chunk_is_warned_about_once():
    scoring = RolloutScoring(lambda samples, prompts, metadata: RewardOutput(samples.sum(1), {}), overlap=True)
    with pytest.warns(UserWarning, match="holds 1 sample") as caught:
        scoring.chunk(lambda: torch.ones(1, 3), ["a"], [{}])
        scoring.chunk(lambda: torch.ones(1, 3), ["b"], [{}])
    assert len([w for w in caught if "sample(s)" in str(w.message)]) == 1
    assert scoring.join()[1].scores.tolist() == [3.0, 3.0]
