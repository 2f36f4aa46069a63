"""bench/few_step_rl.py's summary against hand-derived numbers: the finals' means and ratios to the student's, and
what each method keeps at a reward level (the first evaluation at or above it, averaged over the runs reaching it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("few_step_rl", Path(__file__).resolve().parents[1] / "bench" / "few_step_rl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _run(method: str, seed: int, points: list[tuple[int, float, float, float]]) -> dict:
    return {
        "method": method,
        "seed": seed,
        "wall_s": 10.0 * (seed + 1),
        "curve": [{"iteration": i, "reward": r, "judge": j, "diversity": d} for i, r, j, d in points],
    }


def test_summary_hand_values():
    runs = [
        _run("grpo", 0, [(0, 1.3, 0.9, 2.0), (10, 1.42, 0.8, 1.5), (20, 1.6, 0.5, 1.0)]),
        _run("grpo", 1, [(0, 1.3, 0.9, 2.0), (10, 1.38, 0.85, 1.8), (20, 1.46, 0.7, 1.2)]),
    ]
    (grpo,) = bench.summarise(runs, ["grpo"]).values()
    # finals: reward (1.6 + 1.46) / 2 = 1.53, judge 0.6, diversity 1.1; over the start's 1.3 / 0.9 / 2.0
    assert grpo["final"] == {"reward": 1.53, "judge": 0.6, "diversity": 1.1}
    assert grpo["final_over_start"] == pytest.approx({"reward": 1.53 / 1.3, "judge": 0.6 / 0.9, "diversity": 0.55}, abs=1e-4)
    assert grpo["best_reward_per_seed"] == [1.6, 1.46] and grpo["wall_s_per_run"] == 15.0
    # >= 1.40: seed 0 at iteration 10 (0.8, 1.5), seed 1 at 20 (0.7, 1.2): means 15, 0.75, 1.35
    # >= 1.45: seed 0 at 20 (0.5, 1.0), seed 1 at 20 (0.7, 1.2); >= 1.50: seed 0 alone
    assert grpo["at_reward"] == {
        "1.40": {"runs": 2, "iteration": 15.0, "judge": 0.75, "diversity": 1.35},
        "1.45": {"runs": 2, "iteration": 20.0, "judge": 0.6, "diversity": 1.1},
        "1.50": {"runs": 1, "iteration": 20.0, "judge": 0.5, "diversity": 1.0},
    }
