#!/usr/bin/env python
"""Fault sweep (issue #31 item 5): kill, starve and cut off a short run at every step of it, and check what it leaves.

Every case runs the same short GRPO run on the embedded digits model (configs/digits/grpo.yaml, tests/conftest.py's
``fast_overrides``: 4 iterations, a checkpoint after each, an evaluation before training and after iterations 2 and
4) as a real ``flowrl train`` process, breaks it, and then lets ``resume_from=latest`` finish it:

- **kill**: SIGKILL at each phase of an iteration and before each file of a checkpoint write
  (``FLOWRL_TEST_KILL_AT``, flowrl/training/fault_injection.py). The resumed run must end with the uninterrupted run's
  weights and optimizer state (sha256 of every checkpoint's ``denoiser.safetensors`` and ``optimizer.safetensors``),
  its ``metrics.jsonl`` (every number but the timings), its ``summary.json`` and its sample grids, bit for bit; a
  hidden temporary left by the kill must be removed (and named) by the resume.
- **ENOSPC / read-only**: every write of a run meets a full disk and a read-only directory, for real: the run is a
  child of this script inside ``unshare --user --map-root-user --mount``, its output directory is on a tmpfs of its
  own, and at the moment before the write (``FLOWRL_TEST_STOP_AT`` stops the process there) the script fills the
  tmpfs (leaving ``free_pages`` 4 KiB pages when the writes before the target must still fit) or bind-mounts the
  directory read-only, then lets the run go on. The run must exit 2 with one sentence naming the write, leave nothing
  partial (no temporary name, every checkpoint verifying, every metrics line and JSON file whole, every image
  readable), and, with the disk freed, ``resume_from=latest`` must end equal to the uninterrupted run.
- **reward server**: a real ``python -m flowrl.reward_server`` process scoring through the ``remote`` reward is
  killed, hung (SIGSTOP: the kernel accepts the connection, nothing answers) or restarted while the run waits for
  scores: back within ``retry_for`` the run goes on and ends equal to the uninterrupted run; gone for good it stops
  with one sentence and a checkpoint that resumes to that same end.

``python scripts/fault_sweep.py`` runs every case (about half an hour on one core) and prints the table;
``--markdown FILE`` also writes it as markdown, ``--only kill,disk,server`` picks groups, ``--keep DIR`` keeps the
runs. tests/test_fault_sweep.py runs a reduced set in CI with these same functions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "configs" / "digits" / "grpo.yaml"
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # this checkout's flowrl (its children get it as PYTHONPATH)
from conftest import fast_overrides  # noqa: E402  (the suite's fast settings: the sweep runs what the tests run)

sys.path.remove(str(REPO / "tests"))

KILL_ENV, STOP_ENV = "FLOWRL_TEST_KILL_AT", "FLOWRL_TEST_STOP_AT"  # flowrl/training/fault_injection.py
ITERATIONS = 4
TEMP_PREFIX = ".flowrl-tmp-"
PAGE = 4096
TOKEN = "fault-sweep-token"


def run_overrides(run: Path, **extra: object) -> list[str]:
    """The short run every case trains: 4 iterations, checkpoints after each, evaluations at 0, 2 and 4."""
    base = {"train.iterations": ITERATIONS, "log.checkpoint_every": 1, "eval.every": 2, "log.trackers": "[]"}
    return fast_overrides(run, **{**base, **extra})


# -- running flowrl ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Finished:
    code: int
    out: str
    err: str
    stopped: bool  # reached FLOWRL_TEST_STOP_AT (and was let go)
    seconds: float


def train(
    run: Path,
    *extra: str,
    overrides: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
    stop_at: str | None = None,
    on_stop: Callable[[], None] | None = None,
    timeout: float = 600,
) -> Finished:
    """``flowrl train`` the short run into ``run`` (``extra``: more overrides, e.g. resume_from=latest) as a child
    process. ``stop_at``: the child SIGSTOPs itself at that point; ``on_stop()`` then changes the world and the child
    goes on (SIGCONT)."""
    logs = Path(tempfile.mkdtemp(prefix="flowrl-sweep-log-"))
    child_env = {k: v for k, v in os.environ.items() if k not in (KILL_ENV, STOP_ENV)}
    child_env.update({k: v for k, v in (env or {}).items() if k != "PYTHONPATH"}, OMP_NUM_THREADS="1")
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), (env or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH")]))
    if stop_at:
        child_env[STOP_ENV] = stop_at
    argv = [sys.executable, "-m", "flowrl.cli", "train", str(GRPO), *run_overrides(run, **(overrides or {})), *extra]
    started, stopped = time.monotonic(), False
    with open(logs / "out", "w") as out, open(logs / "err", "w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=child_env, cwd=REPO)
        try:
            while True:
                pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
                if pid == 0:
                    if time.monotonic() - started > timeout:
                        raise TimeoutError(f"flowrl train did not end within {timeout:.0f} s")
                    time.sleep(0.05)
                    continue
                if os.WIFSTOPPED(status):
                    stopped = True
                    if on_stop is not None:
                        on_stop()
                    os.kill(proc.pid, signal.SIGCONT)
                    continue
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    result = Finished(proc.returncode, (logs / "out").read_text(), (logs / "err").read_text(), stopped, time.monotonic() - started)
    shutil.rmtree(logs, ignore_errors=True)
    return result


# -- what a run ends with ---------------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"bare {name}")

    return json.loads(text, parse_constant=refuse)


SUMMARY_KEYS = ("status", "reason", "iterations_completed", "iterations_planned", "eval_reward_initial", "eval_reward_final")


def outcome(run: Path) -> dict[str, Any]:
    """What must not depend on how the run got there: every checkpoint's weights and optimizer state, every metric
    but the timings, the summary, the sample grids."""
    ckpts = sorted(p for p in (run / "checkpoints").glob("step_*") if p.is_dir()) if (run / "checkpoints").is_dir() else []
    summary = strict_json((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    metrics = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    return {
        "checkpoints": {p.name: [sha256(p / "denoiser.safetensors"), sha256(p / "optimizer.safetensors")] for p in ckpts},
        "metrics": [{k: v for k, v in strict_json(line).items() if not k.startswith("perf/")} for line in metrics],
        "summary": {k: summary[k].replace(str(run), "<run>") if k == "reason" and summary.get(k) else summary.get(k) for k in SUMMARY_KEYS},
        "samples": {p.relative_to(run).as_posix(): sha256(p) for p in sorted([*run.glob("samples/*.png"), *run.glob("samples_*.png")])},
    }


def differences(got: dict[str, Any], want: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """What differs from the uninterrupted run, in words (empty: bit-for-bit equal); ``keys``: only these parts."""
    diffs = []
    for key in keys or tuple(want):
        if got.get(key) == want[key]:
            continue
        if key == "metrics" and len(got[key]) == len(want[key]):
            bad = [(w["step"], k) for g, w in zip(got[key], want[key]) for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k)]
            diffs.append(f"metrics differ at (step, key) {bad[:3]}")
        elif isinstance(want[key], dict):
            bad = sorted(k for k in set(got[key]) | set(want[key]) if got[key].get(k) != want[key].get(k))
            diffs.append(f"{key} differ: {', '.join(bad[:4])}")
        else:
            diffs.append(f"{key} differ ({len(got[key])} vs {len(want[key])} entries)")
    return diffs


def leftovers(run: Path) -> list[str]:
    """flowrl's temporary names under ``run`` (what a cut-short write leaves), relative to it."""
    if not run.is_dir():
        return []
    found = []
    for parent, dirs, files in os.walk(run):
        for name in [*dirs, *files]:
            if name.startswith(TEMP_PREFIX):
                found.append((Path(parent) / name).relative_to(run).as_posix())
        dirs[:] = [d for d in dirs if not d.startswith(TEMP_PREFIX)]
    return sorted(found)


