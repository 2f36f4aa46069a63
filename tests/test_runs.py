"""A run is never crossed, mis-resumed or silently changed (issue #32): the output directory is locked for the life of
a run, a resume is compared with the checkpoint's config, a mapping given on the command line replaces the preset's,
SIGTERM stops like Ctrl-C and says "preempted", a run killed before its first checkpoint can start again, the thread
count is flowrl's own, and a reward's metadata needs are checked against SePPO's winners too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CONFIGS, REPO, fast_overrides

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.trainer import Trainer

GRPO = CONFIGS / "digits" / "grpo.yaml"
DDPO = CONFIGS / "digits" / "ddpo.yaml"


def flowrl_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "flowrl.cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def wait_for(condition, seconds: float = 300) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- one run per output directory ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_runs_started_together_into_one_directory_one_is_refused(tmp_path):
    run = tmp_path / "twin"
    procs = [flowrl_process("train", str(GRPO), *fast_overrides(run, **{"train.iterations": 3, "seed": s}), "--json") for s in (0, 1)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-500:] for _, _, err in results]
    refused = next(err for code, _, err in results if code == 2)
    assert refused.count("\n") == 1 and (" is in use by another flowrl run (pid " in refused or "already holds a run" in refused), refused
    assert steps(run) == [0, 1, 2, 3]  # every step once, from the one run that trained
    winner = next(out for code, out, _ in results if code == 0)
    summary = json.loads(winner.strip().splitlines()[-1])
    assert summary == json.loads((run / "summary.json").read_text())  # the summary printed is the run's own


@pytest.mark.slow
def test_a_running_run_refuses_a_second_run_and_a_resume_naming_its_pid(tmp_path):
    run = tmp_path / "run"
    first = flowrl_process("train", str(GRPO), *fast_overrides(run, **{"train.iterations": 5000, "log.checkpoint_every": 1}))
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").is_file())
        # stopped, it still holds its lock but leaves the CPU to the three runs it must refuse
        first.send_signal(signal.SIGSTOP)
        holder = f"pid {first.pid} on "
        for extra in ([], ["resume_from=latest"], ["overwrite=true"]):
            second = flowrl_process("train", str(GRPO), *fast_overrides(run), *extra)
            code, (_, err) = second.wait(timeout=300), second.communicate()
            assert code == 2 and err.startswith(f"flowrl: error: output_dir '{run}' is in use by another flowrl run ({holder}"), err
            assert err.rstrip().endswith("); wait for it to end, or choose another output_dir.") and err.count("\n") == 1
        assert first.poll() is None  # the running run is still there
    finally:
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=300)
    assert first.returncode == 143


@pytest.mark.slow
def test_the_lock_is_the_kernels_a_killed_run_leaves_none(tmp_path):
    run = tmp_path / "run"
    first = flowrl_process("train", str(GRPO), *fast_overrides(run, **{"train.iterations": 60, "log.checkpoint_every": 1}))
    wait_for(lambda: (run / "checkpoints" / "latest").is_file())
    first.kill()
    first.wait(timeout=60)
    assert (run / "flowrl.lock").is_file()  # the file stays, the lock went with the process
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1}), "resume_from=latest"]) == 0


# -- resume compares the config with the checkpoint's -------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "grpo"
    assert main(["train", str(GRPO), *fast_overrides(run, **{"log.checkpoint_every": 1, "log.trackers": "[]"})]) == 0
    return run


@pytest.mark.slow
def test_resuming_under_another_objective_or_model_is_refused_naming_the_keys(saved_run, tmp_path, capsys):
    run = tmp_path / "copy"
    import shutil

    shutil.copytree(saved_run, run)
    before = (run / "metrics.jsonl").read_text()
    assert main(["train", str(DDPO), *fast_overrides(run, **{"train.iterations": 3}), "resume_from=latest"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after find_latest's notice of which checkpoint it read
    assert err.startswith("flowrl: error: resume_from=latest continues a run trained with objective.name='grpo', but this config has "
                          "objective.name='ddpo' (and ")  # fmt: skip
    assert "resume with the run's own config" in err and "resume_allow=[" in err
    listed = err.split("add resume_allow=[")[1].split("]")[0].split(",")  # every changed key, none left out
    more = int(err.split("(and ")[1].split(" more")[0])
    assert len(listed) == more + 1 and listed[0] == "objective.name"
    sections = sorted({k.split(".")[0] for k in listed})
    assert err.endswith(f" (or whole sections: resume_allow=[{','.join(sections)}]).")
    ddpm = ["pipeline.pretrained=digits_ddpm", "sampler={name: ddim}"]
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 3}), "resume_from=latest", *ddpm]) == 2
    err = capsys.readouterr().err
    assert "pipeline.pretrained='digits_flow', but this config has pipeline.pretrained='digits_ddpm'" in err, err
    assert (run / "metrics.jsonl").read_text() == before and not (run / "config_history").exists()  # nothing written


@pytest.mark.slow
def test_more_iterations_and_a_new_learning_rate_resume_and_the_config_history_is_kept(saved_run, tmp_path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(saved_run, run)
    original = (run / "config.yaml").read_text()
    extra = {"train.iterations": 3, "train.learning_rate": 1e-4, "log.trackers": "[]"}
    assert main(["train", str(GRPO), *fast_overrides(run, **extra), "resume_from=latest"]) == 0
    assert steps(run) == [0, 1, 2, 3]
    assert (run / "config_history" / "step_000002.yaml").read_text() == original  # the config in force up to step 2
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["learning_rate"] == 1e-4
    # a change that matters, allowed explicitly: the run continues as DDPO
    extra = {"train.iterations": 4, "log.trackers": "[]", "resume_allow": "[objective]"}
    assert main(["train", str(DDPO), *fast_overrides(run, **extra), "resume_from=latest"]) == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["objective"]["name"] == "ddpo" and steps(run) == [0, 1, 2, 3, 4]


# -- command-line mappings replace --------------------------------------------------------------------------------
def test_a_mapping_on_the_command_line_replaces_the_presets():
    config = load_config(GRPO, ["reward.components={remote: 1.0}", "reward.kwargs={remote: {url: 'http://127.0.0.1:9'}}"])
    assert config.reward.components == {"remote": 1.0} and config.reward.kwargs == {"remote": {"url": "http://127.0.0.1:9"}}
    assert load_config(GRPO, ["reward.components.clip_score=0.5"]).reward.components == {
        "ink": 1.0,
        "digit_classifier": 1.0,
        "clip_score": 0.5,
    }
    d3po = load_config(GRPO, ["objective={name: d3po}"]).objective
    assert d3po.model_dump() == {
        "name": "d3po",
        "beta": 0.1,
        "clip_range": 0.1,
        "preference": "reward",
        "timestep_fraction": 1.0,
        "timestep_order": "random",
    }  # d3po's own defaults, none of the preset's GRPO keys
    train = load_config(GRPO, ["train={iterations: 3}"]).train
    assert train.iterations == 3 and train.learning_rate == 1e-4 and train.batch_size == 16  # the whole section replaced
    with pytest.raises(FlowRLError, match=r"^config key 'reward.components' is invalid: at least one reward component is needed\.$"):
        load_config(GRPO, ["reward.components={}"])


# -- SIGTERM ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_saves_the_iteration_says_preempted_and_the_resume_is_exact(tmp_path):
    overrides = {"train.iterations": 4, "log.checkpoint_every": 0, "log.trackers": "[]"}
    whole = tmp_path / "whole"
    assert main(["train", str(GRPO), *fast_overrides(whole, **overrides)]) == 0
    run = tmp_path / "preempted"
    proc = flowrl_process("train", str(GRPO), *fast_overrides(run, **overrides), "--json")
    wait_for(lambda: (run / "metrics.jsonl").is_file() and len(steps(run)) >= 2)  # iteration 1 is done
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    done = summary["iterations_completed"]
    assert summary["status"] == "preempted" and 1 <= done < 4 and json.loads(out.strip().splitlines()[-1]) == summary
    assert summary["reason"] == f"stopped by SIGTERM (preemption) after iteration {done}; resume with resume_from=latest."
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{done:06d}"
    assert all(
        "eval/reward/mean" not in json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[1:]
    )  # no eval on the way out
    assert main(["train", str(GRPO), *fast_overrides(run, **overrides), "resume_from=latest"]) == 0
    from safetensors.torch import load_file

    a = load_file(whole / "checkpoints" / "step_000004" / "denoiser.safetensors")
    b = load_file(run / "checkpoints" / "step_000004" / "denoiser.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the preempted-and-resumed run is the uninterrupted one


# -- a run killed before its first checkpoint ---------------------------------------------------------------------
@pytest.mark.parametrize("extra", [[], ["resume_from=latest"]], ids=["restart", "resume"])
@pytest.mark.slow
def test_a_run_killed_while_writing_its_first_checkpoint_starts_again_without_overwrite(tmp_path, capsys, extra):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/reward/mean": 1.0}\n')
    (run / "checkpoints" / ".flowrl-tmp-step_000001-0badf00d").mkdir(parents=True)  # what a kill -9 during the write leaves
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1, "log.trackers": "[]"}), *extra]) == 0
    err = capsys.readouterr().err
    assert ("saved no checkpoint; it is replaced" in err) or ("holds no complete checkpoint, so the run starts afresh" in err)
    assert "removed 1 temporary file(s) left in" in err and "checkpoints/.flowrl-tmp-step_000001-0badf00d." in err
    assert steps(run) == [0, 1] and (run / "checkpoints" / "step_000001").is_dir()
    assert not [p for p in run.rglob("*") if p.name.startswith(".flowrl-tmp-")]


# -- a run killed while writing a later checkpoint -----------------------------------------------------------------
def leftovers(run: Path) -> list[str]:
    return sorted(p.relative_to(run).as_posix() for p in run.rglob(".flowrl-tmp-*"))


@pytest.mark.slow
def test_a_kill_9_during_a_checkpoint_write_leaves_nothing_after_the_resume_and_the_resume_is_exact(tmp_path, capsys):
    overrides = {"train.iterations": 2, "log.checkpoint_every": 1, "log.trackers": "[]"}
    run = tmp_path / "killed"
    proc = flowrl_process("train", str(GRPO), *fast_overrides(run, **overrides), env={"FLOWRL_TEST_KILL_AT": "checkpoint:config.yaml@2"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    half = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".flowrl-tmp-step_000002-")]
    assert len(half) == 1 and (half[0] / "denoiser.safetensors").is_file() and not (half[0] / "trainer_state.json").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000001"]
    # what other writes cut short leave (a sample, the summary), beside files that are not flowrl's to remove
    (run / "samples").mkdir(exist_ok=True)
    (run / "samples" / ".flowrl-tmp-step_000002.png-1a2b3c4d").write_bytes(b"half a png")
    (run / ".flowrl-tmp-summary.json-5e6f7a8b").write_text("{")
    kept = [run / ".notes", run / "checkpoints" / ".step_000002-mine", run / "samples" / "flowrl-tmp-visible.png"]
    for path in kept:
        path.write_text("the user's")
    assert main(["train", str(GRPO), *fast_overrides(run, **overrides), "resume_from=latest"]) == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "temporary file(s)" in line]
    assert notice == [
        f"flowrl: removed 3 temporary file(s) left in '{run}' by a write that a killed run did not finish: "
        f".flowrl-tmp-summary.json-5e6f7a8b, {half[0].relative_to(run).as_posix()}, samples/.flowrl-tmp-step_000002.png-1a2b3c4d."
    ]
    assert leftovers(run) == [] and all(path.read_text() == "the user's" for path in kept)
    assert json.loads((run / "summary.json").read_text())["status"] == "completed" and steps(run) == [0, 1, 2]
    whole = tmp_path / "whole"
    assert main(["train", str(GRPO), *fast_overrides(whole, **overrides)]) == 0
    from safetensors.torch import load_file

    a = load_file(whole / "checkpoints" / "step_000002" / "denoiser.safetensors")
    b = load_file(run / "checkpoints" / "step_000002" / "denoiser.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the killed-and-resumed run is the uninterrupted one


def test_leftover_temporaries_stay_while_another_process_holds_the_run_lock(tmp_path, capsys):
    from flowrl.training.run_lock import RunLock

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    writing = run / "checkpoints" / ".flowrl-tmp-step_000004-0a1b2c3d"  # a live run's checkpoint in progress
    writing.mkdir()
    holder = RunLock(run)
    holder.acquire()  # flock: a second open file description is refused even within this process
    try:
        assert main(["train", str(GRPO), *fast_overrides(run), "resume_from=latest"]) == 2
        assert " is in use by another flowrl run (pid " in capsys.readouterr().err
        assert writing.is_dir()
    finally:
        holder.release()


# -- the non-finite-reward window ----------------------------------------------------------------------------------
class NaNFromIteration:
    """The digits reward, with 6 of every 8 scores NaN from 0-based training iteration ``start`` on: not all (that stops
    at once), so only the window of train.nonfinite_window iterations stops the run."""

    name, differentiable = "nan_from_iteration", False

    def __init__(self, inner, start: int):
        self.inner, self.start, self.trainer = inner, start, None

    def __call__(self, samples, prompts, metadata):
        out = self.inner(samples, prompts, metadata)
        if self.trainer is not None and self.trainer.iteration >= self.start:  # during train_iteration(i), iteration == i
            out.scores[[i for i in range(len(out.scores)) if i % 4]] = float("nan")
        return out


def nan_trainer(run: Path, **extra: object) -> Trainer:
    from flowrl.reward_models.mix import build_reward_from_config

    overrides = {"train.iterations": 8, "train.nonfinite_window": 3, "train.max_nonfinite_fraction": 0.5, "log.checkpoint_every": 1}
    config = load_config(GRPO, fast_overrides(run, **{**overrides, "log.trackers": "[]", **extra}))
    reward = NaNFromIteration(build_reward_from_config(config.reward), start=2)
    reward.trainer = trainer = Trainer(config, reward=reward)
    return trainer


def stops(trainer: Trainer) -> str:
    with pytest.raises(FlowRLError) as info, pytest.warns(UserWarning, match="NaN or infinite"):
        trainer.fit()
    return str(info.value)


@pytest.mark.slow
def test_the_nonfinite_reward_window_is_resumed_so_the_run_stops_where_the_uninterrupted_one_does(tmp_path):
    # Uninterrupted: iterations 2, 3, 4 score 6 of 8 NaN; the window of 3 passes 6 of 24 and 12 of 24, stops at 18 of 24.
    whole = nan_trainer(tmp_path / "whole")
    message = stops(whole)
    assert message.startswith("18 of 24 rewards of the last 3 iterations were NaN or infinite") and whole.iteration == 4, message
    saved = tmp_path / "whole" / "checkpoints" / "step_000004" / "trainer_state.json"
    assert json.loads(saved.read_text())["nonfinite_window"] == [[1, 0, 8], [2, 6, 8], [3, 6, 8]]  # (iteration, NaN, all)
    assert list(whole.loop.nonfinite) == [(2, 6, 8), (3, 6, 8), (4, 6, 8)]
    whole.save()  # what _save_after_failure writes where no checkpoint of iteration 4 exists (log.checkpoint_every=0)
    assert json.loads(saved.read_text())["nonfinite_window"] == [[2, 6, 8], [3, 6, 8]]  # not iteration 4's: it failed
    # Stopped inside the streak (after iteration 2: one bad iteration in the window), then resumed. A window started
    # afresh would fill only at iteration 5 and stop the run one iteration later.
    run = tmp_path / "resumed"
    with pytest.warns(UserWarning, match="NaN or infinite"):
        assert nan_trainer(run, **{"train.stop_after": 3}).fit()["iterations_completed"] == 3
    resumed = nan_trainer(run, resume_from="latest")
    assert stops(resumed) == message.replace(str(tmp_path / "whole"), str(run)) and resumed.iteration == 4
    summaries = [json.loads((r / "summary.json").read_text()) for r in (tmp_path / "whole", run)]
    assert summaries[0]["iterations_completed"] == summaries[1]["iterations_completed"] == 4
    assert [json.loads(line)["reward/nonfinite_count"] for line in (run / "metrics.jsonl").read_text().splitlines()[1:]] == [0, 0, 6, 6]


# -- threads ------------------------------------------------------------------------------------------------------
def test_the_embedded_models_run_on_one_thread_unless_told(tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        Trainer(load_config(GRPO, fast_overrides(tmp_path / "a", **{"log.trackers": "[]"})))
        assert torch.get_num_threads() == 1
        Trainer(load_config(GRPO, fast_overrides(tmp_path / "b", **{"log.trackers": "[]", "train.num_threads": 2})))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# -- metadata needs against every data source ---------------------------------------------------------------------
def test_seppo_winners_without_the_metadata_the_reward_needs_are_refused_at_start(tmp_path):
    from PIL import Image

    winners = tmp_path / "winners"
    winners.mkdir()
    for i in range(2):
        Image.new("L", (8, 8), 40 * i).save(winners / f"w{i}.png")
        (winners / f"w{i}.txt").write_text("a handwritten seven")
    config = load_config(CONFIGS / "digits" / "seppo.yaml", fast_overrides(tmp_path / "run", **{"objective.winners": str(winners)}))
    with pytest.raises(FlowRLError) as e:
        Trainer(config)
    assert str(e.value).startswith(f"reward 'digit_classifier' needs 'digit' in every prompt's metadata, but winner 1 of '{winners}' ")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_starting_from_another_runs_checkpoint_says_so_and_reports_its_step(saved_run, tmp_path, capsys):
    """A new output_dir resumed from another run's checkpoint: the notice names it, and the 'before' reward is said
    to be that checkpoint's (its step), not the base model's."""
    checkpoint = saved_run / "checkpoints" / "step_000002"
    other = tmp_path / "other"
    overrides = [*fast_overrides(other, **{"train.iterations": 3, "log.trackers": "[]"}), f"resume_from={checkpoint}"]
    assert main(["train", str(GRPO), *overrides]) == 0
    out, err = capsys.readouterr()
    assert f"flowrl: starting from another run's checkpoint '{checkpoint}' (its iteration 2)" in err
    summary = json.loads((other / "summary.json").read_text())
    assert summary["eval_reward_initial_step"] == 2
    assert "(the checkpoint it started from, iteration 2) ->" in out
