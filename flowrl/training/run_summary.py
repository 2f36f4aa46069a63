"""What ``flowrl train`` prints when a run ends: a few lines a person reads (how it ended, the held-out reward before
and after, where the run is, what to run next). The whole record stays in the run's ``summary.json``; ``flowrl train
--json`` prints it as one line instead, for scripts."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def duration(seconds: float) -> str:
    """``2 min 21 s`` / ``48 s`` / ``1 h 05 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _reward_line(summary: dict[str, Any]) -> str:
    before, after = summary.get("eval_reward_initial"), summary.get("eval_reward_final")
    if before is None and after is None:
        return "  held-out reward: not evaluated (eval.every: 0 and no final evaluation)"
    if after is None or summary.get("eval_reward_final_step") in (None, 0):
        return f"  held-out reward: {before:.4f} at the start; no evaluation after training"
    start = f"{before:.4f}" if before is not None else "not evaluated"
    if before is not None and summary.get("eval_reward_initial_step"):  # a run started from a trained checkpoint
        start += f" (the checkpoint it started from, iteration {summary['eval_reward_initial_step']})"
    gain = f" ({after - before:+.4f})" if before is not None else ""
    return f"  held-out reward: {start} -> {after:.4f}{gain} after iteration {summary['eval_reward_final_step']}"


def _files(run_dir: Path) -> str:
    """The run's files a person opens first, those that exist."""
    names = ["samples_before.png", "samples_after.png", "reward_curve.png", "instruments.png", "summary.json"]
    return ", ".join(n for n in names if (run_dir / n).exists()) or "summary.json"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint directory the run's ``checkpoints/latest`` pointer names (a file holding its name), if any."""
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    directory = pointer.parent / pointer.read_text().strip()
    return directory if directory.is_dir() else None


def _next_commands(summary: dict[str, Any], run_dir: Path) -> list[str]:
    latest = latest_checkpoint(run_dir)
    if summary.get("status") in ("stopped", "preempted", "failed"):  # go on from the run's own resolved config
        config = run_dir / "config.yaml"
        return [f"flowrl train {shlex.quote(str(config))} resume_from=latest"] if latest and config.exists() else []
    if latest is None:
        return []
    ck = shlex.quote(str(latest))
    commands = [f"flowrl eval {ck} --best-of 4"]
    if (run_dir / "samples_after.png").exists():  # an image or video model: its checkpoint samples and exports
        commands += [f"flowrl sample {ck} -n 8", f"flowrl export {ck} OUT_DIR"]
    return commands


def human_summary(summary: dict[str, Any], run_dir: Path) -> str:
    """The lines ``flowrl train`` ends with, from the run's summary and the files in ``run_dir``."""
    status = summary.get("status", "completed")
    done, planned = summary.get("iterations_completed", 0), summary.get("iterations_planned", 0)
    head = f"flowrl: {status} {done} of {planned} iterations"
    wall = summary.get("wall_seconds_this_process")
    if wall is not None:
        head += f" in {duration(wall)}"
    if summary.get("samples_per_iteration"):
        head += f" ({summary['samples_per_iteration']} samples each)"
    lines = [head + "."]
    if summary.get("reason"):
        lines.append(f"  why: {summary['reason']}")
    lines.append(_reward_line(summary))
    lines.append(f"  run: {run_dir} ({_files(run_dir)}; checkpoints/)")
    commands = _next_commands(summary, run_dir)
    if commands:
        lines.append("  next: " + commands[0])
        lines += ["        " + c for c in commands[1:]]
    return "\n".join(lines)
