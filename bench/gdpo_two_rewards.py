"""GDPO's multi-reward advantages against the weighted sum, on two-reward digits tasks where one reward is much harder.

The task: the GRPO digits preset (flow SDE rollouts, 64 samples per iteration, groups of 8), rewarded by ``ink``
(weight 1: the mean pixel intensity, ~0.30 at the start with a spread of ~0.03 inside a prompt's group, easy to raise)
and a hard reward (weight 1, ``--hard``):

- ``next_digit``: the digit classifier's probability that the drawing reads as the digit *after* the prompted one,
  (d + 1) mod 10: ~3e-4 at the start, spread of the same order inside a group;
- ``one_likeness``: the classifier's probability of a 1 whatever the prompt (a thin upright stroke), which bolder ink
  works against.

``multi_reward: weighted_sum`` normalises ink + hard in each group, so ink's much larger spread decides the advantage;
``per_reward`` and ``gdpo`` (arXiv:2601.05242) normalise each reward in its group first, so both count alike; GDPO
then normalises the sum over the batch. Same seed, prompts and rollout noise for every mode. Prints the held-out curve
of each reward (80 held-out samples: 20 unseen phrasings x 4 seeds, ODE) and writes a PNG. Results and what they show:
docs/objectives/gdpo.md and bench/RESULTS.md.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/gdpo_two_rewards.py --modes weighted_sum gdpo   # 2 x 30 iterations
    .venv/bin/python bench/gdpo_two_rewards.py --hard one_likeness --iterations 15 --out runs/gdpo_one  # keep the runs
    .venv/bin/python bench/gdpo_two_rewards.py --hard one_likeness --iterations 15 --out runs/gdpo_one --reuse  # report them
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import flowrl
from flowrl.reward_models.digit_classifier import DigitClassifierReward, target_digits

REPO = Path(__file__).resolve().parents[1]
CLASSIFIER = DigitClassifierReward()


def next_digit(samples, prompts, metadata):
    """The classifier's probability of the digit after the prompted one, (d + 1) mod 10."""
    wanted = torch.tensor([(d + 1) % 10 for d in target_digits(metadata)], device=samples.device)
    probs = CLASSIFIER.logits(samples).softmax(dim=-1)
    return probs.gather(1, wanted[:, None]).squeeze(1)


def one_likeness(samples, prompts, metadata):
    """The classifier's probability of a 1, whatever the prompt: a thin upright stroke, which bolder ink works against."""
    return CLASSIFIER.logits(samples).softmax(dim=-1)[:, 1]


HARD = {"next_digit": next_digit, "one_likeness": one_likeness}


def run(mode: str, iterations: int, every: int, seed: int, out: Path, reuse: bool, hard: str) -> dict:
    metrics = out / mode / "metrics.jsonl"
    done = (
        reuse and (out / mode / "summary.json").exists() and json.loads((out / mode / "summary.json").read_text())["status"] == "completed"
    )
    if done:  # a finished run of this mode in --out: read it instead of training again
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        return {"curve": {r["step"]: r for r in rows if f"eval/reward/{hard}" in r}, "wall_s": float("nan")}
    overrides = [
        f"output_dir={out / mode}",
        f"seed={seed}",
        f"train.iterations={iterations}",
        f"eval.every={every}",
        f"objective.multi_reward={mode}",
        "log.progress=false",
        "log.checkpoint_every=0",
        "log.trackers=[]",
    ]
    rewards = {"ink": flowrl.reward("ink"), hard: HARD[hard]}
    trainer = flowrl.Trainer("digits/grpo", overrides, reward=rewards, reward_weights={"ink": 1.0, hard: 1.0})
    start = time.perf_counter()
    trainer.train()
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = {r["step"]: r for r in rows if f"eval/reward/{hard}" in r}
    return {"curve": curve, "wall_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["weighted_sum", "gdpo"], help="also: per_reward")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hard", choices=sorted(HARD), default="next_digit", help="the hard reward beside ink")
    p.add_argument("--png", type=Path, default=REPO / "docs" / "images" / "gdpo_two_rewards.png")
    p.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="read the completed runs already in --out instead of training them again")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            results[mode] = run(mode, args.iterations, args.every, args.seed, args.out or Path(tmp), args.reuse, args.hard)
    steps = sorted(next(iter(results.values()))["curve"])
    print(f"held-out reward per component (seed {args.seed}); columns: iteration " + " ".join(str(s) for s in steps))
    for key in (args.hard, "ink"):
        for mode, res in results.items():
            values = " ".join(f"{res['curve'][s][f'eval/reward/{key}']:.4f}" for s in steps)
            print(f"  {key:10s} {mode:12s} {values}")
    for mode, res in results.items():
        last = res["curve"][steps[-1]]
        print(f"  {mode:12s} judge {last['eval/judge/mean']:.3f}  seed spread {last['eval/diversity']:.2f}  wall {res['wall_s']:.0f} s")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, title in ((axes[0], args.hard, f"{args.hard} (the hard reward)"), (axes[1], "ink", "ink (the easy reward)")):
        for mode, res in results.items():
            ax.plot(steps, [res["curve"][s][f"eval/reward/{key}"] for s in steps], marker="o", label=mode)
        ax.set_title(title)
        ax.set_xlabel("iteration (64 samples each)")
        ax.set_ylabel("held-out mean")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"GRPO on ink + {args.hard} (1:1), digits, seed {args.seed}: weighted sum vs per-reward / GDPO advantages", fontsize=9)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
