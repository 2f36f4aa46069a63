"""TempFlow-GRPO's noise-level step weighting against hand-derived numbers, and bench/time_to_reward.py: its
denoiser counters against a hand-counted tiny run, and its --quick mode end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, fast_overrides

from flowrl.config import load_config
from flowrl.objectives.functional import noise_level_step_weights
from flowrl.objectives.policy_gradient import transition_stds
from flowrl.prompts import prompt_pool
from flowrl.samplers.flow_sde import FlowSDEConfig
from flowrl.trainer import Trainer
from flowrl.types import Trajectory

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "time_to_reward.py"


def _bench():
    spec = importlib.util.spec_from_file_location("time_to_reward", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """The tiny runs are latency-bound: one intra-op thread is faster than two on a busy 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _trajectory(sigmas: list[float]) -> Trajectory:
    k = len(sigmas) - 1
    return Trajectory(
        latents=torch.randn(2, k + 1, 1, 2, 2),
        sigmas=torch.tensor(sigmas),
        log_probs=torch.zeros(2, k),
        stochastic=torch.ones(k, dtype=torch.bool),
        cond={},
        prompts=["a", "b"],
        metadata=[{}, {}],
        group_ids=torch.tensor([0, 0]),
    )


def test_noise_level_weights_hand_values():
    # Flow-GRPO SDE, a = 0.7, grid 1, 3/4, 1/2, 1/4, 0: std_k = g_k sqrt(sigma_k - sigma_k+1) = g_k / 2 with
    # g = 0.7 sqrt(sigma / (1 - sigma)) (at sigma = 1: 1 - sigma_next = 1/4), so
    # std = 0.7 * [sqrt(4), sqrt(3), 1, sqrt(1/3)] / 2 = [0.7, 0.35 sqrt 3, 0.35, 0.35 / sqrt 3].
    traj = _trajectory([1.0, 0.75, 0.5, 0.25, 0.0])
    stds = transition_stds(FlowSDEConfig(noise_level=0.7).build(), traj, [0, 1, 2, 3])
    hand = [0.7, 0.35 * math.sqrt(3), 0.35, 0.35 / math.sqrt(3)]
    assert stds.tolist() == pytest.approx(hand, rel=1e-6)
    # Trained steps {0, 2}: mean std 0.525, weights 0.7 / 0.525 = 4/3 and 0.35 / 0.525 = 2/3.
    assert noise_level_step_weights(stds[[0, 2]]).tolist() == pytest.approx([4 / 3, 2 / 3], rel=1e-6)
    # All four: w_k = std_k / mean, and they average to 1 (the loss scale of uniform weights).
    w = noise_level_step_weights(stds)
    assert w.tolist() == pytest.approx([h / (sum(hand) / 4) for h in hand], rel=1e-6)
    assert float(w.mean()) == pytest.approx(1.0)
    # DanceGRPO's constant g on a uniform grid: every std is eta sqrt(1/4), so every weight is exactly 1.
    dance = transition_stds(FlowSDEConfig(noise_level=0.3, diffusion="dance_grpo").build(), traj, [0, 1, 2, 3])
    assert noise_level_step_weights(dance).tolist() == pytest.approx([1.0] * 4, abs=1e-6)