def _bad_checkpoints(run: Path) -> list[str]:
    """Checkpoints that do not verify, and a ``latest`` pointer that names none."""
    from flowrl.errors import FlowRLError
    from flowrl.training.checkpoint import verify_checkpoint

    bad = []
    for ckpt in sorted((run / "checkpoints").glob("step_*")):
        try:
            verify_checkpoint(ckpt)
        except FlowRLError as e:
            bad.append(f"{ckpt.relative_to(run)} ({e})")
    pointer = run / "checkpoints" / "latest"
    if pointer.is_file() and not (run / "checkpoints" / pointer.read_text().strip()).is_dir():
        bad.append("checkpoints/latest names no checkpoint")
    return bad


def _bad_logs(run: Path) -> list[str]:
    """``metrics.jsonl`` (every line) and ``summary.json`` when they are there and not whole JSON."""
    bad = []
    for name in ("metrics.jsonl", "summary.json"):
        path = run / name
        try:
            if path.is_file():
                text = path.read_text()
                if name == "summary.json":
                    strict_json(text)
                else:
                    assert text.endswith("\n") or not text
                    [strict_json(line) for line in text.splitlines()]
        except (ValueError, AssertionError):
            bad.append(f"{name} is not whole")
    return bad


def _bad_images(run: Path) -> list[str]:
    """Visible images that do not decode."""
    from PIL import Image

    bad = []
    for image in sorted(p for p in run.rglob("*.png") if TEMP_PREFIX not in p.as_posix()):
        try:
            with Image.open(image) as im:
                im.load()
        except Exception as e:  # noqa: BLE001  (anything PIL says about it)
            bad.append(f"{image.relative_to(run)} ({type(e).__name__})")
    return bad


def _bad_configs(run: Path) -> list[str]:
    """The run's config and its history when they do not parse."""
    bad = []
    for config in [run / "config.yaml", *run.glob("config_history/*.yaml")]:
        if config.is_file():
            import yaml

            try:
                yaml.safe_load(config.read_text())
            except yaml.YAMLError:
                bad.append(f"{config.relative_to(run)} does not parse")
    return bad


def partial_files(run: Path) -> list[str]:
    """Visible files that are not whole: a checkpoint that does not verify, a metrics line or JSON file cut short,
    an image that does not decode, a config that does not parse."""
    if not run.is_dir():
        return []
    return _bad_checkpoints(run) + _bad_logs(run) + _bad_images(run) + _bad_configs(run)


