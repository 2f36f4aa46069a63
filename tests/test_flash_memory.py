"""bench/flash_memory.py --quick runs: both methods (full-trajectory GRPO and Flash-GRPO) ran on digits_video, each in
its own process, and the JSON record has its fields. No timing or memory assertions (shared machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_flash_memory_quick(tmp_path):
    out = tmp_path / "flash_memory.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "flash_memory.py"), "--quick", "--output", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    for key in ("date", "machine", "torch", "command", "memory_method", "rows", "ratios"):
        assert key in record, key
    assert record["command"].startswith("python bench/flash_memory.py --quick")
    rows = record["rows"]
    assert [(r["size"], r["method"]) for r in rows] == [("digits_video", "grpo_full"), ("digits_video", "flash_grpo")]
    assert {r["objective"] for r in rows} == {"grpo", "flash_grpo"}
    for r in rows:
        assert r["iterations"] == 1 and r["samples_per_iteration"] == rows[0]["samples_per_iteration"]
        for key in (
            "s_per_iteration",
            "peak_rss_delta_gib",
            "peak_rss_during_iterations_gib",
            "peak_whole_process_gib",
            "denoiser_rows_per_iteration",
        ):
            assert isinstance(r[key], (int, float)), key
    assert "digits_video" in record["ratios"]
    assert "GRPO / Flash-GRPO" in done.stdout
