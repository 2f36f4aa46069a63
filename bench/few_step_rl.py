"""RL on the few-step distilled student (issue #39 item 2): plain GRPO, DiffusionNFT and DMDR at one sample budget.

All three start from the shipped 2-step student ``digits_flow_2step`` (DMD2-distilled from ``digits_flow``,
``python -m flowrl.pipelines.embedded.distil_digits_student``), sample with its 2 steps and train on the same reward
(ink + digit_classifier) with the same samples an iteration (8 prompts x 8), for the same iterations:

- ``grpo``: configs/digits/grpo.yaml (Flow-GRPO's SDE, noise level 0.7, on the student's 2 steps);
- ``diffusion_nft``: configs/digits/diffusion_nft.yaml (ODE rollouts, beta 0.1) on the student;
- ``dmdr``: configs/digits/dmdr.yaml (ReFL plus DMD towards the 10-step teacher digits_flow);
- ``refl``: the same with ``objective.dm_weight=0`` (ReFL alone: what the DM regulariser changes).

Each run is ``flowrl train`` in its own process (one thread), evaluated every ``--every`` iterations on the held-out
setting (20 unseen phrasings x 4 seeds, the 2-step ODE): held-out reward, the judge (digit_realism, never trained on)
and seed diversity. Writes bench/results/few_step_rl.json (every curve, and the final values' mean over seeds with
their ratios to the student's) and bench/results/few_step_rl.png (the three metrics against iterations, one line per
run), and per method the judge and diversity at the first evaluation reaching a held-out reward level (what each keeps
for the same gain). ``--merge NAME`` adds the runs of an earlier record (another method's arm). Results:
docs/objectives/dmdr.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/few_step_rl.py                      # 3 methods x 3 seeds
    OMP_NUM_THREADS=1 .venv/bin/python bench/few_step_rl.py --iterations 4 --seeds 0 --every 2 --name few_step_rl_quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import read, stamp, this_command, write  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STUDENT = "digits_flow_2step"
METRICS = {"reward": "eval/reward/mean", "judge": "eval/judge/mean", "diversity": "eval/diversity"}
# the student, its 2 steps, 64 samples an iteration (8 prompts x 8), for every method
COMMON = [
    f"pipeline.pretrained={STUDENT}",
    "rollout.num_inference_steps=2",
    "train.prompts_per_iteration=8",
    "train.num_generations=8",
    "log.progress=false",
    "log.trackers=[]",
]
METHODS = {
    "grpo": ("configs/digits/grpo.yaml", []),
    "diffusion_nft": ("configs/digits/diffusion_nft.yaml", []),
    "dmdr": ("configs/digits/dmdr.yaml", []),
    "refl": ("configs/digits/dmdr.yaml", ["objective.dm_weight=0"]),  # DMDR without its regulariser: the ablation
}
REWARD_LEVELS = (1.40, 1.45, 1.50)  # held-out rewards at which the methods' judges and diversities are compared


def train(method: str, seed: int, iterations: int, every: int, out: Path, extra: list[str]) -> dict:
    """One ``flowrl train`` run; its evaluation curve and wall time."""
    preset, own = METHODS[method]
    overrides = [*COMMON, *own, *extra, f"seed={seed}", f"train.iterations={iterations}", f"eval.every={every}"]
    overrides += [f"output_dir={out}", "overwrite=true", f"log.checkpoint_every={iterations}"]
    cmd = [sys.executable, "-m", "flowrl.cli", "train", preset, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [{"iteration": r["step"], **{k: round(float(r[v]), 4) for k, v in METRICS.items()}} for r in rows if METRICS["reward"] in r]
    return {"method": method, "seed": seed, "wall_s": round(time.perf_counter() - start, 1), "curve": curve}


def summarise(runs: list[dict], methods: list[str]) -> dict:
    """Per method: the mean over seeds of the student's (iteration 0) and the final values, the final's ratio to the
    student's, and the per-seed finals and peaks (a collapse shows as a peak above the final)."""
    out = {}
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        start = {k: sum(r["curve"][0][k] for r in mine) / len(mine) for k in METRICS}
        final = {k: sum(r["curve"][-1][k] for r in mine) / len(mine) for k in METRICS}
        out[m] = {
            "start": {k: round(v, 4) for k, v in start.items()},
            "final": {k: round(v, 4) for k, v in final.items()},
            "final_over_start": {k: round(final[k] / start[k], 4) for k in METRICS},
            "final_per_seed": {k: [r["curve"][-1][k] for r in mine] for k in METRICS},
            "best_reward_per_seed": [max(p["reward"] for p in r["curve"]) for r in mine],
            "wall_s_per_run": round(sum(r["wall_s"] for r in mine) / len(mine), 1),
            "at_reward": at_reward(mine),
        }
    return out