def one_sentence(err: str) -> str | None:
    """The error sentence if stderr ends with exactly one ``flowrl: error: ...`` line and holds no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("flowrl: error: ")]
    if "Traceback" in err or len(errors) != 1 or lines[-1] != errors[0]:
        return None
    return errors[0][len("flowrl: error: ") :]


@dataclasses.dataclass
class Result:
    group: str
    case: str
    survived: bool
    detail: str
    seconds: float = 0.0


class _CaseFailed(Exception):
    """A case's check failed; the message is the table's detail."""


def _the_sentence(done: Finished) -> str:
    """The one sentence a run that stopped with exit 2 ended with (else the case failed)."""
    sentence = one_sentence(done.err)
    if done.code != 2 or sentence is None:
        raise _CaseFailed(f"exit {done.code}, not one sentence: {done.err.strip()[-600:]!r}")
    return sentence


def reference(work: Path, in_process: bool = False, **overrides: object) -> dict[str, Any]:
    """The uninterrupted run's outcome. ``in_process``: trained in this process (``flowrl.cli.main``, what a process
    that has flowrl imported already does in a few seconds: the test suite), not as a child."""
    run = work / "reference"
    shutil.rmtree(run, ignore_errors=True)
    if in_process:
        import io

        from flowrl.cli import main as flowrl_main

        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = flowrl_main(["train", str(GRPO), *run_overrides(run, **overrides)])
        done = Finished(code, "", err.getvalue(), False, 0.0)
    else:
        done = train(run, overrides=overrides)
    if done.code != 0:
        raise RuntimeError(f"the uninterrupted run failed: {done.err[-2000:]}")
    return outcome(run)


def _resume_and_compare(
    run: Path, ref: dict[str, Any], left: list[str], compare: tuple[str, ...] | None = None, overrides: dict[str, object] | None = None
) -> list[str]:
    """Resume ``run`` to its end; what went wrong, in words (empty: it ends equal to ``ref``, leaving nothing)."""
    resumed = train(run, "resume_from=latest", overrides=overrides)
    if resumed.code != 0:
        return [f"the resume failed ({resumed.code}): {resumed.err.strip().splitlines()[-1:]}"]
    problems = []
    if left:
        notice = [line for line in resumed.err.splitlines() if "temporary file(s) left in" in line]
        if not notice or not all(name in notice[0] for name in left):
            problems.append(f"the resume did not name the temporaries it removed ({left})")
    if leftovers(run):
        problems.append(f"temporaries left after the resume: {leftovers(run)}")
    return problems + differences(outcome(run), ref, compare)


# -- kills ----------------------------------------------------------------------------------------------------------
KILL_POINTS = [
    "evaluate@0",  # before the first iteration: nothing to resume, the run starts afresh
    "update@1",  # before the first checkpoint: the same
    "collect@2",
    "score@2",
    "advantages@2",
    "update@2",
    "evaluate@2",
    "log@2",
    "checkpoint@2",
    "checkpoint:denoiser.safetensors@2",
    "checkpoint:optimizer.safetensors@2",
    "checkpoint:config.yaml@2",
    "checkpoint:trainer_state.json@2",
    "checkpoint:rename@2",
    "checkpoint:latest@2",
    "plots@2",
    "plots:instruments.png@2",
    "evaluate@4",
    "checkpoint:latest@4",
    "finish@4",
    "finish:summary.json@4",
]


def kill_chain(points: list[str], work: Path, ref: dict[str, Any], name: str | None = None) -> Result:
    """SIGKILL the run at ``points[0]``, resume it and kill it at ``points[1]``, ..., then resume it to the end: it must
    end equal to the uninterrupted run, and every hidden temporary a kill left must be gone (and named) after the
    next start."""
    run = work / ("kill-" + re.sub(r"[^a-z0-9]+", "-", "-".join(points).lower()).strip("-"))
    shutil.rmtree(run, ignore_errors=True)
    label, started, left = name or f"SIGKILL at {', then '.join(points)}", time.monotonic(), []
    for i, point in enumerate(points):
        killed = train(run, *(["resume_from=latest"] if i else []), env={KILL_ENV: point})
        if killed.code != -signal.SIGKILL:
            return Result(
                "kill", label, False, f"not killed at {point} (exit {killed.code}): {killed.err[-500:]}", time.monotonic() - started
            )
        survived = [name for name in left if name in leftovers(run)]
        if survived:
            return Result("kill", label, False, f"temporaries {survived} survived the next start", time.monotonic() - started)
        left = leftovers(run)
    problems = _resume_and_compare(run, ref, left)
    detail = "; ".join(problems) or "resumed equal to the uninterrupted run" + (
        f" (the kill left {', '.join(left)}; the resume removed it)" if left else ""
    )
    return Result("kill", label, not problems, detail, time.monotonic() - started)


NAN_REWARD = '''"""The fault sweep's reward: the ink reward with 6 of every 8 scores NaN, so that only the window of
train.nonfinite_window iterations (not one all-NaN iteration) stops the run."""


def mostly_nan(samples, prompts, metadata):
    scores = samples.flatten(1).mean(1)
    scores[[i for i in range(len(scores)) if i % 4]] = float("nan")
    return scores
'''
NAN_OVERRIDES = {
    "reward.components": '{"fault_sweep_nan_reward:mostly_nan": 1.0}',
    "train.nonfinite_window": 3,
    "train.max_nonfinite_fraction": 0.5,
}


def nonfinite_window_case(work: Path, point: str = "collect@3") -> Result:
    """A run whose rewards are mostly NaN stops when the window of its last 3 iterations is over the allowed fraction
    (before iteration 3's update). Killed at ``point`` and resumed, it must stop at the same iteration with the same
    sentence, metrics and checkpoints: the window is restored from the checkpoint, not started afresh (which would
    let the resumed run train up to 3 iterations more)."""
    label, started = f"SIGKILL at {point} of a run that the non-finite-reward window stops", time.monotonic()
    work = work / "nonfinite"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "fault_sweep_nan_reward.py").write_text(NAN_REWARD)
    env = {"PYTHONPATH": str(work)}
    ends = []
    for run, kill in ((work / "uninterrupted", None), (work / "killed", point)):
        if kill:
            killed = train(run, overrides=NAN_OVERRIDES, env={**env, KILL_ENV: kill})
            if killed.code != -signal.SIGKILL:
                return Result("kill", label, False, f"not killed at {kill} (exit {killed.code}): {killed.err[-500:]}")
        done = train(run, *(["resume_from=latest"] if kill else []), overrides=NAN_OVERRIDES, env=env)
        sentence = one_sentence(done.err)
        if done.code != 2 or sentence is None:
            return Result("kill", label, False, f"exit {done.code}, not one sentence: {done.err.strip()[-600:]!r}")
        ends.append((sentence.replace(str(run), "<run>"), outcome(run)))
    (want, ref), (got, end) = ends
    problems = ([f"the resumed run said {got!r}, the uninterrupted one {want!r}"] if got != want else []) + differences(end, ref)
    detail = "; ".join(problems) or f"both stopped at the same iteration, equal: {want!r}"
    return Result("kill", label, not problems, detail, time.monotonic() - started)


# -- full disk and read-only directories (inside a user + mount namespace) -----------------------------------------
@dataclasses.dataclass(frozen=True)
class DiskCase:
    write: str  # the write that must fail, relative to the run directory
    point: str | None  # where the run is stopped for the fault; None: before it starts
    free_pages: int = 0  # ENOSPC: 4 KiB pages left free (the writes before the target still fit)
    ro: str | None = "."  # read-only: this directory (relative to the run directory; ".." the disk) is made read-only
    keep_rw: tuple[str, ...] = ()  # ... but these subdirectories of it stay writable
    named: str | None = None  # the path the sentence names, when not ``write`` (a checkpoint's files: its directory)
    enospc_named: str | None = None  # the same for a full disk, when it differs
    ro_sentence: str | None = None  # the read-only sentence, when not "could not write '<named>': ..."
    killed_at: str | None = None  # first kill the run there: the fault then meets the resume
    overrides: tuple[tuple[str, object], ...] = ()


CKPT = "checkpoints/step_000002"
DISK_CASES = [
    DiskCase("config.yaml", None, ro="..", ro_sentence="could not create output_dir '{run}': read-only file system."),
    DiskCase("samples/step_000000.png", "evaluate@0"),
    DiskCase("samples_before.png", "evaluate@0", free_pages=1, keep_rw=("samples",)),
    DiskCase("metrics.jsonl", "log@4"),  # its step-4 line crosses a 4 KiB page: a full disk cuts it short mid-line
    DiskCase("samples/step_000002.png", "evaluate@2", ro="samples"),
    DiskCase(f"{CKPT} (its temporary directory)", "checkpoint@2", ro="checkpoints", named=CKPT),
    DiskCase(f"{CKPT}/denoiser.safetensors", "checkpoint:denoiser.safetensors@2", ro="checkpoints", named=CKPT),
    DiskCase(f"{CKPT}/optimizer.safetensors", "checkpoint:optimizer.safetensors@2", ro="checkpoints", named=CKPT),
    DiskCase(f"{CKPT}/config.yaml", "checkpoint:config.yaml@2", ro="checkpoints", named=CKPT),
    DiskCase(f"{CKPT}/trainer_state.json", "checkpoint:trainer_state.json@2", ro="checkpoints", named=CKPT),
    # renaming needs no space: on a full disk the pointer after it is the write that fails
    DiskCase(f"{CKPT} (the rename into place)", "checkpoint:rename@2", ro="checkpoints", named=CKPT, enospc_named="checkpoints/latest"),
    DiskCase("checkpoints/latest", "checkpoint:latest@2", ro="checkpoints"),
    DiskCase("reward_curve.png", "plots@2"),
    DiskCase("instruments.png", "plots:instruments.png@2"),
    DiskCase("samples/step_000004.png", "evaluate@4", ro="samples"),
    DiskCase("samples_after.png", "evaluate@4", free_pages=1, keep_rw=("samples",)),
    DiskCase("reward_curve.png (redrawn at the end)", "finish@4", named="reward_curve.png"),
    DiskCase("summary.json", "finish:summary.json@4"),
    DiskCase(
        "metrics.jsonl (rewritten by a resume)",
        None,
        killed_at="update@2",
        named="metrics.jsonl",
        ro_sentence="could not create output_dir '{run}': read-only file system.",
    ),
    DiskCase("config.yaml (rewritten by a resume)", None, free_pages=1, ro=None, killed_at="update@2", named="config.yaml"),
    DiskCase("tensorboard/ (events file)", "log@1", ro="tensorboard", named="", overrides=(("log.trackers", "[tensorboard]"),)),
]
REASONS = {"ENOSPC": "no space left on device", "EROFS": "read-only file system"}


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def fill(disk: Path, free_pages: int) -> Path:
    """Take every free byte of the tmpfs ``disk`` but ``free_pages`` pages; returns the filler (delete it to free)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, PAGE):
            while True:
                try:
                    if os.write(fd, b"\0" * chunk) < chunk:
                        break
                except OSError:
                    break
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - free_pages * PAGE))
    finally:
        os.close(fd)
    return filler


