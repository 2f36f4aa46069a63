"""One measurement as a JSON record under bench/results/: the numbers with the date, the machine, the command and
the commit they came from. docs/results.md is generated from these records (bench/results_page.py), so a number on
that page is never typed by hand."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it (``platform.processor()`` is empty on most Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where a number was measured: CPU, cores, the load beside it (a shared machine's timings depend on it), torch."""
    import torch

    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def commit() -> str | None:
    """The checkout's commit, with ``+dirty`` when files differ from it (the numbers came from uncommitted code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def stamp(command: str) -> dict[str, Any]:
    """The provenance every record carries."""
    return {
        "date": datetime.date.today().isoformat(),
        "command": command,
        "commit": commit(),
        "machine": machine(),
    }


def this_command() -> str:
    """The command line that is running, as a person would retype it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def write(name: str, record: dict[str, Any]) -> Path:
    """bench/results/NAME.json, written whole (a temporary file renamed over the old one)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def read(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None
