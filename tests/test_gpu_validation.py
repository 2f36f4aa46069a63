"""The GPU validation (bench/gpu_validation.py, bench/gpu_validation.sh) runs its whole path on the CPU with --dry-run:
every step's process, its record and its table; the list of CUDA-only tests it runs is every test the suite skips
without CUDA; the shell scripts parse."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from gpu_validation import CUDA_TESTS  # noqa: E402


@pytest.mark.slow
def test_the_dry_run_goes_through_every_step(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "gpu_validation.py"), "--dry-run", "--out", str(tmp_path), "--families", "sd3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_validation.json").read_text())
    assert record["dry_run"] and record["machine"]["status"] == "ok"
    assert record["machine"]["result"]["cuda"] == torch.cuda.is_available()
    sd3 = record["real_size"]["sd3"]
    assert sd3["status"] == "ok" and sd3["loss_finite"] and sd3["iteration_s"] >= 0 and sd3["lora_params"] > 0
    det = record["deterministic"]
    assert det["device"] == "cpu" and det["bit_identical"] and len(set(det["weights_sha256"])) == 1
    tests = record["cuda_tests"]
    assert tests["status"] == "ok" and tests["tests"] == list(CUDA_TESTS)
    assert ("skipped" in tests["pytest"][0]) != torch.cuda.is_available()  # said, not silently passed
    table = (tmp_path / "gpu_validation.md").read_text()
    assert "dry run" in table and "| sd3 | ok |" in table and "bit-identical: True" in table


def _skips_without_cuda(decorator: ast.expr) -> bool:
    text = ast.unparse(decorator)
    return "skipif" in text and "cuda.is_available()" in text


def test_it_runs_every_test_the_suite_skips_without_cuda():
    found = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(_skips_without_cuda(d) for d in node.decorator_list):
                found.append(f"tests/{path.name}::{node.name}")
    assert found == list(CUDA_TESTS)


@pytest.mark.parametrize("script", ["gpu_validation.sh", "gpu_wheels.sh"])
def test_the_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(REPO / "bench" / script)], capture_output=True).returncode == 0