def read_only(directory: Path, keep_rw: tuple[str, ...]) -> Callable[[], None]:
    """Bind-mount ``directory`` read-only over itself (writes already open go on; every new one is refused with
    EROFS, as on a file system remounted read-only); ``keep_rw`` subdirectories stay writable. Returns the undo."""
    kept = []
    for sub in keep_rw:
        (directory / sub).mkdir(parents=True, exist_ok=True)
        _sh("mount", "--bind", str(directory / sub), str(directory / sub))
        kept.append(directory / sub)
    directory.mkdir(parents=True, exist_ok=True)
    _sh("mount", "--rbind", str(directory), str(directory))
    _sh("mount", "-o", "remount,bind,ro", str(directory))

    def undo() -> None:
        _sh("umount", "-R", str(directory))
        for d in kept:
            _sh("umount", str(d))

    return undo


def _ro_target(case: DiskCase, run: Path, disk: Path) -> Path:
    """The directory the read-only fault bind-mounts (``..``: the whole disk)."""
    return (run / case.ro).resolve() if case.ro != ".." else disk


def _break_run(case: DiskCase, run: Path, overrides: dict[str, object], apply: Callable[[], None]) -> Finished:
    """Train the run into its fault (killed first at ``case.killed_at``, then resumed into it); ``apply`` sets the
    fault up before the start, or where the run stops at ``case.point``."""
    if case.killed_at:
        killed = train(run, env={KILL_ENV: case.killed_at}, overrides=overrides)
        if killed.code != -signal.SIGKILL:
            raise _CaseFailed(f"not killed at {case.killed_at} (exit {killed.code})")
    if case.point is None:
        apply()
    extra = ["resume_from=latest"] if case.killed_at else []
    broken = train(run, *extra, stop_at=case.point, on_stop=apply, overrides=overrides)
    if case.point is not None and not broken.stopped:
        raise _CaseFailed(f"the run never reached {case.point} (exit {broken.code})")
    return broken


