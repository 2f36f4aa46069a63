"""Adjoint Matching vs GRPO on the digits presets at equal wall time, measured in one run.

Both presets (configs/digits/adjoint_matching.yaml and configs/digits/grpo.yaml) train in one process,
interleaved: after each Adjoint Matching iteration, GRPO iterations run until GRPO's training time has
caught up with Adjoint Matching's (wall time of ``Trainer.train_iteration``; evaluations are not
counted). Load from other jobs on the machine therefore falls on both alike. GRPO is also evaluated at its
preset's own length (30 iterations) on the way.

Each model is evaluated on the runs' held-out setting (20 unseen prompt phrasings x 4 fixed seeds,
10-step ODE; ``Trainer.evaluate``) and, from the same 80 samples, on diversity: the mean pairwise L2
distance between the samples of one prompt's 4 seeds (pixels in [0, 1], 8x8), averaged over the prompts.

    python bench/adjoint_matching_vs_grpo.py [--am-iterations N] [--threads 2] [--json OUT]

Prints one table; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import load_config  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402


def evaluate(trainer: Trainer) -> dict[str, float]:
    """Held-out reward, its parts and seed diversity: flowrl's own ``eval/diversity``, which every evaluation logs
    (flowrl/evaluation/diversity.py::seed_diversity over all the held-out samples)."""
    metrics = trainer.evaluate()
    return {
        "reward": metrics["eval/reward/mean"],
        "ink": metrics["eval/reward/ink"],
        "classifier": metrics["eval/reward/digit_classifier"],
        "diversity": metrics["eval/diversity"],
    }


def build(preset: str, tmp: str, extra: list[str]) -> Trainer:
    config = load_config(
        REPO / "configs" / "digits" / preset, [f"output_dir={tmp}/{preset}", "log.progress=false", "log.grid_prompts=1000", *extra]
    )
    return Trainer(config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--am-iterations", type=int, default=None, help="Adjoint Matching iterations (default: the preset's)")
    p.add_argument("--grpo-preset-iterations", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        am, grpo = build("adjoint_matching.yaml", tmp, []), build("grpo.yaml", tmp, [])
        n_am = a.am_iterations or am.config.train.iterations
        base = evaluate(am)
        assert abs(evaluate(grpo)["reward"] - base["reward"]) < 1e-6, "the two presets must start from the same model"
        rows = {"base model": {**base, "iterations": 0, "train_s": 0.0}}
        t_am = t_grpo = 0.0
        j = 0
        for i in range(n_am):
            t0 = time.perf_counter()
            am.train_iteration(i)
            t_am += time.perf_counter() - t0
            while t_grpo < t_am:
                t0 = time.perf_counter()
                grpo.train_iteration(j)
                t_grpo += time.perf_counter() - t0
                j += 1
                if j == a.grpo_preset_iterations:
                    rows[f"GRPO, preset length ({j} it)"] = {**evaluate(grpo), "iterations": j, "train_s": t_grpo}
        rows[f"Adjoint Matching ({n_am} it)"] = {**evaluate(am), "iterations": n_am, "train_s": t_am}
        rows.pop(f"GRPO, preset length ({j} it)", None)  # the same model as the next row
        rows[f"GRPO, equal wall time ({j} it)"] = {**evaluate(grpo), "iterations": j, "train_s": t_grpo}
    print(
        f"digits_flow, held-out 20 prompts x 4 seeds, 10-step ODE; {torch.get_num_threads()} threads; "
        f"training time only (Trainer.train_iteration), interleaved"
    )
    print(f"{'model':<34}{'iters':>6}{'train s':>9}{'reward':>9}{'ink':>8}{'classif.':>10}{'diversity':>11}")
    for name, r in rows.items():
        print(
            f"{name:<34}{r['iterations']:>6}{r['train_s']:>9.1f}{r['reward']:>9.4f}{r['ink']:>8.3f}{r['classifier']:>10.3f}{r['diversity']:>11.3f}"
        )
    result = {"rows": {k: {m: round(v, 4) for m, v in r.items()} for k, r in rows.items()}, "threads": torch.get_num_threads()}
    if a.json:
        a.json.write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
