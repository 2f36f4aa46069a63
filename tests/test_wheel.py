"""flowrl as an installed package: the wheel carries the presets, the shipped weights and the bundled prompts, and
runs the README's commands from a directory that has nothing to do with the repository.

The wheel is built from a copy of the sources (the checkout gets no build/ or egg-info) and installed with pip into a
fresh virtual environment. That environment reaches flowrl's dependencies (torch, diffusers, ...) through a
``.pth`` line naming the test environment's site-packages, which Python adds to the path after the fresh one's own
and without running its ``.pth`` files, so the editable install of the checkout stays out of it: every ``flowrl``
import in the runs below is the wheel's (checked). Installing the dependencies themselves would download gigabytes
for nothing this test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO

FAST = [
    "train.iterations=2",
    "train.prompts_per_iteration=2",
    "train.num_generations=4",
    "train.batch_size=4",
    "rollout.num_inference_steps=4",
    "eval.every=0",
    "eval.samples_per_prompt=1",
    "log.checkpoint_every=0",
    "log.progress=false",
    "log.trackers=[]",
]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; returns its bin directory."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "flowrl", src / "flowrl", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist")],
        cwd=src,
        check=True,
        capture_output=True,
    )
    wheel = next((work / "dist").glob("flowrl-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True
    )
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def run(bin_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    proc = run(installed, tmp_path, "python", "-c", "import flowrl, flowrl.presets as p; print(flowrl.__file__); print(p.PRESET_DIR)")
    where, presets = proc.stdout.split()
    assert str(installed.parent) in where and str(REPO) not in where and str(installed.parent) in presets, proc.stdout


@pytest.mark.slow
def test_presets_are_listed_and_run_by_name_from_an_unrelated_directory(installed, tmp_path):
    listing = run(installed, tmp_path, "flowrl", "presets")
    assert listing.returncode == 0, listing.stderr
    names = [line.split()[0] for line in listing.stdout.splitlines()[1:]]
    assert {"digits/grpo", "dllm/diffu_grpo", "toy/adjoint_matching_linear", "flux/dance_grpo_hpsv2"} <= set(names)
    assert not any(n.startswith("accelerate/") for n in names)

    train = run(installed, tmp_path, "flowrl", "train", "digits/grpo", *FAST, "output_dir=by_name")
    assert train.returncode == 0, train.stderr[-2000:]
    summary = json.loads((tmp_path / "by_name" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations_completed"] == 2
    assert "flowrl: completed 2 of 2 iterations" in train.stdout  # the lines a person reads (--json: the summary)
    assert (tmp_path / "by_name" / "checkpoints" / "step_000002").is_dir()
    # the README's form of the same command, a checkout-relative path, finds the shipped file too
    readme_form = run(
        installed, tmp_path, "flowrl", "train", "configs/dllm/unigrpo.yaml", *FAST, "prompts.eval_size=8", "output_dir=readme_form"
    )
    assert readme_form.returncode == 0, readme_form.stderr[-2000:]
    # and the checkpoint is evaluated and sampled with the shipped model and classifier
    evaluated = run(installed, tmp_path, "flowrl", "eval", "by_name/checkpoints/step_000002")
    assert evaluated.returncode == 0 and "eval/reward/mean" in json.loads(evaluated.stdout.strip().splitlines()[-1]), evaluated.stderr
    sampled = run(
        installed,
        tmp_path,
        "flowrl",
        "sample",
        "by_name/checkpoints/step_000002",
        "--prompt",
        "a handwritten seven",
        "-n",
        "2",
        "--out",
        "seven.png",
    )
    assert sampled.returncode == 0 and (tmp_path / "seven.png").is_file(), sampled.stderr


@pytest.mark.slow
def test_a_name_that_is_no_preset_is_one_sentence(installed, tmp_path):
    proc = run(installed, tmp_path, "flowrl", "train", "digits/grpoo")
    assert proc.returncode == 2
    assert (
        proc.stderr == "flowrl: error: config file 'digits/grpoo' does not exist (and is no shipped preset; `flowrl presets` lists them).\n"
    )
