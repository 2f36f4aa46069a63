"""diffu-GRPO, JustGRPO, DCoLT and TraceRL on the embedded 4x4 Sudoku LM (sudoku_mdlm) and the block-level ELBO objective on
a block-diffusion Sudoku LM (sudoku_bd3lm) at equal samples, several seeds: the held-out accuracy (greedy, d1's 500
test puzzles) against iterations, in one plot.

Each run is ``flowrl train configs/dllm/sudoku_diffu_grpo.yaml`` with the objective section replaced (the same
prompts, reward, rollout size: prompts_per_iteration x num_generations completions per iteration, the same iterations
for every objective) and ``seed`` set; JustGRPO's rollouts are its own (left to right, one token per step) and DCoLT's
unmasking order is its trained head's (``sampler.remasking=policy``), as each method defines them; TraceRL takes its
own preset's learning rate (3e-5) and shrink (configs/dllm/sudoku_tracerl.yaml), the others lr 1e-5. The block-level
ELBO objective (``block_elbo``, the settings of configs/dllm/block_elbo.yaml) needs a block-diffusion model: it runs on
sudoku_bd3lm (``flowrl.pipelines.embedded.train_sudoku_bd3lm``: the same SFT puzzles, a block-causal Llama, blocks of 9
tokens), trained into runs/sudoku_bd3lm with its default settings (seed 0, one thread) when absent, and generates
with its blocks and the exact key-value cache. That model starts from its own accuracy, not sudoku_mdlm's: the plot
draws every curve from its own start and the legend names each one's model and start.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sudoku_rl_comparison.py [--iterations 60] [--seeds 0 1 2] \\
        [--objectives diffu_grpo just_grpo dcolt block_elbo tracerl] [--out runs/sudoku_comparison]

Writes bench/results/sudoku_rl_comparison.json (every run's curve and wall time) after each run and the plot
docs/images/sudoku_rl_comparison.png. Needs ../shared/data (FLOWRL_DATA_DIR). Results: docs/objectives/dllm.md.
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
sys.path.insert(0, str(REPO))

from bench import record  # noqa: E402

PRESET = "configs/dllm/sudoku_diffu_grpo.yaml"
PLOT = REPO / "docs" / "images" / "sudoku_rl_comparison.png"
BD3LM = REPO / "runs" / "sudoku_bd3lm"  # block_elbo's model: not shipped, trained here when absent
# each objective's section as its own preset on arith_mdlm writes it; the learning rate is the Sudoku preset's (1e-5) but
# for tracerl, which has a Sudoku preset of its own
OBJECTIVES = {
    "diffu_grpo": [],
    "just_grpo": ["objective={name: just_grpo, clip_range: 0.2, std: unbiased, loss_aggregation: nonzero_advantage_mean}"],
    "dcolt": [
        "objective={name: dcolt, clip_range: 0.2, std: unbiased, loss_aggregation: nonzero_advantage_mean, confidence_prior: 10.0}",
        "sampler.remasking=policy",
    ],
    "block_elbo": [
        f"pipeline.pretrained={BD3LM}",
        "sampler.block_length=9",  # the model's block length (config diffusion_block_length)
        "sampler.kv_cache=exact",
        "objective={name: block_elbo, num_timesteps: 2, likelihood: vectorised, log_ratio: sum, clip_range: 0.2, num_mask_seeds: 2}",
    ],
    # its own Sudoku preset's settings (configs/dllm/sudoku_tracerl.yaml): lr 3e-5, two steps per replayed forward
    "tracerl": ["objective={name: tracerl, steps_per_forward: 2}", "train.learning_rate=3e-5"],
}
MODEL = {"block_elbo": "sudoku_bd3lm"}  # the model each objective trains, sudoku_mdlm where not named


def ensure_bd3lm() -> dict:
    """sudoku_bd3lm's training_info, training it into BD3LM first when absent (deterministic: seed 0, one thread)."""
    if not (BD3LM / "training_info.json").is_file():
        import torch

        from flowrl.pipelines.embedded.train_sudoku_bd3lm import train

        torch.set_num_threads(1)
        train(BD3LM)
    return json.loads((BD3LM / "training_info.json").read_text())


