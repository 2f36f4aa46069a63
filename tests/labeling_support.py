"""Shared by the labelling tests: a real pairs directory from the embedded digits model, the real
`flowrl label` process, and plain HTTP calls to it."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from conftest import CONFIGS, fast_overrides

REPO = Path(__file__).resolve().parents[1]
D3PO = CONFIGS / "digits" / "d3po.yaml"
DPO = CONFIGS / "digits" / "diffusion_dpo.yaml"
OPEN = re.compile(r"labelled; open (http://\S+)")


def make_pairs(directory: Path, n: int = 6) -> Path:
    """n pairs with images and D3PO trajectories, sampled as the fast D3PO test config samples."""
    from flowrl.config import load_config
    from flowrl.preferences.pairs import build_pairs, write_pairs

    config = load_config(D3PO, fast_overrides(directory.parent / "unused"))
    pairs, rewards, _ = build_pairs(config, n, torch.Generator().manual_seed(0), trajectories=True)
    return write_pairs(directory, pairs, rewards)


def shared_pairs(tmp_path_factory, destination: Path) -> Path:
    """A copy of one pairs directory built once per test session (building it loads the model: seconds)."""
    import shutil

    source = tmp_path_factory.getbasetemp() / "labeling_pairs" / "pairs"
    if not source.exists():
        make_pairs(source)
    return Path(shutil.copytree(source, destination))


def run_label_cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """`flowrl label ...` to completion (for the refusals: it exits at once)."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from flowrl.cli import main; sys.exit(main())", "label", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=timeout,
    )


class LabelServer:
    """`flowrl label DIR --port 0` as a subprocess; ``url`` is the address it printed (with ?token=... if any)."""

    def __init__(self, directory: Path, *args: str, env: dict | None = None) -> None:
        environ = {k: v for k, v in os.environ.items() if k != "FLOWRL_LABEL_TOKEN"}
        environ.update(OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from flowrl.cli import main; sys.exit(main())",
                "label",
                str(directory),
                "--port",
                "0",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=environ,
        )
        self.first_line = self._first_line(time.monotonic() + 60)
        self.url = OPEN.search(self.first_line).group(1)
        self.port = int(re.search(r":(\d+)/", self.url).group(1))
        self.base = f"http://127.0.0.1:{self.port}/"  # what the tests connect to, whatever address it listens on
        self.token = self.url.split("?token=")[1] if "?token=" in self.url else None

    def _first_line(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if OPEN.search(line):
                    return line
            if self.proc.poll() is not None:
                break
        self.stop()
        raise AssertionError(f"flowrl label did not start: {self.proc.stderr.read()}")

    def stop(self) -> str:
        """Stop it (SIGTERM, as Ctrl-C would) and return what it wrote to stderr."""
        if self.proc.stderr.closed:
            return self.stderr
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.stderr = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.stderr

    def __enter__(self) -> LabelServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def call(url: str, payload: dict | None = None, headers: dict | None = None, data: bytes | None = None) -> tuple[int, dict | str]:
    """(status, JSON answer or text) of a GET, or of a POST of ``payload`` as JSON (``data``: raw body)."""
    head = dict(headers or {})
    if payload is not None:
        data, head = json.dumps(payload).encode(), {"Content-Type": "application/json", **head}
    request = urllib.request.Request(url, data=data, headers=head, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            status, body, kind = response.status, response.read(), response.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, body, kind = e.code, e.read(), e.headers.get("content-type", "")
    return status, (json.loads(body) if kind.startswith("application/json") else body.decode(errors="replace"))


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "labels.jsonl").read_text().splitlines()]
