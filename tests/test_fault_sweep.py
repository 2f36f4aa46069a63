"""Fault injection in CI (issue #31 item 5): a reduced set of scripts/fault_sweep.py, run with its own functions.

The full sweep (``python scripts/fault_sweep.py``: SIGKILL at every phase of an iteration and before every file of a
checkpoint, a full disk and a read-only directory at every write of a run, a reward server killed, hung and restarted;
its table is in docs/failure_behaviour.md) takes about half an hour on one core. CI runs what covers the most in
about a minute: one run killed twice (mid-evaluation, after the iteration's update, and mid-checkpoint-file, whose
hidden temporary the next start must remove) and resumed each time, and a reward server killed while the run waits
for scores and restarted within the client's retry_for; each must end bit-for-bit equal to the uninterrupted run. A
kill mid-checkpoint (tests/test_runs.py) and a full or read-only disk (tests/test_failure_behaviour.py) are tested
elsewhere; the last test here keeps the bug the sweep found fixed (an iteration whose evaluation failed was saved
without its metrics line, and a resume never wrote it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fault_sweep as sweep  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return sweep.reference(tmp_path_factory.mktemp("uninterrupted"), in_process=True)


@pytest.mark.slow
def test_a_run_killed_mid_evaluation_and_mid_checkpoint_file_resumes_bit_for_bit(uninterrupted, tmp_path):
    result = sweep.kill_chain(["evaluate@2", "checkpoint:optimizer.safetensors@3"], tmp_path, uninterrupted)
    assert result.survived, result.detail
    assert "(the kill left checkpoints/.flowrl-tmp-step_000003-" in result.detail, result.detail  # and the resume removed it


@pytest.mark.slow
def test_a_reward_server_killed_mid_run_and_restarted_within_retry_for_changes_nothing(uninterrupted, tmp_path):
    # The remote reward scores exactly as the rewards in process do, so the uninterrupted in-process run is the
    # reference for everything but the metrics' names (remote/...).
    result = sweep.server_case("restart", tmp_path, uninterrupted, compare=("checkpoints", "samples", "summary"))
    assert result.survived, result.detail


def judge_failing_at(evaluation: int):
    """A judge whose ``evaluation``-th held-out evaluation fails, as a reward server that went away would."""
    evaluations = []

    def flaky_judge(samples, prompts, metadata):
        if len(samples) > 2:  # an evaluation, not the two-sample probe at start
            evaluations.append(len(samples))
            if len(evaluations) == evaluation:
                raise FlowRLError("the judge's server did not answer.")
        return samples.flatten(1).mean(1)

    return flaky_judge


@pytest.mark.slow
def test_an_iteration_whose_evaluation_failed_is_not_saved_so_the_resume_evaluates_and_logs_it(tmp_path):
    run = tmp_path / "run"
    config = load_config(sweep.GRPO, sweep.run_overrides(run, **{"train.iterations": 2}))  # evaluations at 0 and 2
    with pytest.raises(FlowRLError) as info:
        Trainer(config, judge=judge_failing_at(2)).fit()
    assert str(info.value) == (
        "the judge's server did not answer; iteration 2 was not saved (the failure came before its metrics were logged), "
        "so resume_from=latest continues from step_000001."
    )
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000001"]
    resumed = load_config(sweep.GRPO, [*sweep.run_overrides(run, **{"train.iterations": 2}), "resume_from=latest"])
    assert Trainer(resumed, judge=judge_failing_at(0)).fit()["status"] == "completed"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and "eval/judge/mean" in records[2]
