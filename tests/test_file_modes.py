"""One file mode for everything a run writes: files written atomically (config, pictures, checkpoints, the
``latest`` pointer, the summary) get the mode an ordinary ``open(path, "w")`` gives metrics.jsonl, and the
checkpoint directories the mode ``mkdir`` gives the run directory: 0o666 / 0o777 less the umask."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from conftest import CONFIGS, fast_overrides
from safetensors.torch import save_file

from flowrl.atomic_files import atomic_directory, atomic_path
from flowrl.config import load_config
from flowrl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def umask(request):
    """Set the process umask for one test and restore it afterwards."""
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def modes(root) -> tuple[dict[str, int], dict[str, int]]:
    """{relative path: permission bits} of every file and of every directory under ``root`` (root included)."""
    files, dirs = {}, {"": stat.S_IMODE(os.stat(root).st_mode)}
    for parent, subdirs, names in os.walk(root):
        for name in subdirs:
            dirs[os.path.relpath(os.path.join(parent, name), root)] = stat.S_IMODE(os.stat(os.path.join(parent, name)).st_mode)
        for name in names:
            files[os.path.relpath(os.path.join(parent, name), root)] = stat.S_IMODE(os.stat(os.path.join(parent, name)).st_mode)
    return files, dirs


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o027, 0o640, 0o750)], indirect=["umask"], ids=["umask027"])
@pytest.mark.slow
def test_every_file_and_directory_of_a_run_has_one_mode(tmp_path, umask, file_mode, dir_mode):
    run = tmp_path / "run"
    overrides = fast_overrides(run, **{"log.checkpoint_every": 1, "eval.every": 1})
    Trainer(load_config(CONFIGS / "digits" / "grpo.yaml", overrides)).fit()
    files, dirs = modes(run)
    # what the run wrote: atomically (config, pictures, checkpoints, pointer, summary) and by plain open (metrics)
    expected = {
        "metrics.jsonl",
        "config.yaml",
        "summary.json",
        "checkpoints/latest",
        "checkpoints/step_000002/denoiser.safetensors",
        "checkpoints/step_000002/optimizer.safetensors",
        "checkpoints/step_000002/trainer_state.json",
    }
    assert expected <= set(files), sorted(files)
    assert any(name.endswith(".png") for name in files), sorted(files)
    # no temporary left behind (the run's lock file, if the run keeps one, is no temporary)
    assert not [name for name in files | dirs if os.path.basename(name).startswith(".") and name != ".flowrl.lock"]
    assert {name: mode for name, mode in files.items() if mode != file_mode} == {}
    assert {name: mode for name, mode in dirs.items() if mode != dir_mode} == {}
    assert {"checkpoints", "checkpoints/step_000001", "checkpoints/step_000002"} <= set(dirs)


@pytest.mark.parametrize(
    "umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)], indirect=["umask"], ids=["umask022", "umask077"]
)
def test_atomic_writes_follow_the_umask_and_shipped_assets_are_world_readable(tmp_path, umask, file_mode, dir_mode):
    with open(tmp_path / "plain.txt", "w") as f:
        f.write("x")
    os.mkdir(tmp_path / "plain_dir")
    with atomic_path(tmp_path / "atomic.txt") as tmp:
        tmp.write_text("x")
    with atomic_path(tmp_path / "weights.safetensors") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp))  # safetensors replaces the file with a 0o600 one of its own
    with atomic_directory(tmp_path / "private", world_readable=False) as tmp:
        (tmp / "file.txt").write_text("x")
        save_file({"w": torch.zeros(2)}, str(tmp / "weights.safetensors"))
        (tmp / "sub").mkdir()
        (tmp / "sub" / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "sub" / "run.sh").chmod(0o700)  # an executable keeps its execute bits, as far as the umask allows
    with atomic_directory(tmp_path / "asset") as tmp:  # world_readable (the default): shipped assets
        (tmp / "file.txt").write_text("x")
        (tmp / "sub").mkdir()
    files, dirs = modes(tmp_path)
    assert files == {
        "plain.txt": file_mode,
        "atomic.txt": file_mode,
        "weights.safetensors": file_mode,
        "private/file.txt": file_mode,
        "private/weights.safetensors": file_mode,
        "private/sub/run.sh": dir_mode,
        "asset/file.txt": 0o644,
    }
    assert {name: mode for name, mode in dirs.items() if name} == {
        "plain_dir": dir_mode,
        "private": dir_mode,
        "private/sub": dir_mode,
        "asset": 0o755,
        "asset/sub": 0o755,
    }
