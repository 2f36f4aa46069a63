"""DMD2 on the embedded digits flow model: the few-step student against the teacher.

Trains configs/digits/dmd2.yaml (the 2-step student; ``--checkpoint`` evaluates a finished run instead), then
evaluates, on the same held-out setting (80 samples: 20 unseen phrasings x 4 seeds, the reward ink + digit_classifier,
the judge digit_realism, seed diversity), with ``flowrl eval``:

- the teacher (the base model) with its own 10-, 2- and 1-step ODE (configs/digits/grpo.yaml: same model, reward,
  judge and held-out setting, no training);
- the student at its 2 steps, and at 1 step (not what it was trained for; shown for reference).

Prints one table and writes the numbers as JSON (``--json``). Results: docs/objectives/dmd2.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/dmd2_digits.py                       # train (~5-7 min on 2 busy cores) + evaluate
    .venv/bin/python bench/dmd2_digits.py --checkpoint runs/digits_dmd2/checkpoints/step_000100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOWRL = [sys.executable, "-m", "flowrl.cli"]
KEYS = {
    "reward": "eval/reward/mean",
    "ink": "eval/reward/ink",
    "classifier": "eval/reward/digit_classifier",
    "judge": "eval/judge/mean",
    "diversity": "eval/diversity",
}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def evaluate(source: str, steps: int, out: Path) -> dict:
    """``flowrl eval SOURCE eval.num_inference_steps=STEPS``: the metrics of its JSON line."""
    cmd = [*FLOWRL, "eval", source, f"eval.num_inference_steps={steps}", "--out", str(out), "--overwrite"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("{"))
    record = json.loads(line)
    return {name: round(float(record[key]), 4) for name, key in KEYS.items()}


def train(out: Path, iterations: int | None) -> tuple[Path, float]:
    cmd = [*FLOWRL, "train", "configs/digits/dmd2.yaml", f"output_dir={out}", "overwrite=true", "log.progress=false"]
    if iterations is not None:
        cmd.append(f"train.iterations={iterations}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    seconds = time.perf_counter() - start
    steps = sorted((out / "checkpoints").glob("step_*"))
    return steps[-1], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a finished dmd2 run's checkpoint (skip training)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "dmd2_digits", help="the run's output directory")
    parser.add_argument("--iterations", type=int, help="override train.iterations of the preset")
    parser.add_argument("--json", type=Path, help="write the numbers here (default: OUT/dmd2_digits.json)")
    args = parser.parse_args()
    seconds = None
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint, seconds = train(args.out, args.iterations)
    scratch = args.out / "eval"
    teacher = str(REPO / "configs" / "digits" / "grpo.yaml")
    rows = {
        "teacher, 10-step ODE": evaluate(teacher, 10, scratch / "teacher10"),
        "teacher, 2-step ODE": evaluate(teacher, 2, scratch / "teacher2"),
        "teacher, 1-step ODE": evaluate(teacher, 1, scratch / "teacher1"),
        "DMD2 student, 2 steps": evaluate(str(checkpoint), 2, scratch / "student2"),
        "DMD2 student at 1 step": evaluate(str(checkpoint), 1, scratch / "student1"),
    }
    print(f"{'model':<26}" + "".join(f"{k:>12}" for k in KEYS))
    for name, row in rows.items():
        print(f"{name:<26}" + "".join(f"{row[k]:>12.4f}" for k in KEYS))
    gap = rows["DMD2 student, 2 steps"]["reward"] - rows["teacher, 10-step ODE"]["reward"]
    print(f"student (2 steps) - teacher (10 steps) held-out reward: {gap:+.4f} (goal: within 0.05)")
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "checkpoint": str(checkpoint),
        "train_seconds": None if seconds is None else round(seconds, 1),
        "command": "OMP_NUM_THREADS=1 .venv/bin/python bench/dmd2_digits.py"
        + ("" if args.iterations is None else f" --iterations {args.iterations}"),
        "rows": rows,
        "reward_gap_student2_vs_teacher10": round(gap, 4),
    }
    path = args.json or args.out / "dmd2_digits.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