def _expected_disk_sentence(case: DiskCase, fault: str, run: Path) -> str:
    """How the sentence of a run that met ``fault`` at ``case.write`` must start."""
    named = (case.enospc_named if fault == "ENOSPC" else None) or case.named
    named = case.write if named is None else named
    if fault == "EROFS" and case.ro_sentence:
        return case.ro_sentence.format(run=run)
    return f"could not write '{run / named if named else run}': {REASONS[fault]}"


def _left_whole(case: DiskCase, fault: str, run: Path, disk: Path) -> list[str]:
    """The temporaries the fault left, when they are only where the read-only directory kept them and nothing visible
    is partial."""
    left, partial = leftovers(run), partial_files(run)
    ro_dir = None if fault == "ENOSPC" or case.ro is None else _ro_target(case, run, disk)
    stuck = [p for p in left if ro_dir is None or not (run / p).resolve().is_relative_to(ro_dir)]
    if stuck or partial:
        raise _CaseFailed(f"left partial: {stuck + partial}")
    return left


def _meet_disk_fault(case: DiskCase, fault: str, disk: Path, ref: dict[str, Any], undo: list[Callable[[], None]]) -> str:
    """The run meets ``fault`` at ``case.write`` (``undo`` gathers what frees the disk) and must stop with the sentence
    naming that write, leaving nothing partial, then resume equal to ``ref``; the table's detail."""
    run, overrides = disk / "run", dict(case.overrides)

    def apply() -> None:
        if fault == "ENOSPC":
            filler = fill(disk, case.free_pages)
            undo.append(filler.unlink)
        else:
            undo.append(read_only(_ro_target(case, run, disk), case.keep_rw))

    broken = _break_run(case, run, overrides, apply)
    sentence = _the_sentence(broken)
    expected = _expected_disk_sentence(case, fault, run)
    if not sentence.startswith(expected.rstrip(".")):
        raise _CaseFailed(f"the sentence names another write: {sentence!r} (expected it to start {expected!r})")
    sentence = sentence.replace(str(run), "<run>")
    left = _left_whole(case, fault, run, disk)
    while undo:
        undo.pop()()
    problems = _resume_and_compare(run, ref, left, overrides=overrides)
    if problems:
        raise _CaseFailed(f"{sentence!r}, then: {'; '.join(problems)}")
    note = f"; the read-only disk kept {', '.join(left)}, the resume removed it" if left else ""
    return f"{sentence!r}{note}; resumed equal to the uninterrupted run"


def _release(undo: list[Callable[[], None]], disk: Path) -> None:
    """Undo every fault still in place (the latest first), then unmount the tmpfs ``disk``."""
    for step in reversed(undo):
        with contextlib.suppress(Exception):
            step()
    with contextlib.suppress(Exception):
        _sh("umount", "-R", str(disk))


