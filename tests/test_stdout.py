"""Standard output carries only flowrl's own lines: a script reading `flowrl train --json` reads one JSON line even
with DeepSpeed installed (whose import prints an accelerator notice), and a closed pipe ends a command quietly."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from conftest import REPO, fast_overrides

from flowrl.cli import main


@pytest.mark.slow
def test_train_json_prints_one_json_line_and_library_notices_go_to_stderr(tmp_path):
    pytest.importorskip("deepspeed")  # the test extra installs it: the case users reported
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "train", "digits/grpo", *fast_overrides(tmp_path / "run"), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["status"] == "completed", proc.stdout[:500]
    assert "Setting accelerator to CPU" in proc.stderr  # DeepSpeed's notice is still shown, where it belongs


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_pipe_ends_the_command_quietly(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["presets"]) == 141  # 128 + SIGPIPE, as a shell reports it
    assert capsys.readouterr().err == ""  # no "could not access a file: broken pipe"


def test_library_prints_during_a_command_go_to_stderr(monkeypatch, capsys):
    """What a library prints while a command runs lands on stderr; flowrl's own lines stay on stdout."""
    import flowrl.cli as cli

    presets = cli._presets

    def presets_with_a_chatty_library(args):
        print("[WARNING] a library's notice")  # e.g. DeepSpeed at import
        return presets(args)

    monkeypatch.setattr(cli, "_presets", presets_with_a_chatty_library)
    assert main(["presets"]) == 0
    out, err = capsys.readouterr()
    assert "a library's notice" in err and "a library's notice" not in out
    assert "presets shipped in" in out.splitlines()[0]


def test_no_output_is_overwritten_and_a_default_goes_to_a_new_folder(tmp_path, monkeypatch, capsys):
    """`flowrl sample` without --out writes a new, named folder each time; an existing --out is refused (nothing
    written, before any model loads) unless --overwrite."""
    monkeypatch.chdir(tmp_path)
    base = ["sample", "digits_flow", "--prompt", "a handwritten seven", "-n", "1", "--steps", "2"]
    assert main(base) == 0 and main(base) == 0
    folders = sorted((tmp_path / "flowrl_outputs").iterdir())
    assert len(folders) == 2 and all((f / "samples.png").is_file() for f in folders)
    assert folders[0].name.startswith("sample_") and folders[1].name != folders[0].name
    out = tmp_path / "mine.png"
    out.write_bytes(b"keep")
    capsys.readouterr()
    assert main([*base, "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"flowrl: error: '{out}' already exists; give another --out, or --overwrite to replace it.\n"
    assert out.read_bytes() == b"keep"
    assert main([*base, "--out", str(out), "--overwrite"]) == 0 and out.read_bytes() != b"keep"
    # a search's grid too (its diffusion-LM rows would go beside it as .jsonl)
    grid = tmp_path / "grid.png"
    grid.write_bytes(b"keep")
    assert main(["eval", "digits/grpo", "--best-of", "2", "--out", str(grid)]) == 2
    assert "already exists; give another --out, or --overwrite" in capsys.readouterr().err and grid.read_bytes() == b"keep"
