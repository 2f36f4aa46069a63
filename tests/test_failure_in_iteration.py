"""No failure loses work (issue #44 item 1; docs/failure_behaviour.md, "A part that raises"): an exception of any type
inside an iteration, from a user's part given by import path (a reward, an objective) or from flowrl itself, ends the
run with one sentence naming the part, its error, the iteration and the user's own line; the traceback in the run's
error.log (and on stderr under --debug); exit 2; the last completed iteration checkpointed; summary.json ``failed``;
and ``resume_from=latest`` with the part fixed continues from it, to the weights of a run that never failed. A user's
prompt source is read before the first iteration, so its failure is a refused start, said the same way. In 2
processes a reward that fails on one process alone stops both at once.

The user's parts are a package written into tmp_path (a fresh name per test: a registry remembers what it loaded), put
on the Python path, and told where to fail by FLOWRL_TEST_FAIL=<part>@<iteration> (FLOWRL_TEST_FAIL_RANK: on that
process only), read at each call.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, REPO, fast_overrides, launch_report, run_launch
from safetensors.torch import load_file

from flowrl.cli import main
from flowrl.training.checkpoint import verify_checkpoint

GRPO = CONFIGS / "digits" / "grpo.yaml"
ITERATIONS = 3
TRAIN_ROWS = 8  # train.prompts_per_iteration 2 x num_generations 4: a rollout batch, never a probe (2) or evaluation (20)

pytestmark = pytest.mark.usefixtures("one_thread")

PARTS = textwrap.dedent('''
    """A user's parts that fail where FLOWRL_TEST_FAIL says: reward@N, objective@N, prompts."""
    import os

    from flowrl.objectives.grpo import GRPOConfig

    CALLS = {"rollouts": 0}


    def failing(part, iteration):
        name, _, at = os.environ.get("FLOWRL_TEST_FAIL", "").partition("@")
        only = os.environ.get("FLOWRL_TEST_FAIL_RANK")
        here = only is None or only == os.environ.get("RANK", "0")
        return name == part and here and (not at or iteration >= int(at))


    def reward(samples, prompts, metadata):
        if len(samples) == int(os.environ.get("FLOWRL_TEST_TRAIN_ROWS", "-1")):  # a rollout batch: one per iteration
            CALLS["rollouts"] += 1
            if failing("reward", CALLS["rollouts"]):
                raise ValueError(f"the scorer broke in iteration {CALLS['rollouts']}")  # REWARD LINE
        return samples.flatten(1).mean(1)


    class FailingGRPOConfig(GRPOConfig):
        """objective.name: <package>.parts:FailingGRPOConfig. GRPO, whose losses fail from iteration N on."""

        name: str = "failing_grpo"

        def build(self, context=None):
            objective = super().build(context)
            prepare, losses, seen = objective.prepare, objective.losses, {"iterations": 0}

            def counted_prepare(batch):
                seen["iterations"] += 1
                return prepare(batch)

            def failing_losses(pipeline, sampler, batch, generator):
                if failing("objective", seen["iterations"]):
                    raise RuntimeError(f"the loss broke in iteration {seen['iterations']}")  # OBJECTIVE LINE
                yield from losses(pipeline, sampler, batch, generator)

            objective.prepare, objective.losses = counted_prepare, failing_losses
            return objective


    def prompts(split):
        if failing("prompts", 0):
            raise ConnectionError(f"the prompt service is down (split {split})")  # PROMPTS LINE
        return [("a handwritten seven", {"digit": 7}), ("the digit 3", {"digit": 3})]