def run(objective: str, seed: int, iterations: int, every: int, out: Path) -> dict:
    """One training run; its held-out accuracy at each evaluation and its wall time."""
    cmd = [sys.executable, "-m", "flowrl.cli", "train", PRESET, *OBJECTIVES[objective], f"seed={seed}", f"output_dir={out}"]
    cmd += [f"train.iterations={iterations}", f"eval.every={every}", "overwrite=true", "log.progress=false"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    if not (out / "metrics.jsonl").is_file():
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [[r["step"], round(r["eval/reward/mean"], 4)] for r in rows if "eval/reward/mean" in r]
    rollout = [round(r["reward/mean"], 4) for r in rows if "reward/mean" in r]
    # a run whose groups all score alike stops early (train.flat_reward_stop): its last line says so
    stopped = proc.returncode != 0 or len(rollout) < iterations
    return {
        "objective": objective,
        "model": MODEL.get(objective, "sudoku_mdlm"),
        "seed": seed,
        "curve": curve,
        "rollout_reward": rollout,
        "stopped_early": stopped,
        "note": proc.stderr.strip().splitlines()[-1][-300:] if stopped and proc.stderr.strip() else "",
        "wall_s": round(time.perf_counter() - start, 1),
    }


def plot(runs: list[dict], path: Path) -> None:
    """Accuracy against iterations: each objective's seed mean (line) and its seeds (thin), each from its own model's
    start (named in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(OBJECTIVES):
        mine = [r for r in runs if r["objective"] == name]
        if not mine:
            continue
        for r in mine:
            ax.plot(*zip(*r["curve"], strict=True), color=f"C{i}", alpha=0.3, lw=0.8, marker="." if r["stopped_early"] else None)
        steps = sorted({s for r in mine for s, _ in r["curve"]})
        at = [[a for r in mine for s, a in r["curve"] if s == step] for step in steps]
        mean = [sum(v) / len(v) for v in at]
        label = f"{name} on {MODEL.get(name, 'sudoku_mdlm')}, from {mean[0]:.3f} ({len(mine)} seeds)"
        ax.plot(steps, mean, color=f"C{i}", lw=2, label=label)
    ax.set_xlabel("iteration (128 completions each)")
    ax.set_ylabel("held-out accuracy (greedy, 500 puzzles)")
    ax.set_title("4x4 Sudoku: RL objectives at equal samples")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sudoku_comparison")
    p.add_argument("--plot-only", action="store_true", help="draw the plot from the JSON the runs wrote (an interrupted bench)")
    p.add_argument("--append", action="store_true", help="add these runs to the JSON's (more seeds for an interrupted bench)")
    a = p.parse_args()
    if a.plot_only:
        plot(record.read("sudoku_rl_comparison")["runs"], PLOT)
        return
    earlier = record.read("sudoku_rl_comparison") if a.append else None
    runs = list(earlier["runs"]) if earlier else []
    # block_elbo's model's training_info, kept when a later --append runs other objectives
    extra = {k: earlier[k] for k in ["sudoku_bd3lm"] if earlier and k in earlier}
    if "block_elbo" in a.objectives:
        extra["sudoku_bd3lm"] = ensure_bd3lm()
    for seed in a.seeds:  # seed-major: an interrupted bench still has every objective at the first seeds
        for name in a.objectives:
            runs.append(run(name, seed, a.iterations, a.every, a.out / f"{name}_s{seed}"))
            print(json.dumps(runs[-1]), flush=True)
            body = {"iterations": a.iterations, "completions_per_iteration": 128, **extra, "runs": runs}
            record.write("sudoku_rl_comparison", {**record.stamp(record.this_command()), **body})
    plot(runs, PLOT)
    print(f"wrote {PLOT}")


if __name__ == "__main__":
    main()