def at_reward(runs: list[dict]) -> dict:
    """Per reward level: the mean over the runs that reached it of the judge and diversity at their first evaluation
    at or above it (what a method keeps for a given gain), and how many runs reached it."""
    out = {}
    for level in REWARD_LEVELS:
        hits = [next(p for p in r["curve"] if p["reward"] >= level) for r in runs if any(p["reward"] >= level for p in r["curve"])]
        if hits:
            out[f"{level:.2f}"] = {
                "runs": len(hits),
                **{k: round(sum(h[k] for h in hits) / len(hits), 4) for k in ("iteration", "judge", "diversity")},
            }
    return out


def plot(runs: list[dict], methods: list[str], path: Path, title: str) -> None:
    """Top: the three metrics against iterations; bottom: the judge and the diversity against the held-out reward
    (what each method keeps for the same gain), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.4), dpi=100)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = {"reward": "held-out reward", "judge": "judge (digit_realism)", "diversity": "seed diversity"}
    panels = [(ax, "iteration", key) for ax, key in zip(axes[0], labels)] + [
        (axes[1][0], "reward", "judge"),
        (axes[1][1], "reward", "diversity"),
    ]
    for ax, x_key, y_key in panels:
        for r in runs:
            color = palette[methods.index(r["method"]) % len(palette)]
            first = r["seed"] == min(x["seed"] for x in runs if x["method"] == r["method"])
            xs, ys = [p[x_key] for p in r["curve"]], [p[y_key] for p in r["curve"]]
            ax.plot(xs, ys, "-o", ms=2.5, color=color, alpha=0.8, lw=1.2, label=r["method"] if first else None)
        ax.set_xlabel("iteration (64 samples each)" if x_key == "iteration" else labels[x_key])
        ax.set_ylabel(labels[y_key])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[1][2].axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=80)
    p.add_argument("--every", type=int, default=10, help="iterations between held-out evaluations")
    p.add_argument("--runs", type=Path, default=REPO / "runs" / "few_step_rl", help="where the runs are written")
    p.add_argument("--name", default="few_step_rl", help="bench/results/NAME.json and NAME.png")
    p.add_argument("--set", nargs="*", default=[], metavar="METHOD:KEY=VALUE", help="an override for one method's runs")
    p.add_argument("--merge", nargs="*", default=[], metavar="NAME", help="also take the runs of these earlier records")
    a = p.parse_args()
    extra = {m: [s.split(":", 1)[1] for s in a.set if s.split(":", 1)[0] == m] for m in a.methods}
    earlier = [read(name) for name in a.merge]
    runs = [r for record in earlier for r in record["runs"]]
    for seed in a.seeds:
        for m in a.methods:
            run = train(m, seed, a.iterations, a.every, a.runs / f"{m}_s{seed}", extra[m])
            runs.append(run)
            last = run["curve"][-1]
            print(f"{m:<14} seed {seed}: " + "  ".join(f"{k} {last[k]:.4f}" for k in METRICS) + f"  ({run['wall_s']:.0f} s)", flush=True)
    methods = [m for m in METHODS if any(r["method"] == m for r in runs)]
    summary = summarise(runs, methods)
    print(f"{'method':<14}" + "".join(f"{k + ' final/start':>24}" for k in METRICS))
    for m, s in summary.items():
        print(f"{m:<14}" + "".join(f"{s['final'][k]:>11.4f} / {s['start'][k]:.4f} = {s['final_over_start'][k]:.3f}" for k in METRICS))
    for m, s in summary.items():
        print(
            f"{m:<14} at held-out reward "
            + "; ".join(
                f">= {lv}: judge {v['judge']:.3f}, diversity {v['diversity']:.3f} ({v['runs']} runs)" for lv, v in s["at_reward"].items()
            )
        )
    iterations = max(p["iteration"] for r in runs for p in r["curve"])  # merged records' own when nothing ran here
    seeds = sorted({r["seed"] for r in runs})
    record = {**stamp(this_command()), "student": STUDENT, "iterations": iterations, "seeds": seeds}
    merged = [{"name": n, "command": r["command"], "commit": r["commit"], "date": r["date"]} for n, r in zip(a.merge, earlier)]
    record.update({"samples_per_iteration": 64, "overrides": extra, "merged": merged, "summary": summary, "runs": runs})
    path = write(a.name, record)
    title = f"RL on the 2-step student {STUDENT}: {iterations} iterations x 64 samples, seeds {seeds}"
    plot(runs, methods, path.with_suffix(".png"), title)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
