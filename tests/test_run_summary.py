"""What ``flowrl train`` ends with: a few lines a person reads by default, the whole summary as one JSON line with
``--json``. On a real short run of the digits preset: the lines say how it ended and the held-out reward before ->
after as summary.json records it, name the run's files that exist, and every command they suggest parses and names
a checkpoint that exists (sample and export are run); a stopped run is told how to resume from its own config."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import CONFIGS, fast_overrides

from flowrl.cli import _parser, main
from flowrl.training.run_summary import duration, human_summary

GRPO = CONFIGS / "digits" / "grpo.yaml"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """(run directory, what ``flowrl train`` printed) of one 2-iteration run."""
    run = tmp_path_factory.mktemp("summary") / "run"
    capture = pytest.MonkeyPatch()
    printed: list[str] = []
    capture.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
    try:
        assert main(["train", str(GRPO), *fast_overrides(run, **{"log.checkpoint_every": 2})]) == 0
    finally:
        capture.undo()
    return run, "\n".join(printed)


def next_commands(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("  next: "))
    return [shlex.split(line.replace("  next: ", "", 1).strip()) for line in lines[start:]]


def test_a_finished_run_ends_with_lines_a_person_reads(finished):
    run, text = finished
    summary = json.loads((run / "summary.json").read_text())
    assert text == human_summary(summary, run)
    lines = text.splitlines()
    assert lines[0].startswith("flowrl: completed 2 of 2 iterations in ") and lines[0].endswith("(8 samples each).")
    before, after = summary["eval_reward_initial"], summary["eval_reward_final"]
    assert lines[1] == f"  held-out reward: {before:.4f} -> {after:.4f} ({after - before:+.4f}) after iteration 2"
    assert lines[2].startswith(f"  run: {run} (samples_before.png, samples_after.png, reward_curve.png")
    assert len(text) < 800  # not the 5 KB spec: that stays in summary.json


def test_the_suggested_commands_parse_and_run(finished, tmp_path):
    run, text = finished
    commands = next_commands(text)
    assert [c[:2] for c in commands] == [["flowrl", "eval"], ["flowrl", "sample"], ["flowrl", "export"]]
    checkpoint = run / "checkpoints" / "step_000002"
    for command in commands:
        args = _parser().parse_args(command[1:])
        assert getattr(args, "source", getattr(args, "checkpoint", None)) == str(checkpoint)
    assert main(commands[1][1:]) == 0  # no --out: a new folder under the run, never over another command's file
    assert len(list((run / "outputs").glob("sample_*/samples.png"))) == 1
    export = [*commands[2][1:-1], str(tmp_path / "exported")]
    assert main(export) == 0 and (tmp_path / "exported").is_dir()


def test_json_prints_the_summary_for_scripts(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1}), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads((run / "summary.json").read_text()) and printed["status"] == "completed"


def test_a_stopped_run_is_told_how_to_resume(finished):
    run, _ = finished
    summary = {**json.loads((run / "summary.json").read_text()), "status": "preempted", "iterations_completed": 1}
    summary["reason"] = "stopped by SIGTERM (preemption) after iteration 1; resume with resume_from=latest."
    lines = human_summary(summary, run).splitlines()
    assert lines[0].startswith("flowrl: preempted 1 of 2 iterations") and lines[1] == f"  why: {summary['reason']}"
    (resume,) = next_commands("\n".join(lines))
    assert resume == ["flowrl", "train", str(run / "config.yaml"), "resume_from=latest"]
    args = _parser().parse_args(resume[1:])
    assert args.config == str(run / "config.yaml") and args.overrides == ["resume_from=latest"]


def test_durations_read_as_a_person_would_say_them():
    assert [duration(s) for s in (0.4, 48, 141, 3599.6, 3900)] == ["0 s", "48 s", "2 min 21 s", "1 h 00 min", "1 h 05 min"]
