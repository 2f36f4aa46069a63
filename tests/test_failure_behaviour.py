"""Nothing silently wrong (docs/failure_behaviour.md): a run that cannot learn stops, settings are honoured
or refused, corruption is caught and named, OS errors and bad arguments are one sentence, writes are
durable, and ``resume_from=latest`` takes the newest valid checkpoint.

Everything runs the real code paths on the embedded digits model at reduced size. The full-disk and
read-only cases mount real tiny tmpfs file systems in a user + mount namespace (``unshare``); they are
skipped where the kernel does not allow unprivileged namespaces. Permission denied is produced by
dropping the effective uid to ``nobody`` when the tests run as root (root ignores file modes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, REPO, fast_overrides, run_launch

from flowrl.atomic_files import atomic_path
from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import FlowRLError
from flowrl.preferences.pairs import build_pairs
from flowrl.reward_models import build_reward_from_config
from flowrl.trainer import Trainer
from flowrl.training.checkpoint import find_latest, save_checkpoint, verify_checkpoint
from flowrl.training.run_logger import json_line
from flowrl.types import RewardOutput

GRPO = CONFIGS / "digits" / "grpo.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity, which Python's json accepts but JSON does not."""

    def refuse(name):
        raise ValueError(f"bare {name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def one_line_error(err: str) -> str:
    # a library's own notice on stderr is not flowrl's (DeepSpeed, when installed, announces its accelerator at import)
    err = "".join(line for line in err.splitlines(keepends=True) if "[real_accelerator.py" not in line)
    assert err.startswith("flowrl: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def flip_tensor_bytes(file: Path, count: int = 400) -> None:
    """Overwrite ``count`` bytes in the middle of a safetensors file's tensor data with 0xFF (NaN floats);
    the header stays intact, so only a checksum can tell."""
    data = bytearray(file.read_bytes())
    start = 8 + struct.unpack("<Q", data[:8])[0]
    offset = start + (len(data) - start) // 2
    data[offset : offset + count] = b"\xff" * count
    file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-iteration run with a checkpoint after each iteration (shared; tests copy before they break it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", str(GRPO), *fast_overrides(run, **{"log.checkpoint_every": 1})]) == 0
    return run


def copy_run(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


# ------------------------------------------------------------------ 1. a run that cannot learn stops


class NaNFromCall:
    """The real reward, whose every score is NaN from the ``start``-th call on (call 1 is the evaluation
    before training, call k + 1 iteration k's rollouts)."""

    def __init__(self, inner, start: int, every: int = 1):
        self.inner, self.start, self.every, self.calls = inner, start, every, 0
        self.name, self.differentiable = "nan_from_call", False

    def __call__(self, samples, prompts, metadata):
        self.calls += 1
        out = self.inner(samples, prompts, metadata)
        scores = out.scores.clone()
        if self.calls >= self.start:
            scores[:: self.every] = float("nan")
        return RewardOutput(scores, out.extras)


@pytest.mark.slow
def test_an_iteration_whose_rewards_are_all_nan_stops_the_run_and_keeps_earlier_work(tmp_path):
    run = tmp_path / "run"
    config = load_config(GRPO, fast_overrides(run, **{"train.iterations": 4}))
    trainer = Trainer(config, reward=NaNFromCall(build_reward_from_config(config.reward), start=3))  # iteration 1 learns, 2 scores nothing
    with pytest.raises(FlowRLError) as info, pytest.warns(UserWarning, match="NaN or infinite"):
        trainer.fit()
    message = str(info.value)
    assert message == (
        f"all 8 rewards of iteration 2 were NaN or infinite (reward components: nan_from_call), so the run cannot "
        f"learn; the run stopped with iteration 1 saved in {run / 'checkpoints' / 'step_000001'} (resume with resume_from=latest)."
    )
    weights = verify_checkpoint(run / "checkpoints" / "step_000001")
    assert weights["iteration"] == 1
    summary = strict_json((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == message
    assert summary["iterations_completed"] == 1 and summary["stopped_early"] is True
    assert [strict_json(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


class FiveOfEightNaN(NaNFromCall):
    """From iteration 1 on, 5 of every 8 rewards non-finite (indices 0, 2, 4, 6 NaN and 7 inf)."""

    def __call__(self, samples, prompts, metadata):
        out = self.inner(samples, prompts, metadata)
        self.calls += 1
        scores = out.scores.clone()
        if self.calls >= self.start:
            scores[::2] = float("nan")
            scores[7::8] = float("inf")
        return RewardOutput(scores, out.extras)


@pytest.mark.slow
def test_too_many_nan_rewards_over_the_window_stop_the_run_before_the_update(tmp_path):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    overrides = fast_overrides(run, **{"train.iterations": 4, "train.nonfinite_window": 2, "train.max_nonfinite_fraction": 0.5})
    config = load_config(GRPO, overrides)
    trainer = Trainer(config, reward=FiveOfEightNaN(build_reward_from_config(config.reward), start=2))
    with pytest.raises(FlowRLError) as info, pytest.warns(UserWarning, match="NaN or infinite"):
        trainer.fit()
    # Iteration 1 alone (5 of 8) does not fill the window; iteration 2 makes it 10 of 16 > 0.5.
    assert str(info.value).startswith(
        "10 of 16 rewards of the last 2 iterations were NaN or infinite, more than "
        "train.max_nonfinite_fraction=0.5, so the run is not learning; the run stopped with iteration 1 saved"
    )
    # The update of iteration 2 never ran: the weights in memory are exactly those saved after iteration 1.
    on_disk = load_file(run / "checkpoints" / "step_000001" / "denoiser.safetensors")
    assert all(torch.equal(on_disk[k], v.detach().cpu()) for k, v in trainer.pipeline.denoiser.state_dict().items())
    assert strict_json((run / "summary.json").read_text())["status"] == "failed"


def test_flat_group_fraction_counts_groups_without_a_difference():
    from flowrl.training.loop import flat_group_fraction

    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, nan, 2.0, 3.0, 3.0])  # groups of 2: flat, varied, one finite, flat
    assert flat_group_fraction(rewards, 2) == 0.75
    assert flat_group_fraction(torch.zeros(8), 4) == 1.0 and flat_group_fraction(torch.arange(8.0), 4) == 0.0
    assert flat_group_fraction(torch.zeros(8), 1) == 0.0  # a group of one has no spread to speak of


@pytest.mark.slow
def test_a_reward_with_no_spread_in_any_group_warns_then_stops_the_run(tmp_path):
    """Equal rewards within every group: zero advantages. Warned after train.flat_reward_warn iterations in a row,
    stopped after train.flat_reward_stop, with the last completed iteration saved, as NaN rewards stop a run."""
    run = tmp_path / "run"
    overrides = fast_overrides(run, **{"train.iterations": 4, "train.flat_reward_warn": 1, "train.flat_reward_stop": 2})
    trainer = Trainer(load_config(GRPO, overrides), reward={"one_score": lambda samples, prompts, metadata: [0.5] * len(prompts)})
    with pytest.raises(FlowRLError) as info, pytest.warns(UserWarning, match="does the reward tell this model's samples apart"):
        trainer.fit()
    assert str(info.value).startswith(
        "every group's rewards were equal in the last 2 iterations (reward components: one_score), so the advantages "
        "are zero and the update learns nothing; the run cannot learn (train.flat_reward_stop=2); the run stopped with "
        "iteration 1 saved"
    )
    rows = [strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("reward/flat_group_fraction") for r in rows if "reward/mean" in r] == [1.0]


def test_a_reward_that_cannot_score_the_prompts_is_refused_before_anything_runs(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red bicycle\na bowl of fruit\n")
    run = tmp_path / "run"
    code = main(
        ["train", str(GRPO), *fast_overrides(run), "prompts.dataset=file", f"prompts.train_file={prompts}", f"prompts.eval_file={prompts}"]
    )
    assert code == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: reward 'digit_classifier' needs 'digit' in every prompt's metadata, but training prompt 1 of '{prompts}' "
        "('a red bicycle') has none, so it would score NaN and never train; give the prompts a 'digit' (a .jsonl prompt file) "
        "or choose another reward."
    )
    assert not run.exists()
    # Weighted 0 it is only watched, not trained on: allowed (ink alone can score any prompt).
    ok = load_config(
        GRPO,
        fast_overrides(
            run,
            **{
                "prompts.dataset": "file",
                "prompts.train_file": prompts,
                "prompts.eval_file": prompts,
                "reward.components": "{digit_classifier: 0.0, ink: 1.0}",
            },
        ),
    )
    Trainer(ok)
    assert not run.exists()


# ------------------------------------------------------------------ 2. pipeline.device


def test_a_device_this_machine_does_not_have_is_refused(tmp_path, capsys):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [f"cuda:{count}"] + ([] if count else ["cuda"])
    for device in missing:
        run = tmp_path / device.replace(":", "_")
        assert main(["train", str(GRPO), *fast_overrides(run), f"pipeline.device={device}"]) == 2
        err = one_line_error(capsys.readouterr().err)
        assert err.startswith(f"flowrl: error: pipeline.device is '{device}' but this machine has ")
        assert not run.exists()
        assert main(["eval", str(GRPO), f"pipeline.device={device}"]) == 2
        assert f"pipeline.device is '{device}'" in one_line_error(capsys.readouterr().err)
        with pytest.raises(FlowRLError, match=f"^pipeline.device is '{device}' but this machine has "):  # the pairs builder too
            build_pairs(load_config(CONFIGS / "digits" / "diffusion_dpo.yaml", [f"pipeline.device={device}"]), 2, torch.Generator())
    assert main(["train", str(GRPO), *fast_overrides(tmp_path / "x"), "pipeline.device=gpu"]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        "flowrl: error: config key 'pipeline.device' is invalid: must be auto, cpu, cuda, cuda:N or mps, got 'gpu'."
    )


def test_cpu_is_honoured(tmp_path):
    trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path, **{"pipeline.device": "cpu"})))
    assert trainer.accelerator.device == torch.device("cpu")
    assert {p.device for p in trainer.pipeline.denoiser.parameters()} == {torch.device("cpu")}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_named_gpu_is_honoured(tmp_path):
    last = torch.cuda.device_count() - 1
    trainer = Trainer(load_config(GRPO, fast_overrides(tmp_path, **{"pipeline.device": f"cuda:{last}"})))
    assert trainer.accelerator.device == torch.device("cuda", last)
    assert {p.device for p in trainer.pipeline.denoiser.parameters()} == {torch.device("cuda", last)}


# ------------------------------------------------------------------ 3. checksums, valid JSON


@pytest.mark.slow
def test_a_checkpoint_records_the_sha256_of_every_file(trained):
    ckpt = trained / "checkpoints" / "step_000002"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert set(state["files"]) == {"denoiser.safetensors", "optimizer.safetensors", "config.yaml"}
    for name, digest in state["files"].items():
        assert hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == digest
    assert verify_checkpoint(ckpt)["iteration"] == 2


@pytest.mark.slow
def test_corruption_is_named_by_eval_sample_export_and_resume(trained, tmp_path, capsys):
    good = trained / "checkpoints" / "step_000002"
    assert main(["eval", str(good)]) == 0
    assert "eval/reward/mean" in strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    bad = tmp_path / "step_000002"
    shutil.copytree(good, bad)
    flip_tensor_bytes(bad / "denoiser.safetensors")
    named = (
        f"flowrl: error: checkpoint file '{bad / 'denoiser.safetensors'}' is corrupt (its sha256 differs from the one recorded "
        "when it was written)."
    )
    out = tmp_path / "s.png"
    commands = {
        "eval": ["eval", str(bad)],
        "sample": ["sample", str(bad), "--prompt", "a handwritten seven", "-n", "2", "--out", str(out)],
        "export": ["export", str(bad), str(tmp_path / "exported")],
        "resume": ["train", str(GRPO), *fast_overrides(tmp_path / "resumed"), f"resume_from={bad}"],
    }
    for name, argv in commands.items():
        assert main(argv) == 2, name
        assert one_line_error(capsys.readouterr().err) == named, name
    assert not out.exists() and not (tmp_path / "exported").exists() and not (tmp_path / "resumed").exists()
    # The other files are checked the same way, the state file against its own checksum.
    for name, edit in (
        ("config.yaml", lambda t: t.replace("seed: 1234", "seed: 1235")),
        ("trainer_state.json", lambda t: t.replace('"iteration": 2', '"iteration": 3')),
    ):
        broken = tmp_path / f"broken_{name}"
        shutil.copytree(good, broken)
        text = (broken / name).read_text()
        assert edit(text) != text
        (broken / name).write_text(edit(text))
        assert main(["eval", str(broken)]) == 2
        assert f"checkpoint file '{broken / name}' is corrupt" in one_line_error(capsys.readouterr().err)
    assert main(["eval", str(trained)]) == 2  # a run directory is not a checkpoint: said so, not evaluated
    assert "is a run directory, not a checkpoint" in one_line_error(capsys.readouterr().err)
    # the run's latest pointer (a file) names its newest checkpoint, which flowrl eval and sample then read
    from flowrl.cli import _config_for_source

    config, checkpoint = _config_for_source(str(trained / "checkpoints" / "latest"), [])
    assert checkpoint == trained / "checkpoints" / "step_000002" and config.output_dir == str(trained)


@pytest.mark.slow
def test_printed_json_and_metric_lines_never_hold_a_bare_nan(trained, tmp_path, capsys):
    for line in (trained / "metrics.jsonl").read_text().splitlines():
        strict_json(line)
    strict_json((trained / "summary.json").read_text())
    # A checkpoint from before checksums existed, with NaN weights: it is evaluated (with a warning), and the
    # NaN reward is printed as null.
    legacy = tmp_path / "legacy"
    shutil.copytree(trained / "checkpoints" / "step_000002", legacy)
    flip_tensor_bytes(legacy / "denoiser.safetensors", count=4096)
    state = json.loads((legacy / "trainer_state.json").read_text())
    (legacy / "trainer_state.json").write_text(json.dumps({k: v for k, v in state.items() if k not in ("files", "state_sha256")}))
    with pytest.warns(UserWarning, match="carries no checksums"):
        assert main(["eval", str(legacy)]) == 0
    printed = strict_json(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["eval/reward/mean"] is None
    assert (
        json_line({"a": float("nan"), "b": [float("inf"), 1.5], "c": torch.tensor(float("-inf"))})
        == '{"a": null, "b": [null, 1.5], "c": null}'
    )


# ------------------------------------------------------------------ 4. OS errors and arguments


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sample", "digits_flow", "--prompt", "x", "-n", "0"], "-n/--num-samples must be at least 1, got 0."),
        (["sample", "digits_flow", "--prompt", "x", "--steps", "0"], "--steps must be at least 1, got 0."),
        (["sample", "digits_flow", "--prompt", "x", "--guidance-scale", "nan"], "--guidance-scale must be a finite number, got nan."),
        (["sample", "digits_flow", "--prompt", "x", "--seed", "-1"], "--seed must be non-negative, got -1."),
        (["eval", str(GRPO), "--best-of", "0"], "--best-of must be at least 1, got 0."),
        (["eval", str(GRPO), "--svdd", "-2"], "--svdd must be at least 1, got -2."),
        (["serve-reward", "x.yaml", "--port", "70000"], "--port must be in 0-65535, got 70000."),
    ],
)
def test_out_of_range_arguments_are_one_sentence(tmp_path, capsys, argv, message):
    out = ["--out", str(tmp_path / "o.png")] if argv[0] in ("sample", "eval") else []
    assert main(argv + out) == 2
    assert one_line_error(capsys.readouterr().err) == f"flowrl: error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_malformed_arguments_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["sample", "digits_flow", "-n", "three"])
    assert exited.value.code == 2
    assert one_line_error(capsys.readouterr().err) == (
        "flowrl: error: flowrl sample: argument -n/--num-samples: invalid int value: 'three' (see flowrl sample --help)."
    )


def test_an_output_path_under_a_file_is_one_sentence(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert main(["sample", "digits_flow", "--prompt", "x", "-n", "1", "--out", str(blocker / "s.png")]) == 2
    assert (
        one_line_error(capsys.readouterr().err)
        == f"flowrl: error: could not write '{blocker / 's.png'}': '{blocker}' is a file, not a directory."
    )
    assert main(["train", str(GRPO), *fast_overrides(blocker / "run")]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: could not create output_dir '{blocker / 'run'}': a part of the path is a file, not a directory."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_permission_denied_is_one_sentence_and_leaves_nothing(capsys):
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="flowrl-perm-"))
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir(mode=0o555)
        locked.chmod(0o555)
        codes = []
        as_root = os.geteuid() == 0
        if as_root:
            os.seteuid(65534)  # root ignores file modes: write as nobody (the real uid stays root to switch back)
        try:
            codes.append(main(["sample", "digits_flow", "--prompt", "x", "-n", "1", "--steps", "2", "--out", str(locked / "s.png")]))
            err_sample = capsys.readouterr().err
            codes.append(main(["train", str(GRPO), *fast_overrides(locked / "run")]))
            err_train = capsys.readouterr().err
        finally:
            if as_root:
                os.seteuid(0)
        assert codes == [2, 2]
        assert one_line_error(err_sample) == f"flowrl: error: could not write '{locked / 's.png'}': permission denied."
        assert one_line_error(err_train) == f"flowrl: error: could not create output_dir '{locked / 'run'}': permission denied."
        assert list(locked.iterdir()) == []
    finally:
        (base / "locked").chmod(0o755)
        shutil.rmtree(base)


DRIVER = textwrap.dedent('''
    """Runs inside a mount namespace: FULL is a full tmpfs, RO a read-only one, SMALL a 4 MiB one."""
    import contextlib, io, json, os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from conftest import fast_overrides
    from flowrl.cli import main

    full, ro, small, grpo = (Path(p) for p in sys.argv[3:7])
    fd = os.open(full / "filler", os.O_WRONLY | os.O_CREAT)  # take every free byte (unbuffered: nothing left to flush)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        os.close(fd)
    results = {}

    def run(name, argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        results[name] = {"code": code, "err": err.getvalue()}

    sample = ["sample", "digits_flow", "--prompt", "a handwritten seven", "-n", "2", "--steps", "2", "--out"]
    run("sample_full", sample + [str(full / "s.png")])
    run("sample_ro", sample + [str(ro / "s.png")])
    run("train_ro", ["train", str(grpo), *fast_overrides(ro / "run")])
    run("train_full", ["train", str(grpo), *fast_overrides(full / "run")])
    # Room for the run's small files but not for a checkpoint (~9.6 MB): the disk fills up mid-run.
    run("train_small", ["train", str(grpo), *fast_overrides(small / "run", **{"log.checkpoint_every": 1})])
    results["left"] = {str(d): sorted(str(p.relative_to(d)) for p in d.rglob("*")) for d in (full, ro, small)}
    results["summary"] = (small / "run" / "summary.json").read_text() if (small / "run" / "summary.json").exists() else None
    results["metrics"] = (small / "run" / "metrics.jsonl").read_text() if (small / "run" / "metrics.jsonl").exists() else None
    Path(sys.argv[1]).write_text(json.dumps(results))
''')


@pytest.mark.slow
def test_full_and_read_only_file_systems_are_one_sentence_and_leave_nothing_partial(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    full, ro, small = tmp_path / "full", tmp_path / "ro", tmp_path / "small"
    for d in (full, ro, small):
        d.mkdir()
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {full}"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here ({probe.stderr.strip()})")
    driver, report = tmp_path / "driver.py", tmp_path / "report.json"
    driver.write_text(DRIVER)
    script = (
        f"mount -t tmpfs -o size=256k tmpfs {full} && mount -t tmpfs -o ro,size=64k tmpfs {ro} && "
        f"mount -t tmpfs -o size=4m tmpfs {small} && "
        f"exec {sys.executable} {driver} {report} {REPO / 'tests'} {full} {ro} {small} {GRPO}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(report.read_text())
    expected = {
        "sample_full": f"could not write '{full / 's.png'}': no space left on device.",
        "sample_ro": f"could not write '{ro / 's.png'}': read-only file system.",
        "train_ro": f"could not create output_dir '{ro / 'run'}': read-only file system.",
        "train_full": f"could not write '{full / 'run' / 'config.yaml'}': no space left on device.",
    }
    for name, message in expected.items():
        assert r[name]["code"] == 2 and one_line_error(r[name]["err"]) == f"flowrl: error: {message}", (name, r[name])
    ckpt = small / "run" / "checkpoints" / "step_000001"
    assert r["train_small"]["code"] == 2
    err = one_line_error(r["train_small"]["err"])
    assert err == (
        f"flowrl: error: could not write '{ckpt}': no space left on device; iteration 1 could not be saved, so there is no "
        "checkpoint to resume from."
    )
    # Nothing partial: the full disk holds only the filler, the read-only one nothing, the small one no
    # temporary or half-written checkpoint, and every metric line is whole.
    assert r["left"][str(full)] == ["filler"] and r["left"][str(ro)] == []
    assert not [p for p in r["left"][str(small)] if "/." in "/" + p or p.startswith("run/checkpoints/step")], r["left"][str(small)]
    assert [strict_json(line)["step"] for line in r["metrics"].splitlines()] == [0, 1]
    assert strict_json(r["summary"])["status"] == "failed"


# ------------------------------------------------------------------ 5. durable writes, newest valid checkpoint


def test_files_and_directories_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", f"{src} -> {dst}"))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    target = tmp_path / "checkpoints" / "step_000001"
    save_checkpoint(target, model.state_dict(), optimizer, {"iteration": 1, "objective": [{}]}, "seed: 0\n")
    moved = next(i for i, (kind, what) in enumerate(events) if kind == "replace" and what.endswith(f"-> {target}"))
    tmp_dir = events[moved][1].split(" -> ")[0]
    synced_before = {what for kind, what in events[:moved] if kind == "fsync"}
    assert {f"{tmp_dir}/{name}" for name in ("denoiser.safetensors", "optimizer.safetensors", "config.yaml", "trainer_state.json")} | {
        tmp_dir
    } <= synced_before
    assert ("fsync", str(target.parent)) in events[moved + 1 :]
    # The pointer, through atomic_path: its file before its rename, the directory after.
    pointer = next(i for i, (kind, what) in enumerate(events) if kind == "replace" and what.endswith(f"-> {target.parent / 'latest'}"))
    assert events[pointer - 1][0] == "fsync" and events[pointer - 1][1] == events[pointer][1].split(" -> ")[0]
    assert events[pointer + 1] == ("fsync", str(target.parent))
    with atomic_path(tmp_path / "x.txt") as tmp:
        tmp.write_text("x")
    assert events[-3][0] == "fsync" and events[-2][1].endswith(f"-> {tmp_path / 'x.txt'}") and events[-1] == ("fsync", str(tmp_path))


@pytest.mark.slow
def test_resume_latest_takes_the_newest_valid_checkpoint_and_says_which(trained, tmp_path, capsys):
    run = copy_run(trained, tmp_path)
    ckpts = run / "checkpoints"
    flip_tensor_bytes(ckpts / "step_000002" / "denoiser.safetensors")
    assert main(["train", str(GRPO), *fast_overrides(run, **{"log.checkpoint_every": 1}), "resume_from=latest"]) == 0
    err = capsys.readouterr().err
    assert (
        f"flowrl: resuming from '{ckpts / 'step_000001'}', the newest valid checkpoint; skipped 1 newer one(s) that failed "
        f"verification (step_000002: checkpoint file '{ckpts / 'step_000002' / 'denoiser.safetensors'}' is corrupt"
    ) in err
    assert verify_checkpoint(ckpts / "step_000002")["iteration"] == 2  # iteration 2 was trained and written again
    assert [strict_json(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    # The pointer is only a hint: without it the newest valid checkpoint is found and named.
    (ckpts / "latest").unlink()
    assert find_latest(run) == (
        ckpts / "step_000002",
        f"resuming from '{ckpts / 'step_000002'}', the newest valid checkpoint (the 'latest' pointer is missing).",
    )
    for step in ("step_000001", "step_000002"):
        flip_tensor_bytes(ckpts / step / "optimizer.safetensors")
    with pytest.raises(FlowRLError, match=r"^resume_from=latest but none of the 2 checkpoint\(s\) in .* is valid \(newest: step_000002: "):
        find_latest(run)
    with pytest.raises(FlowRLError, match="has no checkpoint yet"):
        find_latest(tmp_path / "empty")


# ------------------------------------------------------------------ 7. the help's examples


def test_help_examples_name_checkpoints_the_preset_writes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    config = load_config(GRPO)
    written = {f"step_{i:06d}" for i in range(config.log.checkpoint_every, config.train.iterations + 1, config.log.checkpoint_every)}
    named = {word.split("/")[-1] for word in text.split() if "runs/digits_grpo/checkpoints/" in word}
    assert named and named <= written, (named, written)


# ------------------------------------------------------------------ 8. the last tracebacks (issue #31 item 6)

SEPPO = CONFIGS / "digits" / "seppo.yaml"


def png_claiming(path: Path, width: int, height: int) -> None:
    """A 60-byte PNG whose header claims ``width`` x ``height`` pixels: what a decompression bomb looks like to a
    reader that checks the size before decoding (PIL does, against twice ``Image.MAX_IMAGE_PIXELS``)."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def seppo_argv(winners: Path, run: Path) -> list[str]:
    return ["train", str(SEPPO), *fast_overrides(run), f"objective.winners={winners}"]


def test_a_decompression_bomb_among_the_winners_is_one_sentence(tmp_path, capsys):
    from PIL import Image

    folder, run = tmp_path / "winners", tmp_path / "run"
    folder.mkdir()
    png_claiming(folder / "bomb.png", 30_000, 30_000)  # 9e8 pixels > 2 * 89,478,485
    (folder / "bomb.txt").write_text("a handwritten seven")
    assert main(seppo_argv(folder, run)) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: image '{folder / 'bomb.png'}' (winners folder '{folder}') claims 900,000,000 pixels, more than twice "
        f"PIL's limit of {Image.MAX_IMAGE_PIXELS:,} (a decompression bomb, or an image far too large for a training example), "
        "so it was not decoded; remove it or resize it."
    )
    assert not run.exists()


def test_a_winners_text_file_that_is_not_utf8_is_one_sentence(tmp_path, capsys):
    from PIL import Image

    folder, run = tmp_path / "winners", tmp_path / "run"
    folder.mkdir()
    Image.new("L", (8, 8)).save(folder / "seven.png")
    (folder / "seven.txt").write_bytes("a handwritten seven\nin Latin-1: \xe9".encode("latin-1"))
    assert main(seppo_argv(folder, run)) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: prompt file '{folder / 'seven.txt'}' of winners folder '{folder}' is not UTF-8 text (byte 0xe9 on "
        "line 2 is not valid UTF-8); save it as UTF-8."
    )
    listing = tmp_path / "winners.jsonl"  # the .jsonl form of the winners, the same
    listing.write_bytes(b'{"prompt": "a handwritten seven", "image": "winners/seven.png"}\n{"prompt": "\xff"}\n')
    assert main(seppo_argv(listing, run)) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: winners file '{listing}' is not UTF-8 text (byte 0xff on line 2 is not valid UTF-8); save it as UTF-8."
    )
    assert not run.exists()


def test_eval_of_a_jsonl_file_with_a_garbage_line_names_the_file_and_line(tmp_path, capsys):
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text('{"llada_generation_256": "The answer is 18.", "ground_truth": 18}\n\n{"llada_generation_256": "19", tru\n')
    assert main(["eval", str(recorded)]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: line 3 of recorded generations file '{recorded}' is not valid JSON (Expecting property name enclosed in double quotes)."
    )
    recorded.write_text('{"llada_generation_256": "18", "ground_truth": 18}\n[1, 2]\n')
    assert main(["eval", str(recorded)]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: line 2 of recorded generations file '{recorded}' is not a JSON object."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recorded.jsonl"]


def test_eval_of_a_jsonl_file_with_nothing_to_grade_exits_2(tmp_path, capsys):
    """An empty file, or one whose rows carry no gold answer, has no accuracy: one sentence and exit 2, not NaN and 0."""
    recorded = tmp_path / "empty.jsonl"
    recorded.write_text("")
    assert main(["eval", str(recorded)]) == 2
    assert one_line_error(capsys.readouterr().err) == "flowrl: error: empty.jsonl has nothing to grade: it holds no rows."
    recorded.write_text('{"llada_generation_256": "18"}\n{"llada_generation_256": "19"}\n')
    assert main(["eval", str(recorded)]) == 2
    assert one_line_error(capsys.readouterr().err) == (
        "flowrl: error: empty.jsonl has nothing to grade: none of its 2 rows has a 'ground_truth' answer."
    )


@pytest.fixture
def unreachable_hub(tmp_path, monkeypatch):
    """huggingface_hub pointed at a local endpoint that accepts connections and never answers (a firewall that drops
    packets, a proxy that hangs), a 1 s HF_HUB_ETAG_TIMEOUT and an empty cache; returns the endpoint."""
    import socket

    from huggingface_hub import constants

    import flowrl.hub as hub

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name, value in {
        "ENDPOINT": endpoint,
        "HF_HUB_ETAG_TIMEOUT": 1,
        "HF_HUB_OFFLINE": False,
        "HF_HUB_CACHE": str(tmp_path / "hub"),
    }.items():
        monkeypatch.setattr(constants, name, value)
    monkeypatch.setattr(hub, "_HUB_PROBES", {})
    yield endpoint
    silent.close()


def test_an_unreachable_hub_is_said_after_a_bounded_wait(unreachable_hub, tmp_path, capsys):
    import time

    from flowrl.reward_models.clip_common import load_clip_model

    run = tmp_path / "run"
    started = time.monotonic()
    code = main(
        ["train", str(CONFIGS / "sd3" / "flow_grpo_pickscore.yaml"), "pipeline.pretrained=some-org/some-model", f"output_dir={run}"]
    )
    waited = time.monotonic() - started
    assert code == 2
    assert one_line_error(capsys.readouterr().err) == (
        f"flowrl: error: pipeline.pretrained 'some-org/some-model' is a hub id, but the Hugging Face Hub ({unreachable_hub}) "
        "could not be reached (no answer; flowrl waits at most 1 s, HF_HUB_ETAG_TIMEOUT) and the model is not in the local "
        "cache; download it where the hub can be reached (hf download some-org/some-model --local-dir DIR) and use "
        "pipeline.pretrained=LOCAL_DIR."
    )
    assert waited < 15, waited  # the probe's 1 s (+1 s for a hanging name lookup), not huggingface_hub's minutes of retries
    assert not run.exists()
    # A reward model from the hub: the same sentence (the probe's answer is kept for the process: no second wait).
    started = time.monotonic()
    with pytest.raises(FlowRLError) as info:
        load_clip_model("some-org/some-clip")
    assert time.monotonic() - started < 5
    assert str(info.value) == (
        f"CLIP model 'some-org/some-clip' is a hub id, but the Hugging Face Hub ({unreachable_hub}) could not be reached "
        "(no answer; flowrl waits at most 1 s, HF_HUB_ETAG_TIMEOUT) and the model is not in the local cache; download it "
        "where the hub can be reached (hf download some-org/some-clip --local-dir DIR) and pass that directory instead of "
        "the hub id."
    )


@pytest.mark.slow
def test_a_multi_process_launch_that_fails_at_start_says_the_sentence_once(tmp_path):
    """2 CPU processes under accelerate launch, into an output_dir that holds a run: rank 0 prints flowrl's sentence
    once (rank 1 would say it only if it were still alive 10 s later), and the launcher's failure report names it
    as the root cause instead of "To enable traceback see: ..."; the earlier run is untouched."""

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    launch = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "accelerate" / "ddp.yaml")]
    launch += ["--num_processes", "2", "--main_process_port", "0", "-m", "flowrl.cli"]  # the port: run_launch's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = run_launch(
        [sys.executable, *launch, "train", str(GRPO), *fast_overrides(run)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert proc.returncode != 0
    sentence = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("flowrl: error: ")]
    assert len(sentence) == 1, proc.stderr[-3000:]
    assert sentence[0].startswith(f"flowrl: error: output_dir '{run}' ") and "resume_from=latest" in sentence[0]
    assert f"traceback : {sentence[0]}" in proc.stderr  # the launcher's root cause
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.name != "flowrl.lock") == before
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'
