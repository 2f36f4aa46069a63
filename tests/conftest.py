"""Shared fixtures: fast settings for running the real trainer on the embedded models."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# Two threads at most, shared among pytest-xdist workers (`make test` runs two): more threads than cores only add contention.
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


def fast_overrides(output_dir: Path, **extra: object) -> list[str]:
    """Overrides that make a digits run take seconds: 2 groups of 4, 4 steps, tiny eval."""
    base = {
        "output_dir": str(output_dir),
        "train.iterations": 2,
        "train.prompts_per_iteration": 2,
        "train.num_generations": 4,
        "train.batch_size": 4,
        "rollout.num_inference_steps": 4,
        "eval.every": 0,
        "eval.samples_per_prompt": 1,
        "log.checkpoint_every": 0,
        "log.progress": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: more intra-op threads only add overhead (and slow badly when other jobs share the CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_launch(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run an ``accelerate launch`` of several CPU processes, one launch at a time across the pytest-xdist workers (a
    file lock): two at once would oversubscribe the 2 cores and race for the rendezvous port, which is chosen here,
    inside the lock, and put after ``--main_process_port``."""
    from filelock import FileLock

    with FileLock(Path(tempfile.gettempdir()) / "flowrl-tests-launch.lock"):
        if "--main_process_port" in cmd:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                cmd = [*cmd]
                cmd[cmd.index("--main_process_port") + 1] = str(s.getsockname()[1])
        return subprocess.run(cmd, **kwargs)


def launch_report(proc: subprocess.CompletedProcess, chars: int = 2500) -> str:
    """What a failed launch's workers printed, for an assertion message: the launcher's own traceback and its
    ChildFailedError summary (the last ``Traceback`` of stderr) say only which rank died and by which signal, so
    the workers' last lines before it come first, then the summary's root-cause lines."""
    err = proc.stderr or ""
    cut = err.rfind("Traceback (most recent call last):")
    workers, launcher = (err[:cut], err[cut:]) if "ChildFailedError" in err[cut:] else (err, "")
    root = launcher[launcher.find("Root Cause") :] if "Root Cause" in launcher else launcher[-600:]
    return f"workers' output (last {chars} chars):\n{workers[-chars:]}\nlauncher: {root[:600]}"


def skip_without_sudoku_file(what: str) -> None:
    """Skip the calling test when d1's Sudoku test file (FLOWRL_DATA_DIR, ../shared/data) is absent: ``what`` reads it."""
    import pytest

    from flowrl.data.text_tasks import SUDOKU_FILE, default_data_dir

    if not (default_data_dir() / SUDOKU_FILE).is_file():
        pytest.skip(f"{what} read the shared test file (FLOWRL_DATA_DIR), absent here")