''')


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(PARTS.splitlines(), 1) if f"# {marker}" in text)


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A fresh user package on the Python path (of this process and of the subprocesses it starts); its name."""
    name = f"user_parts_{uuid.uuid4().hex[:8]}"
    (tmp_path / "lib" / name).mkdir(parents=True)
    (tmp_path / "lib" / name / "__init__.py").write_text("")
    (tmp_path / "lib" / name / "parts.py").write_text(PARTS)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "lib"), str(REPO)]))
    monkeypatch.setenv("FLOWRL_TEST_TRAIN_ROWS", str(TRAIN_ROWS))
    monkeypatch.delenv("FLOWRL_TEST_FAIL", raising=False)
    monkeypatch.delenv("FLOWRL_TEST_FAIL_RANK", raising=False)
    return name


def overrides(run: Path, package: str, objective: bool = False, **extra: object) -> list[str]:
    """The digits GRPO preset at a few seconds a run, with the user's reward (and objective)."""
    parts = {
        "train.iterations": ITERATIONS,
        "log.trackers": "[]",
        "reward.components": "{" + f'"{package}.parts:reward": 1.0' + "}",
        **({"objective.name": f"{package}.parts:FailingGRPOConfig"} if objective else {}),
        **extra,
    }
    return fast_overrides(run, **parts)


def user_file(tmp_path: Path, package: str) -> Path:
    """The user's file as a sentence shows it: relative to the working directory when under it (the subprocesses
    here run in tmp_path), else in full (this process runs in the repository)."""
    path = tmp_path / "lib" / package / "parts.py"
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def the_sentence(err: str) -> str:
    """The one ``flowrl: error:`` line, with no traceback anywhere on stderr (other lines are libraries' notices)."""
    lines = [line for line in err.splitlines() if line.startswith("flowrl: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def summary_of(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("step_*"))


def train(argv: list[str], capsys) -> tuple[int, str]:
    code = main(["train", *argv])
    return code, capsys.readouterr().err


# ------------------------------------------------------------------ one process


@pytest.mark.slow
def test_a_reward_that_raises_in_a_later_iteration_ends_the_run_in_one_sentence_and_keeps_iteration_1(tmp_path, user):
    """The reported bug, through a real `flowrl train` process: the reward passes the probe and the evaluation
    before training, scores iteration 1, and raises in iteration 2."""
    run = tmp_path / "run"
    env = {**os.environ, "FLOWRL_TEST_FAIL": "reward@2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flowrl.cli", "train", str(GRPO), *overrides(run, user)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    parts_py, shown = tmp_path / "lib" / user / "parts.py", Path("lib", user, "parts.py")  # the subprocess runs in tmp_path
    step1 = run / "checkpoints" / "step_000001"
    assert the_sentence(proc.stderr) == (
        f"flowrl: error: in iteration 2 the reward '{user}.parts:reward' raised ValueError: the scorer broke in "
        f"iteration 2 (at {shown}:{line_of('REWARD LINE')}); the run stopped with iteration 1 saved in {step1} "
        f"(resume with resume_from=latest); the traceback is in {run / 'error.log'}."
    )
    log = (run / "error.log").read_text()
    assert f'File "{parts_py}", line {line_of("REWARD LINE")}, in reward' in log and "ValueError: the scorer broke" in log
    summary = summary_of(run)
    assert summary["status"] == "failed" and summary["reason"] == the_sentence(proc.stderr).removeprefix("flowrl: error: ")
    assert summary["iterations_completed"] == 1 and checkpoints(run) == ["step_000001"]
    assert verify_checkpoint(step1)["iteration"] == 1

    # the reward fixed, the resume continues from iteration 1 and completes (in this process: a second one adds 10 s)
    assert main(["train", str(GRPO), *overrides(run, user), "resume_from=latest"]) == 0
    assert summary_of(run)["status"] == "completed" and summary_of(run)["iterations_completed"] == ITERATIONS
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert not (run / "error.log").exists()  # the failure it continued past is not left beside a completed run


@pytest.mark.slow
def test_a_reward_that_raises_in_iteration_1_says_so_and_prints_the_traceback_under_debug(tmp_path, user, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("FLOWRL_TEST_FAIL", "reward@1")
    code, err = train([str(GRPO), *overrides(run, user), "--debug"], capsys)
    assert code == 2
    parts_py = user_file(tmp_path, user)
    sentence = [line for line in err.splitlines() if line.startswith("flowrl: error: ")]
    assert sentence == [
        f"flowrl: error: in iteration 1 the reward '{user}.parts:reward' raised ValueError: the scorer broke in "
        f"iteration 1 (at {parts_py}:{line_of('REWARD LINE')}); no iteration had completed, so there is nothing to "
        f"resume; the traceback is in {run / 'error.log'}."
    ]
    assert err.index("Traceback (most recent call last)") < err.index("flowrl: error: ")  # --debug: the traceback first
    assert f'File "{parts_py}", line {line_of("REWARD LINE")}, in reward' in err
    assert summary_of(run)["status"] == "failed" and checkpoints(run) == []

    monkeypatch.delenv("FLOWRL_TEST_FAIL")  # nothing to resume: resume_from=latest starts afresh, and completes
    code, err = train([str(GRPO), *overrides(run, user), "resume_from=latest"], capsys)
    assert code == 0 and "holds no complete checkpoint, so the run starts afresh" in err
    assert summary_of(run)["status"] == "completed"


@pytest.mark.slow
def test_an_objective_that_raises_in_a_later_iteration_keeps_iteration_1_and_the_resume_ends_where_an_unbroken_run_does(
    tmp_path, user, capsys, monkeypatch
):
    """The objective's losses raise in iteration 2 before any optimizer step: the weights and the objective's state
    in memory are still iteration 1's, so they are saved, and the resumed run ends with the weights of a run that
    never failed, bit for bit."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    assert train([str(GRPO), *overrides(reference, user, objective=True)], capsys)[0] == 0

    monkeypatch.setenv("FLOWRL_TEST_FAIL", "objective@2")
    code, err = train([str(GRPO), *overrides(run, user, objective=True)], capsys)
    assert code == 2
    step1 = run / "checkpoints" / "step_000001"
    assert the_sentence(err) == (
        f"flowrl: error: in iteration 2 the objective '{user}.parts:FailingGRPOConfig' raised RuntimeError: the loss "
        f"broke in iteration 2 (at {user_file(tmp_path, user)}:{line_of('OBJECTIVE LINE')}); the run stopped with iteration 1 "
        f"saved in {step1} (resume with resume_from=latest); the traceback is in {run / 'error.log'}."
    )
    assert f"line {line_of('OBJECTIVE LINE')}, in failing_losses" in (run / "error.log").read_text()
    assert summary_of(run)["status"] == "failed" and checkpoints(run) == ["step_000001"]

    monkeypatch.delenv("FLOWRL_TEST_FAIL")
    assert train([str(GRPO), *overrides(run, user, objective=True), "resume_from=latest"], capsys)[0] == 0
    final = "checkpoints/step_000003/denoiser.safetensors"
    resumed, unbroken = load_file(run / final), load_file(reference / final)
    assert resumed.keys() == unbroken.keys() and all(torch.equal(resumed[k], unbroken[k]) for k in unbroken)


@pytest.mark.slow
def test_an_objective_that_raises_in_iteration_1_leaves_nothing_to_resume_and_says_so(tmp_path, user, capsys, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("FLOWRL_TEST_FAIL", "objective@1")
    code, err = train([str(GRPO), *overrides(run, user, objective=True)], capsys)
    assert code == 2
    assert the_sentence(err).startswith(
        f"flowrl: error: in iteration 1 the objective '{user}.parts:FailingGRPOConfig' raised RuntimeError: the loss "
        f"broke in iteration 1 (at {user_file(tmp_path, user)}:{line_of('OBJECTIVE LINE')}); no iteration had completed, so "
        "there is nothing to resume; the traceback is in "
    )
    assert summary_of(run)["status"] == "failed" and summary_of(run)["iterations_completed"] == 0 and checkpoints(run) == []


@pytest.mark.slow
def test_a_bug_in_flowrl_itself_is_said_as_an_internal_error_with_the_work_saved(tmp_path, user, capsys, monkeypatch):
    from flowrl.training.loop import TrainingLoop

    prepare = TrainingLoop.prepare

    def broken_prepare(self, batch):  # flowrl's own code failing in iteration 2
        if self.nonfinite[-1][0] == 1:
            return {}["advantages"]
        return prepare(self, batch)

    monkeypatch.setattr(TrainingLoop, "prepare", broken_prepare)
    run = tmp_path / "run"
    code, err = train([str(GRPO), *overrides(run, user)], capsys)
    assert code == 2
    sentence = the_sentence(err)
    assert re.fullmatch(
        r"flowrl: error: in iteration 2 flowrl failed with an internal error, KeyError: 'advantages' \(at "
        r"flowrl/training/loop\.py:\d+\); the run stopped with iteration 1 saved in .*step_000001 \(resume with "
        r"resume_from=latest\); please report this bug in flowrl with the traceback in .*error\.log\.",
        sentence,
    ), sentence
    assert "KeyError: 'advantages'" in (run / "error.log").read_text() and checkpoints(run) == ["step_000001"]


@pytest.mark.slow
def test_a_prompt_source_that_raises_is_a_refused_start_naming_it_and_its_line(tmp_path, user, capsys, monkeypatch):
    """A prompt source is read before the first iteration (both splits, into lists), so it cannot fail inside one: its
    failure refuses the start, before anything is written, in one sentence naming it and the user's line; --debug
    prints the traceback."""
    run = tmp_path / "run"
    monkeypatch.setenv("FLOWRL_TEST_FAIL", "prompts")
    argv = [str(GRPO), *overrides(run, user, **{"prompts.dataset": f"{user}.parts:prompts"})]
    code, err = train(argv, capsys)
    assert code == 2 and the_sentence(err) == (
        f"flowrl: error: prompt source '{user}.parts:prompts' failed for split 'train' (ConnectionError: the prompt "
        f"service is down (split train), at {user_file(tmp_path, user)}:{line_of('PROMPTS LINE')})."
    )
    assert not run.exists()
    code, err = train([*argv, "--debug"], capsys)
    parts_py = tmp_path / "lib" / user / "parts.py"
    assert code == 2 and f'File "{parts_py}", line {line_of("PROMPTS LINE")}, in prompts' in err


# ------------------------------------------------------------------ two processes


def _launch(run: Path, package: str, env: dict, *extra: str) -> subprocess.CompletedProcess:
    launch = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "accelerate" / "ddp.yaml")]
    launch += ["--num_processes", "2", "--main_process_port", "0", "-m", "flowrl.cli"]
    cmd = [sys.executable, *launch, "train", str(GRPO), *overrides(run, package), *extra]
    return run_launch(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=run.parent)


@pytest.mark.slow
def test_a_reward_that_raises_on_one_of_two_processes_stops_both_with_iteration_1_saved_and_resumes(tmp_path, user):
    """Process 1's reward raises in iteration 2; process 0 is well and would wait for it in the next collective: the
    loop's check before it tells process 0, both save iteration 1 together, process 0 prints the sentence once and
    writes summary.json, both exit 2. The resume, in 2 processes with the reward fixed, completes."""
    run = tmp_path / "run"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "FLOWRL_TEST_FAIL": "reward@2",
        "FLOWRL_TEST_FAIL_RANK": "1",
        "FLOWRL_TEST_TRAIN_ROWS": str(TRAIN_ROWS // 2),  # each process's share of a rollout batch
    }
    proc = _launch(run, user, env)
    assert proc.returncode != 0, launch_report(proc)
    parts_py, shown = tmp_path / "lib" / user / "parts.py", Path("lib", user, "parts.py")  # the subprocess runs in tmp_path
    step1 = run / "checkpoints" / "step_000001"
    assert the_sentence(proc.stdout + proc.stderr.split("Traceback (most recent call last)")[0]) == (
        f"flowrl: error: in iteration 2 the reward '{user}.parts:reward' raised ValueError: the scorer broke in "
        f"iteration 2 (at {shown}:{line_of('REWARD LINE')}); the run stopped with iteration 1 saved in {step1} "
        f"(resume with resume_from=latest); the traceback is in {run / 'error.rank1.log'}."
    ), launch_report(proc)
    assert "exitcode  : 2" in proc.stderr, launch_report(proc)  # the launcher's report: the worker's own exit status
    assert f'File "{parts_py}", line {line_of("REWARD LINE")}, in reward' in (run / "error.rank1.log").read_text()
    assert not (run / "error.log").exists()  # process 0 did not fail
    summary = summary_of(run)
    assert summary["status"] == "failed" and summary["iterations_completed"] == 1 and checkpoints(run) == ["step_000001"]
    assert verify_checkpoint(step1)["iteration"] == 1

    env.pop("FLOWRL_TEST_FAIL")
    proc = _launch(run, user, env, "resume_from=latest")
    assert proc.returncode == 0, launch_report(proc)
    assert summary_of(run)["status"] == "completed" and summary_of(run)["iterations_completed"] == ITERATIONS
