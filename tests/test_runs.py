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


def flowrl_process(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
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
def test_two_runs_started_together_into_one_directory_one_is_refused(tmp_path):
    run = tmp_path / "twin"
    procs = [flowrl_process("train", str(GRPO), *fast_overrides(run, **{"train.iterations": 3, "seed": s})) for s in (0, 1)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [err[-500:] for _, _, err in results]
    refused = next(err for code, _, err in results if code == 2)
    assert refused.count("\n") == 1 and (" is in use by another flowrl run (pid " in refused or "already holds a run" in refused), refused
    assert steps(run) == [0, 1, 2, 3]  # every step once, from the one run that trained
    winner = next(out for code, out, _ in results if code == 0)
    summary = json.loads(winner.strip().splitlines()[-1])
    assert summary == json.loads((run / "summary.json").read_text())  # the summary printed is the run's own


def test_a_running_run_refuses_a_second_run_and_a_resume_naming_its_pid(tmp_path):
    run = tmp_path / "run"
    first = flowrl_process("train", str(GRPO), *fast_overrides(run, **{"train.iterations": 5000, "log.checkpoint_every": 1}))
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").is_file())
        holder = f"pid {first.pid} on "
        for extra in ([], ["resume_from=latest"], ["overwrite=true"]):
            second = flowrl_process("train", str(GRPO), *fast_overrides(run), *extra)
            code, (_, err) = second.wait(timeout=300), second.communicate()
            assert code == 2 and err.startswith(f"flowrl: error: output_dir '{run}' is in use by another flowrl run ({holder}"), err
            assert err.rstrip().endswith("); wait for it to end, or choose another output_dir.") and err.count("\n") == 1
        assert first.poll() is None  # the running run went on
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=300)
    assert first.returncode == 143


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
    ddpm = ["pipeline.pretrained=digits_ddpm", "sampler={name: ddim}"]
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 3}), "resume_from=latest", *ddpm]) == 2
    err = capsys.readouterr().err
    assert "pipeline.pretrained='digits_flow', but this config has pipeline.pretrained='digits_ddpm'" in err, err
    assert (run / "metrics.jsonl").read_text() == before and not (run / "config_history").exists()  # nothing written


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
def test_sigterm_saves_the_iteration_says_preempted_and_the_resume_is_exact(tmp_path):
    overrides = {"train.iterations": 4, "log.checkpoint_every": 0, "log.trackers": "[]"}
    whole = tmp_path / "whole"
    assert main(["train", str(GRPO), *fast_overrides(whole, **overrides)]) == 0
    run = tmp_path / "preempted"
    proc = flowrl_process("train", str(GRPO), *fast_overrides(run, **overrides))
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
def test_a_run_killed_while_writing_its_first_checkpoint_starts_again_without_overwrite(tmp_path, capsys, extra):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/reward/mean": 1.0}\n')
    (run / "checkpoints" / ".step_000001-k1ll3d").mkdir(parents=True)  # what a kill -9 during the write leaves
    assert main(["train", str(GRPO), *fast_overrides(run, **{"train.iterations": 1, "log.trackers": "[]"}), *extra]) == 0
    err = capsys.readouterr().err
    assert ("saved no checkpoint; it is replaced" in err) or ("holds no complete checkpoint, so the run starts afresh" in err)
    assert steps(run) == [0, 1] and (run / "checkpoints" / "step_000001").is_dir()


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
