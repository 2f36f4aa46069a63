"""The trainer end to end on the embedded models: smoke, resume equivalence, NaN rewards, 2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import CONFIGS, REPO, fast_overrides, launch_report, run_launch
from safetensors.torch import load_file

from flowrl.config import load_config
from flowrl.reward_models import build_reward_from_config
from flowrl.trainer import Trainer
from flowrl.types import RewardOutput

GRPO = CONFIGS / "digits" / "grpo.yaml"
DDPO = CONFIGS / "digits" / "ddpo.yaml"
TRAIN_KEYS = {
    "step",
    "reward/mean",
    "reward/std",
    "reward/nonfinite_count",
    "reward/digit_classifier",
    "loss/policy",
    "policy/ratio_mean",
    "policy/clipfrac",
    "policy/approx_kl",
    "train/grad_norm",
    "perf/rollout_s",
    "perf/score_s",
    "perf/update_s",
}


@pytest.mark.parametrize("config", [GRPO, DDPO], ids=["grpo", "ddpo"])
@pytest.mark.slow
def test_two_iterations_change_every_parameter_and_log_keys(tmp_path, config):
    cfg = load_config(config, fast_overrides(tmp_path, **{"train.weight_decay": 0.0, "train.learning_rate": 1e-3}))
    trainer = Trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.pipeline.denoiser.named_parameters()}
    summary = trainer.fit()
    after = dict(trainer.pipeline.denoiser.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"parameters not updated: {unchanged[:5]}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "eval/reward/mean" in records[0] and "eval/reward/mean" in records[-1]
    for r in records[1:]:
        assert TRAIN_KEYS <= set(r), TRAIN_KEYS - set(r)
    for name in ("config.yaml", "summary.json", "reward_curve.png", "samples_before.png", "samples_after.png"):
        assert (tmp_path / name).is_file(), name
    assert list((tmp_path / "tensorboard").iterdir())
    ckpt = tmp_path / "checkpoints" / "step_000002"
    assert torch.equal(load_file(ckpt / "denoiser.safetensors")["conv_in.weight"], after["conv_in.weight"].detach())
    assert summary["eval_reward_initial"] == records[0]["eval/reward/mean"]
    assert not [p for p in tmp_path.rglob(".*") if p.name.startswith(".") and p.is_file()]  # no temp leftovers


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    extra = {"train.iterations": 4, "eval.every": 2, "log.checkpoint_every": 2, "objective.beta": 0.01}
    full = Trainer(load_config(DDPO, fast_overrides(tmp_path / "full", **extra)))
    full.fit()
    Trainer(load_config(DDPO, fast_overrides(tmp_path / "cut", **extra, **{"train.stop_after": 3}))).fit()
    resumed = Trainer(load_config(DDPO, fast_overrides(tmp_path / "cut", **extra, resume_from="latest")))
    summary = resumed.fit()
    assert summary["iterations_completed"] == 4

    def metrics(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]

    # The interrupted run logged step 3 past its last checkpoint (step 2); resume drops and redoes it.
    assert metrics(tmp_path / "cut") == metrics(tmp_path / "full")
    a = load_file(tmp_path / "full" / "checkpoints" / "step_000004" / "denoiser.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoints" / "step_000004" / "denoiser.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


class NaNEveryThird:
    """Wraps the real reward and makes every third score non-finite (the trainer is under test here)."""

    def __init__(self, inner):
        self.inner, self.name, self.differentiable = inner, "nan_every_third", False

    def __call__(self, samples, prompts, metadata):
        out = self.inner(samples, prompts, metadata)
        scores = out.scores.clone()
        scores[::3] = float("nan")
        scores[1::6] = float("inf")
        return RewardOutput(scores, out.extras)


@pytest.mark.slow
def test_nonfinite_rewards_are_dropped_and_counted(tmp_path):
    config = load_config(GRPO, fast_overrides(tmp_path))
    trainer = Trainer(config, reward=NaNEveryThird(build_reward_from_config(config.reward)))
    with pytest.warns(UserWarning, match="NaN or infinite"):
        trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["reward/nonfinite_count"] == 5  # of 8 samples: indices 0, 3, 6 (nan) and 1, 7 (inf)
    assert all(torch.isfinite(p).all() for p in trainer.pipeline.denoiser.parameters())
    assert rows[1]["reward/mean"] is not None and rows[1]["loss/policy"] is not None


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes(tmp_path):
    # accelerate's --cpu flag always takes its single-process launcher; several CPU processes come from its
    # torchrun path (--multi_gpu), which on a machine without GPUs gives DistributedType.MULTI_CPU over gloo.
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
        "-m",
        "flowrl.cli",
        "train",
        str(GRPO),
        *fast_overrides(tmp_path, **{"log.checkpoint_every": 1}),
        "--json",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_launch(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, launch_report(proc)
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and json.loads(summaries[0])["status"] == "completed"  # printed by the main process only
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # logged once, by the main process
    state = json.loads((tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert len(state["objective"]) == 2  # one objective state per process
    w1 = load_file(tmp_path / "checkpoints" / "step_000001" / "denoiser.safetensors")
    w2 = load_file(tmp_path / "checkpoints" / "step_000002" / "denoiser.safetensors")
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.slow
def test_ctrl_c_while_an_iteration_is_being_logged_stops_after_the_next_with_its_evaluation(tmp_path):
    """The Ctrl-C race CI once hit: the signal lands after an iteration decided not to evaluate (here: while
    iteration 1 is being written to metrics.jsonl). The run finishes iteration 2, evaluates and saves it."""
    trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path, **{"train.iterations": 5})))
    log = trainer.logger.log

    def log_then_interrupt(step, metrics):
        log(step, metrics)
        if step == 1:
            trainer.run.request_stop(None, None)  # what the SIGINT handler runs

    trainer.logger.log = log_then_interrupt
    summary = trainer.fit()
    assert summary["status"] == "interrupted" and summary["iterations_completed"] == 2
    assert summary["eval_reward_final_step"] == 2
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"


@pytest.mark.slow
def test_ctrl_c_finishes_the_iteration_and_saves(tmp_path):
    """SIGINT mid-run: the current iteration completes, a checkpoint is written, the exit is clean."""
    import signal
    import time

    cmd = [sys.executable, "-m", "flowrl.cli", "train", str(GRPO), *fast_overrides(tmp_path, **{"train.iterations": 200})]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_early"] and 1 <= summary["iterations_completed"] < 200
    done = summary["iterations_completed"]
    assert summary["status"] == "interrupted" and summary["reason"] == f"stopped by Ctrl-C after iteration {done}."
    assert (tmp_path / "checkpoints" / f"step_{done:06d}" / "denoiser.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{done:06d}"
    # The final eval reward is that of the stopped weights (evaluated at the stop), not the one before training.
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == done and summary["eval_reward_final_step"] == done
    assert summary["eval_reward_final"] == rows[-1]["eval/reward/mean"] != summary["eval_reward_initial"]
    assert (tmp_path / "samples_after.png").is_file()


def test_rollouts_run_the_denoiser_in_eval_mode_after_an_update(tmp_path):
    """update() puts the model in train mode; the next rollouts must not sample with dropout on."""
    trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path)))
    trainer.train_iteration(0)  # collect -> ... -> update: ends in train mode
    assert trainer.module.training
    seen = []
    handle = trainer.module.register_forward_pre_hook(lambda module, args: seen.append(module.training))
    try:
        trainer.collect(1)
    finally:
        handle.remove()
    assert seen and not any(seen)