def test_weighting_scales_each_step_policy_loss_and_leaves_ratios(tmp_path, one_thread):
    # The real digits model and GRPO objective on a real rollout of 3 steps (grid 1, 2/3, 1/3, 0), every step
    # trained. Flow-GRPO stds: 0.7 [sqrt(3) sqrt(1/3), sqrt(2) sqrt(1/3), sqrt(1/2) sqrt(1/3)] = 0.7 [1, sqrt(2/3),
    # sqrt(1/6)]; weights = those / their mean = 3 [1, sqrt(2/3), sqrt(1/6)] / (1 + sqrt(2/3) + sqrt(1/6)).
    config = load_config(
        CONFIGS / "digits" / "grpo.yaml",
        fast_overrides(
            tmp_path / "run",
            **{"rollout.num_inference_steps": 3, "objective.timestep_fraction": 1.0, "eval.judge": "null", "log.trackers": "[]"},
        ),
    )
    trainer = Trainer(config)
    batch = trainer.advantages(trainer.score(trainer.collect(0)))
    # Advantage 1 for every sample: at unchanged weights r = 1, so each step's clipped surrogate is exactly -1.
    batch.advantages = torch.ones(len(batch))
    objective = trainer.objective
    raw = [3**0.0, math.sqrt(2 / 3), math.sqrt(1 / 6)]
    hand = [3 * r / sum(raw) for r in raw]  # 1.3485, 1.1010, 0.5505
    losses = {}
    for weighting in ("none", "noise_level"):
        objective.step_weighting = weighting
        with torch.no_grad():
            losses[weighting] = list(objective.losses(trainer.pipeline, trainer.sampler, batch, torch.Generator().manual_seed(0)))
    assert [o.loss.item() for o in losses["none"]] == pytest.approx([-1 / 3] * 3, rel=1e-5)
    assert [o.loss.item() for o in losses["noise_level"]] == pytest.approx([-w / 3 for w in hand], rel=1e-5)
    for out in losses["noise_level"]:  # ratio == 1 and the logged (unweighted) policy loss are untouched
        assert out.metrics["policy/ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
        assert out.metrics["loss/policy"].item() == pytest.approx(-1.0, rel=1e-5)


@pytest.mark.slow
def test_bench_counts_denoiser_work_by_hand(one_thread):
    # One iteration, 2 prompts x 2 samples = 4 rows, 3 steps, evaluation 20 held-out prompts x 1 seed on 3 steps.
    bench = _bench()
    tiny = {
        "rollout.num_inference_steps": 3,
        "eval.num_inference_steps": 3,
        "train.prompts_per_iteration": 2,
        "train.num_generations": 2,
        "train.batch_size": 4,
        "eval.samples_per_prompt": 1,
    }
    n_eval = len(prompt_pool("digits", "eval"))
    assert n_eval == 20
    full = bench.run_method("full_sde", 0, math.inf, 1, 1, tiny)
    assert full["reached"] is None and [p["iteration"] for p in full["curve"]] == [0, 1]
    end = full["curve"][-1]
    # rollout: one call per step on all 4 rows; update: every step trained, one minibatch of 4 -> 3 calls, each backpropagated
    assert (end["rollout_forward_calls"], end["rollout_forwards"]) == (3, 3 * 4)
    assert (end["train_forward_calls"], end["train_forwards"], end["train_backwards"]) == (3, 3 * 4, 3 * 4)
    # two evaluations (before training and after iteration 1), 3 ODE steps on the 20 rows each, no gradient; every
    # call has exactly eval.batch_size rows (the last one padded), so 20 rows are 2 calls of 16 a step
    size = 16
    calls = math.ceil(n_eval / size)
    assert full["eval_work"] == {"eval_forward_calls": 2 * 3 * calls, "eval_forwards": 2 * 3 * calls * size, "eval_backwards": 0}
    # A 2-step SDE window: the rollout still runs 3 steps, the update only the 2 stochastic ones.
    window = bench.run_method("fast_window", 0, math.inf, 1, 1, tiny)["curve"][-1]
    assert (window["rollout_forwards"], window["train_forwards"], window["train_backwards"]) == (3 * 4, 2 * 4, 2 * 4)


@pytest.mark.slow
def test_bench_quick_prints_parseable_json():
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["methods"]) == {"full_sde", "fast_window"}
    # target 0 is reached at the first evaluation, so both have times and the speedup is their ratio
    times = {m: s["median_train_s"] for m, s in result["methods"].items()}
    assert all(t > 0 for t in times.values())
    best = min(times, key=times.get)
    assert result["best_method"] == best
    assert result["speedup_vs_full_sde"] == pytest.approx(times["full_sde"] / times[best], abs=2e-3)
    for s in result["methods"].values():
        assert s["reached_in_all_seeds"] and s["median_iterations"] == 1 and s["median_forwards"] > 0 and s["median_backwards"] > 0
        assert set(s["per_seed"]) == {"0"}
        # counted work = forward rows (rollout + update) + 2 x backward rows
        seed0 = s["per_seed"]["0"]
        assert s["median_work"] == seed0["work"] == seed0["rollout_forwards"] + seed0["train_forwards"] + 2 * seed0["backwards"]
    # work_speedup_vs_full_sde: the baseline's work / the least work among methods whose judge at the target is no
    # worse than the baseline's (the baseline itself qualifies)
    base = result["methods"]["full_sde"]
    eligible = {m: s["median_work"] for m, s in result["methods"].items() if s["median_reached_judge"] >= base["median_reached_judge"]}
    least = min(eligible, key=eligible.get)
    assert result["best_work_method"] == least
    assert result["work_speedup_vs_full_sde"] == pytest.approx(base["median_work"] / eligible[least], abs=2e-3)
    # 3 steps, 8 rows, one iteration: full_sde trains every step (24 rows through the update), fast_window 2 of 3
    assert base["median_work"] == 3 * 8 + 3 * 3 * 8
    assert result["methods"]["fast_window"]["median_work"] == 3 * 8 + 3 * 2 * 8


def test_bench_step_credit_methods_are_their_presets():
    # #40's objectives and their combinations are derived from their presets; the evaluation keeps 10 steps
    bench = _bench()
    for method, (objective, steps) in {
        "flash_grpo": ("flash_grpo", 10),
        "tree_grpo": ("tree_grpo", 10),
        "stepwise_grpo": ("stepwise_grpo", 10),
        "flash_grpo_5steps": ("flash_grpo", 5),
        "tree_grpo_5steps": ("tree_grpo", 5),
        "stepwise_grpo_window_5steps": ("stepwise_grpo", 5),
    }.items():
        config = bench.method_config(method, 0, "/tmp/unused")
        assert (config.objective.name, config.rollout.num_inference_steps, config.eval.num_inference_steps) == (objective, steps, 10)
    assert list(bench.method_config("tree_grpo_5steps", 0, "/tmp/unused").objective.branch_steps) == [0, 1, 2]
    best = bench.method_config("stepwise_grpo_window_3steps_lr5e-4", 0, "/tmp/unused")
    assert (best.rollout.num_inference_steps, best.rollout.sde_window_size, best.train.learning_rate) == (3, 2, 5e-4)
    for method in bench.METHODS:  # every entry is a valid config
        bench.method_config(method, 0, "/tmp/unused")


def test_work_speedup_skips_methods_with_a_worse_judge():
    bench = _bench()

    def entry(work, judge):
        return {"median_work": work, "median_reached_judge": judge}

    summary = {"full_sde": entry(1000, 0.80), "cheap_hack": entry(10, 0.70), "fair": entry(50, 0.80), "missed": entry(None, None)}
    assert bench.work_speedup(summary) == (20.0, "fair")
    assert bench.work_speedup({"full_sde": entry(None, None), "fair": entry(50, 0.9)}) == (None, None)


@pytest.mark.slow
def test_bench_refuses_unknown_method():
    proc = subprocess.run([sys.executable, str(BENCH), "--methods", "full_sde,nope"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0 and "unknown method 'nope'" in proc.stderr
