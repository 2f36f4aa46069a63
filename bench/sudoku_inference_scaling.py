"""Inference-time scaling on the embedded Sudoku LM, before and after RL: best-of-N over candidates sampled at
temperature 1 on d1's 500 test puzzles, chosen by majority vote, by the model's likelihood, and by
``sudoku_constraints``, a verifier that never sees the solution (rows, columns, boxes and the clues read from the
prompt); pass@N (any candidate right) is the oracle bound. Each model is one ``flowrl eval --best-of N`` run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sudoku_inference_scaling.py --checkpoint runs/dllm_sudoku_diffu_grpo/checkpoints/latest [--n 16]
    OMP_NUM_THREADS=1 .venv/bin/python bench/sudoku_inference_scaling.py --checkpoint runs/dllm_sudoku_tracerl/checkpoints/latest \
        --record sudoku_inference_scaling_tracerl

For a 4x4 puzzle with one solution, a grid that breaks no rule and keeps every clue is the solution, so the
verifier's choice is right whenever some candidate is: its curve is pass@N, reached without the answer key.
Writes bench/results/sudoku_inference_scaling.json (or the ``--record`` name). Needs ../shared/data (FLOWRL_DATA_DIR). Results:
docs/objectives/dllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import record  # noqa: E402

PRESET = "configs/dllm/sudoku_diffu_grpo.yaml"
RULES = "majority,likelihood,sudoku_constraints"


def best_of(source: str, n: int, out: Path) -> dict:
    """``flowrl eval --best-of N`` of one model (the preset's base model, or a checkpoint): its JSON line."""
    cmd = [sys.executable, "-m", "flowrl.cli", "eval", "--best-of", str(n), "--select", RULES, "--out", str(out), "--overwrite"]
    cmd += [source, "sampler.eval_temperature=1", "prompts.eval_size=500"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    line = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("{")))
    keep = {k: v for k, v in line.items() if k.startswith("eval/")}
    return {**keep, "wall_seconds_per_item": line["cost"]["wall_seconds_per_item"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument(
        "--record", default="sudoku_inference_scaling", help="the name of the JSON under bench/results/ (one per preset's checkpoint)"
    )
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sudoku_inference_scaling")
    a = p.parse_args()
    result = {"n": a.n, "rules": RULES.split(","), "temperature": 1.0, "puzzles": 500}
    for name, source in (("base", PRESET), ("trained", str(a.checkpoint))):
        result[name] = best_of(source, a.n, a.out / f"{name}.png")
        print(name, json.dumps(result[name]), flush=True)
    record.write(a.record, {**record.stamp(record.this_command()), "checkpoint": str(a.checkpoint), **result})


if __name__ == "__main__":
    main()