def disk_case(case: DiskCase, fault: str, work: Path, ref: dict[str, Any]) -> Result:
    """One write meeting ENOSPC or EROFS; runs inside the mount namespace (``in_namespace``)."""
    label = f"{fault} at {case.write}"
    started = time.monotonic()
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    _sh("mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(disk))
    undo: list[Callable[[], None]] = []
    try:
        detail = _meet_disk_fault(case, fault, disk, ref, undo)
        return Result(fault, label, True, detail, time.monotonic() - started)
    except _CaseFailed as failed:
        return Result(fault, label, False, str(failed), time.monotonic() - started)
    finally:
        _release(undo, disk)


def namespace_available() -> str | None:
    """None if this machine lets an unprivileged user namespace mount a tmpfs; else why not."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a user namespace here ({probe.stderr.strip()})"


def flowrl(*args: str, timeout: float = 600) -> Finished:
    """``flowrl ARGS`` as a child process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flowrl.cli", *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    return Finished(done.returncode, done.stdout, done.stderr, False, time.monotonic() - started)


def export_case(fault: str, work: Path, checkpoint: Path) -> Result:
    """``flowrl export`` of the uninterrupted run's last checkpoint meeting a full disk at its last file, the model card
    (README.md: the tmpfs keeps exactly the pages of every other file of the export free), or a read-only one; then,
    with the disk freed, the export must come out equal to one that met no fault."""
    label = f"{fault} at flowrl export's " + ("model card (README.md, its last file)" if fault == "ENOSPC" else "directory")
    started = time.monotonic()
    whole = work / "export-reference"
    if not whole.is_dir():
        done = flowrl("export", str(checkpoint), str(whole))
        if done.code != 0:
            return Result(fault, label, False, f"the export without a fault failed: {done.err[-600:]}")
    files = {p.relative_to(whole).as_posix(): sha256(p) for p in sorted(whole.rglob("*")) if p.is_file() and p.name != "README.md"}
    pages = sum(-(-(whole / name).stat().st_size // PAGE) for name in files)
    disk = work / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    _sh("mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(disk))
    out, undo = disk / "export", []
    try:
        undo.append(fill(disk, pages).unlink if fault == "ENOSPC" else read_only(disk, ()))
        broken = flowrl("export", str(checkpoint), str(out))
        sentence = one_sentence(broken.err)
        if broken.code != 2 or sentence is None or not sentence.startswith(f"could not write '{out}': {REASONS[fault]}"):
            return Result(fault, label, False, f"exit {broken.code}: {broken.err.strip()[-600:]!r}", time.monotonic() - started)
        left = sorted(p.name for p in disk.iterdir() if p.name != "filler")
        if left:
            return Result(fault, label, False, f"left partial: {left}", time.monotonic() - started)
        undo.pop()()
        if fault == "ENOSPC":  # the control: with the model card's pages free too, the same export fits
            undo.append(fill(disk, pages + -(-(whole / "README.md").stat().st_size // PAGE)).unlink)
            control = flowrl("export", str(checkpoint), str(out))
            if control.code != 0:
                return Result(
                    fault, label, False, f"the export failed before its model card: {control.err[-300:]!r}", time.monotonic() - started
                )
            shutil.rmtree(out)
            undo.pop()()
        again = flowrl("export", str(checkpoint), str(out))
        got = {p.relative_to(out).as_posix(): sha256(p) for p in sorted(out.rglob("*")) if p.is_file() and p.name != "README.md"}
        if again.code != 0 or got != files or not (out / "README.md").is_file():
            return Result(fault, label, False, f"the export after the fault differs or failed ({again.code})", time.monotonic() - started)
        control = "; with one page more it fits" if fault == "ENOSPC" else ""
        detail = f"{sentence.replace(str(out), '<out>')!r}; nothing left{control}; with the disk freed the export is the faultless one"
        return Result(fault, label, True, detail, time.monotonic() - started)
    finally:
        _release(undo, disk)


def disk_cases(
    cases: list[tuple[DiskCase, str]], work: Path, ref: dict[str, Any], exports: tuple[str, ...] = (), checkpoint: Path | None = None
) -> list[Result]:
    """Run ``(case, "ENOSPC" | "EROFS")`` pairs, and ``flowrl export`` of ``checkpoint`` meeting each fault of
    ``exports``, in a user + mount namespace (this script, re-run by unshare)."""
    why = namespace_available()
    if why:
        return [Result(fault, f"{fault} at {c.write}", False, f"not run: {why}") for c, fault in cases]
    job = work / "disk-job.json"
    cases_json = [[dataclasses.asdict(c), f] for c, f in cases]
    job.write_text(
        json.dumps({"cases": cases_json, "work": str(work), "reference": ref, "exports": exports, "checkpoint": str(checkpoint)})
    )
    answer = work / "disk-results.json"
    proc = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            sys.executable,
            str(Path(__file__).resolve()),
            "--in-namespace",
            str(job),
            str(answer),
        ],
        timeout=3600,
    )  # its progress lines go to this process's stderr
    if proc.returncode != 0 or not answer.is_file():
        raise RuntimeError(f"the namespace driver failed (exit {proc.returncode})")
    return [Result(**r) for r in json.loads(answer.read_text())]


def in_namespace(job: Path, answer: Path) -> None:
    spec = json.loads(job.read_text())
    work, results = Path(spec["work"]), []
    for fields, fault in spec["cases"]:
        case = DiskCase(**{**fields, "keep_rw": tuple(fields["keep_rw"]), "overrides": tuple(map(tuple, fields["overrides"]))})
        try:
            result = disk_case(case, fault, work, spec["reference"])
        except Exception as e:  # noqa: BLE001  (a harness failure is a row of the table, not the end of the sweep)
            result = Result(fault, f"{fault} at {case.write}", False, f"harness error: {type(e).__name__}: {e}")
        print(f"{'survived' if result.survived else 'FAILED  '} {result.case}: {result.detail}", file=sys.stderr, flush=True)
        results.append(dataclasses.asdict(result))
    for fault in spec["exports"]:
        try:
            result = export_case(fault, work, Path(spec["checkpoint"]))
        except Exception as e:  # noqa: BLE001
            result = Result(fault, f"{fault} at flowrl export", False, f"harness error: {type(e).__name__}: {e}")
        print(f"{'survived' if result.survived else 'FAILED  '} {result.case}: {result.detail}", file=sys.stderr, flush=True)
        results.append(dataclasses.asdict(result))
    answer.write_text(json.dumps(results))


# -- the reward server ----------------------------------------------------------------------------------------------
SERVER_REMOTE = {"timeout": 5, "retry_for": 30, "backoff": 0.5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RewardServer:
    """``python -m flowrl.reward_server`` serving the digits run's two rewards on 127.0.0.1:``port``."""

    def __init__(self, work: Path, port: int) -> None:
        import yaml

        self.config = work / "server.yaml"
        self.config.write_text(
            yaml.safe_dump({"reward": {"components": {"ink": 1.0, "digit_classifier": 1.0}}, "port": port, "device": "cpu"})
        )
        self.log, self.port, self.proc = work / "server.log", port, None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> RewardServer:
        env = {**os.environ, "FLOWRL_REWARD_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flowrl.reward_server", str(self.config)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                cwd=REPO,
            )
        line = self.proc.stdout.readline()  # the first line says where it listens, once it does
        if not line.startswith("flowrl reward server listening on"):
            self.stop()
            raise RuntimeError(f"the reward server did not start: {line!r} {self.log.read_text()[-2000:]}")
        return self

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=60)
            self.proc.stdout.close()


def server_overrides(url: str) -> dict[str, object]:
    remote = {f"reward.kwargs.remote.{k}": v for k, v in SERVER_REMOTE.items()}
    return {"reward.components": "{remote: 1.0}", "reward.kwargs.remote.url": url, **remote}


@contextlib.contextmanager
def server_env() -> Iterator[None]:
    before = os.environ.get("FLOWRL_REWARD_TOKEN")
    os.environ["FLOWRL_REWARD_TOKEN"] = TOKEN
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FLOWRL_REWARD_TOKEN", None)
        else:
            os.environ["FLOWRL_REWARD_TOKEN"] = before


def server_reference(work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    server = RewardServer(work, free_port()).start()
    try:
        with server_env():
            return reference(work, **server_overrides(server.url))
    finally:
        server.stop()


SERVER_CASES = {
    "killed, back within retry_for": "restart",
    "hung (accepts, never answers), back within retry_for": "hang-recover",
    "killed for good": "kill",
    "hung for good": "hang",
}


RECOVERING = ("restart", "hang-recover")  # the server kinds that are back within retry_for


def _take_down(kind: str, server: RewardServer, events: list[str]) -> None:
    """Kill the server (``restart``, ``kill``) or hang it (SIGSTOP)."""
    if kind in ("restart", "kill"):
        server.signal(signal.SIGKILL)
        server.proc.wait(timeout=60)
        events.append("killed")
    else:
        server.signal(signal.SIGSTOP)
        events.append("stopped")


def _bring_back_later(kind: str, server: RewardServer, events: list[str]) -> None:
    """While the client retries: restart the server on its port (``restart``) or let it go (SIGCONT)."""
    time.sleep(2 if kind == "restart" else SERVER_REMOTE["timeout"] + 2)  # an attempt has failed (refused, or timed out)
    if kind == "restart":
        server.start()
        events.append("restarted")
    else:
        server.signal(signal.SIGCONT)
        events.append("let go")


def _train_through_outage(kind: str, server: RewardServer, run: Path, point: str, events: list[str]) -> Finished:
    """Train the run, taking the server down where the run stops at ``point`` (and bringing it back while the client
    retries, for the kinds that come back)."""
    helper = None

    def on_stop() -> None:
        nonlocal helper
        _take_down(kind, server, events)
        if kind in RECOVERING:
            helper = threading.Thread(target=_bring_back_later, args=(kind, server, events))
            helper.start()

    done = train(run, stop_at=point, on_stop=on_stop, overrides=server_overrides(server.url))
    if helper is not None:
        helper.join()
    return done


def _stopped_and_resumed(
    kind: str, done: Finished, server: RewardServer, run: Path, ref: dict[str, Any], compare: tuple[str, ...] | None
) -> tuple[str, list[str]]:
    """A server down for good: the run must have stopped with the sentence naming it and the iteration saved; with the
    server back, the resume. Returns the detail so far and what differs from ``ref``."""
    sentence = _the_sentence(done)
    if not (sentence.startswith(f"reward server {server.url} did not answer after ") and "iteration 1 saved" in sentence):
        raise _CaseFailed(f"unexpected sentence {sentence!r}")
    sentence = sentence.replace(server.url, "<url>").replace(str(run), "<run>")
    if kind == "hang":
        server.signal(signal.SIGCONT)
    else:
        server.start()
    problems = _resume_and_compare(run, ref, leftovers(run), compare, server_overrides(server.url))
    return f"{sentence!r}; with the server back, the resume", problems


def _server_outage(kind: str, server: RewardServer, run: Path, ref: dict[str, Any], point: str, compare: tuple[str, ...] | None) -> str:
    """The run meets the outage ``kind`` at ``point`` and must end equal to ``ref``; the table's detail."""
    events: list[str] = []
    done = _train_through_outage(kind, server, run, point, events)
    if not done.stopped:
        raise _CaseFailed(f"the run never reached {point}")
    if kind in RECOVERING:
        if done.code != 0:
            raise _CaseFailed(f"the run did not survive ({done.code}): {done.err.strip()[-600:]!r}")
        problems = differences(outcome(run), ref, compare)
        detail = f"server {' and '.join(events)} while the client retried; the run went on and"
    else:
        detail, problems = _stopped_and_resumed(kind, done, server, run, ref, compare)
    if problems:
        raise _CaseFailed(f"{detail}: {'; '.join(problems)}")
    return f"{detail} ended equal to the uninterrupted run"


def server_case(kind: str, work: Path, ref: dict[str, Any], point: str = "score@2", compare: tuple[str, ...] | None = None) -> Result:
    """The reward server dies or hangs while the run is about to score iteration 2 (``point``): ``restart`` /
    ``hang-recover``: it is back (restarted on its port, or let go) a few seconds later, within the client's
    retry_for, and the run must go on and end equal to the uninterrupted run; ``kill`` / ``hang``: it stays down for
    longer than retry_for, and the run must stop with one sentence and a checkpoint that resumes to that same end.
    ``compare``: the parts of ``outcome`` compared (default all; the remote reward names its metrics ``remote/...``, so
    against a run with the rewards in process only the checkpoints, samples and summary can be)."""
    label = next(name for name, k in SERVER_CASES.items() if k == kind)
    work = work / f"server-{kind}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    server = RewardServer(work, free_port()).start()
    try:
        with server_env():
            detail = _server_outage(kind, server, work / "run", ref, point, compare)
        return Result("reward server", label, True, detail, time.monotonic() - started)
    except _CaseFailed as failed:
        return Result("reward server", label, False, str(failed), time.monotonic() - started)
    finally:
        server.stop()


# -- the whole sweep ----------------------------------------------------------------------------------------------------
PLACEHOLDERS = {"<run>": "runs/x", "<url>": "http://127.0.0.1:PORT", "<out>": "exported", "|": "/"}  # markdown shows no <...>


def markdown(results: list[Result]) -> str:
    rows = ["| fault | case | result |", "|---|---|---|"]
    for r in results:
        detail = r.detail
        for placeholder, shown in PLACEHOLDERS.items():
            detail = detail.replace(placeholder, shown)
        rows.append(f"| {r.group} | {r.case} | {'survived' if r.survived else '**FAILED**'}: {detail} |")
    return "\n".join(rows) + "\n"


def _report(results: list[Result], new: list[Result]) -> None:
    """Print each new result's line as it comes, and keep it for the table."""
    for r in new:
        print(f"{'survived' if r.survived else 'FAILED  '} [{r.group}] {r.case} ({r.seconds:.0f} s): {r.detail}", flush=True)
    results.extend(new)


def _sweep(groups: set[str], work: Path, results: list[Result]) -> None:
    """Run the cases of ``groups`` in ``work``, in the table's order: kill, disk, server."""
    ref = reference(work / "default") if groups & {"kill", "disk"} else None
    if "kill" in groups:
        for point in KILL_POINTS:
            _report(results, [kill_chain([point], work, ref)])
        _report(results, [nonfinite_window_case(work)])
    if "disk" in groups:
        cases = [(c, f) for c in DISK_CASES for f in ("ENOSPC", "EROFS") if f == "ENOSPC" or c.ro is not None]
        last = work / "default" / "reference" / "checkpoints" / f"step_{ITERATIONS:06d}"
        _report(results, disk_cases(cases, work, ref, exports=("ENOSPC", "EROFS"), checkpoint=last))
    if "server" in groups:
        server_ref = server_reference(work / "server-reference")
        for kind in SERVER_CASES.values():
            _report(results, [server_case(kind, work, server_ref)])


def _table(results: list[Result], began: float, markdown_path: Path | None) -> int:
    """Print the count and the table (and write it to ``markdown_path``); the exit status: 0 when every case survived."""
    survived = sum(r.survived for r in results)
    print(f"\n{survived} of {len(results)} cases survived in {time.monotonic() - began:.0f} s\n")
    table = markdown(results)
    print(table)
    if markdown_path:
        markdown_path.write_text(table)
    return 0 if survived == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="kill,disk,server", help="comma-separated groups: kill, disk, server")
    p.add_argument("--markdown", type=Path, help="also write the table here")
    p.add_argument("--keep", type=Path, help="run in this directory and keep it (default: a temporary one, removed)")
    p.add_argument("--in-namespace", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.in_namespace:
        in_namespace(*args.in_namespace)
        return 0
    groups = set(args.only.split(","))
    work = args.keep or Path(tempfile.mkdtemp(prefix="flowrl-fault-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    began = time.monotonic()
    try:
        _sweep(groups, work, results)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return _table(results, began, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
