"""The reward-vs-KL frontier on digits: Flow-DPPO's divergence trust region against Flow-GRPO's ratio clip and
GRPO-Guard, at several inner epochs.

Every method is a preset derived in code from configs/digits (the README's reward, ink + digit_classifier; 8 prompts
x 8 samples per iteration, 10 steps, Flow-GRPO's SDE with a = 0.7, 60% of the steps trained, lr 3e-4):

    grpo_clip    configs/digits/grpo.yaml: PPO's ratio clip, clip_range 1e-3
    grpo_guard   grpo.yaml + GRPO-Guard (objective.ratio_norm: true, objective.step_weighting: inverse_dt) with the
                 clip range matched to the normalised ratio (2e-4, docs/instruments.md)
    flow_dppo    configs/digits/flow_dppo.yaml: no clip, the exact-KL trust-region mask (kl_threshold 1e-4)

each trained with ``train.inner_epochs`` in ``--epochs`` (every epoch two minibatches of 32, so 2, 4, 8 optimizer
steps per rollout at 1, 2, 4 epochs). Before training and every ``--eval-every`` iterations the run records

- the held-out reward and judge (``Trainer.evaluate``: 20 unseen phrasings x 4 seeds, 10-step ODE; judge
  ``digit_realism``, never trained on), and
- the KL to the base model, ``path_kl`` below: the KL between the path distributions of the trained and the
  base model's training sampler (the same SDE, every step stochastic), estimated on the held-out items with fixed
  noise (one trajectory each, drawn from the trained policy). By the chain rule for path measures,

      KL(P_theta || P_base) = E_{x ~ P_theta} [ sum_k KL( N(mu_theta(x_k), s_k^2 I) || N(mu_base(x_k), s_k^2 I) ) ]
                            = E [ sum_k sum_dims (mu_theta - mu_base)^2 / (2 s_k^2) ],

  exact per step (the two transitions share their std s_k, a function of the time grid alone) and Monte Carlo
  over the x_k; in nats per sample (summed over the 64 pixel dimensions, not the per-dimension mean the losses
  use). It bounds the KL between the final images (data processing inequality).

    python bench/kl_frontier.py [--epochs 1,2,4] [--iterations 20] [--eval-every 5] [--plot PNG] [--json OUT]
    python bench/kl_frontier.py --quick     # tiny: 1 method x 1 epoch, 2 iterations on 3 steps (the test's)

Prints a table (per run: the reward, judge and KL at each evaluation); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import read_yaml_mapping, validate  # noqa: E402
from flowrl.objectives.diffusion_nft import swapped_weights  # noqa: E402
from flowrl.objectives.functional import gaussian_kl  # noqa: E402
from flowrl.samplers.rollout import rollout, start_noise  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402

# method -> (preset in configs/digits, changes to its tree as {dotted key: value})
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "grpo_clip": ("grpo.yaml", {}),
    "grpo_guard": ("grpo.yaml", {"objective.ratio_norm": True, "objective.step_weighting": "inverse_dt", "objective.clip_range": 2e-4}),
    "flow_dppo": ("flow_dppo.yaml", {}),
}


def set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def method_config(method: str, epochs: int, seed: int, output_dir: str, overrides: dict[str, Any] | None = None):
    preset, changes = METHODS[method]
    tree = read_yaml_mapping(REPO / "configs" / "digits" / preset, "config file")
    settings = {
        "seed": seed,
        "output_dir": output_dir,
        "train.inner_epochs": epochs,
        "eval.judge": {"components": {"digit_realism": 1.0}},
        "log.progress": False,
        "log.trackers": [],
        "log.checkpoint_every": 0,
    }
    for key, value in {**changes, **settings, **(overrides or {})}.items():
        set_key(tree, key, value)
    return validate(tree)


@torch.no_grad()
def path_kl(trainer: Trainer, base: list[torch.Tensor]) -> float:
    """KL(trained || base) between the path distributions of the run's training sampler with every step stochastic,
    in nats per sample: the mean over the held-out items (fixed noise, trajectories drawn from the trained policy)
    of sum_k gaussian_kl(mu_theta(x_k), mu_base(x_k), s_k, "sum"). ``base``: the base model's trainable tensors."""
    pipeline, sampler, held = trainer.pipeline, trainer.sampler, trainer.modality.held_out
    params = list(pipeline.trainable_parameters())
    gen = held.generator()
    noise = start_noise(pipeline, len(held), gen)
    sigmas = pipeline.schedule.sigmas(trainer.config.rollout.num_inference_steps).to(noise.device)
    guidance = trainer.config.rollout.guidance_scale
    pipeline.denoiser.eval()
    traj = rollout(
        pipeline, sampler, held.prompts, held.metadata, torch.arange(len(held)), sigmas, gen, guidance, initial_noise=noise, decode=False
    )
    total = torch.zeros(len(held), dtype=torch.float64)
    for k in torch.nonzero(traj.stochastic).flatten().tolist():
        x, x_next, sigma, sigma_next = traj.latents[:, k], traj.latents[:, k + 1], sigmas[k], sigmas[k + 1]
        out = sampler.step(pipeline.predict(x, sigma, traj.cond, guidance), x, sigma, sigma_next, x_next=x_next)
        with swapped_weights(params, base):
            base_mean = sampler.step(pipeline.predict(x, sigma, traj.cond, guidance), x, sigma, sigma_next, x_next=x_next).mean
        total += gaussian_kl(out.mean, base_mean, out.std, "sum").double().cpu()
    return float(total.mean())


def point(trainer: Trainer, base: list[torch.Tensor], iteration: int, train_s: float) -> dict[str, float]:
    metrics = trainer.evaluate()
    return {
        "iteration": iteration,
        "train_s": round(train_s, 2),
        "reward": round(metrics["eval/reward/mean"], 4),
        "judge": round(metrics["eval/judge/mean"], 4),
        "diversity": round(metrics["eval/diversity"], 4),
        "kl": round(path_kl(trainer, base), 5),
    }


def run(method: str, epochs: int, seed: int, iterations: int, eval_every: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = method_config(method, epochs, seed, f"{tmp}/{method}", {"train.iterations": iterations, **(overrides or {})})
        trainer = Trainer(config)
        base = [p.detach().clone() for p in trainer.pipeline.trainable_parameters()]
        curve, train_s = [point(trainer, base, 0, 0.0)], 0.0
        for i in range(iterations):
            t0 = time.perf_counter()
            trainer.train_iteration(i)
            train_s += time.perf_counter() - t0
            if (i + 1) % eval_every == 0 or i + 1 == iterations:
                curve.append(point(trainer, base, i + 1, train_s))
    return {"method": method, "epochs": epochs, "seed": seed, "curve": curve}


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in runs))
    epochs = sorted({r["epochs"] for r in runs})
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    styles = dict(zip(epochs, ["-", "--", ":", "-."]))
    markers = dict(zip(epochs, ["o", "s", "^", "D"]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for ax, key, label in zip(axes, ("reward", "judge"), ("held-out reward (ink + classifier)", "held-out judge (digit_realism)")):
        for r in runs:
            xs, ys = [p["kl"] for p in r["curve"]], [p[key] for p in r["curve"]]
            ax.plot(
                xs,
                ys,
                styles[r["epochs"]],
                marker=markers[r["epochs"]],
                ms=4,
                color=colors[r["method"]],
                lw=1.2,
                label=f"{r['method']}, {r['epochs']} epoch(s)",
            )
        ax.set_xlabel("KL(trained || base) of the SDE path, nats per sample")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def parse_arguments() -> tuple[argparse.Namespace, list[str], list[int]]:
    """The command line, and its methods and epoch counts checked (an error names the bad one and exits)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from: " + ", ".join(METHODS))
    p.add_argument("--epochs", default="1,2,4", help="comma-separated train.inner_epochs values")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--quick", action="store_true", help="grpo_clip at 1 epoch, 2 iterations on 3 steps, 2 groups of 4, 1 seed per held-out prompt"
    )
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="train nothing: report the runs of these --json files together")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="reward and judge against KL, PNG")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method '{unknown[0]}'; choose from {', '.join(METHODS)}")
    try:
        epochs = [int(e) for e in a.epochs.split(",") if e.strip()]
    except ValueError:
        p.error(f"--epochs takes comma-separated whole numbers, got '{a.epochs}'")
    if not epochs or min(epochs) < 1:
        p.error(f"--epochs takes whole numbers >= 1, got '{a.epochs}'")
    return a, methods, epochs


def quick_settings(a: argparse.Namespace, methods: list[str], epochs: list[int]) -> tuple[list[str], list[int], dict[str, Any]]:
    """``--quick`` replaces the methods, epochs, iterations and evaluation cadence, and shrinks the run (overrides)."""
    if not a.quick:
        return methods, epochs, {}
    a.iterations, a.eval_every = 2, 1
    overrides = {
        "rollout.num_inference_steps": 3,
        "train.prompts_per_iteration": 2,
        "train.num_generations": 4,
        "train.batch_size": 8,
        "eval.samples_per_prompt": 1,
    }
    return ["grpo_clip"], [1], overrides


def merged_runs(a: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """``--merge``: the runs trained by several processes (e.g. one per epoch count), reported as one; takes the seed,
    iterations and evaluation cadence from them. Returns the runs and the longest process's seconds."""
    shares = [json.loads(path.read_text()) for path in a.merge]
    runs = [r for share in shares for r in share["runs"]]
    a.seed, a.iterations = shares[0]["seed"], shares[0]["iterations"]
    a.eval_every = runs[0]["curve"][1]["iteration"] if len(runs[0]["curve"]) > 1 else a.eval_every
    return runs, max(share["total_s"] for share in shares)


def train_runs(a: argparse.Namespace, methods: list[str], epochs: list[int], overrides: dict[str, Any]) -> list[dict[str, Any]]:
    """Every method at every epoch count, epoch-major (the methods of one epoch count run next to each other); a line
    on stderr as each ends."""
    runs = []
    for e in epochs:
        for m in methods:
            r = run(m, e, a.seed, a.iterations, a.eval_every, overrides)
            runs.append(r)
            end = r["curve"][-1]
            print(
                f"{m:<11} epochs {e}: reward {end['reward']:.4f}  judge {end['judge']:.4f}  KL {end['kl']:.3f}  ({end['train_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return runs


def print_table(a: argparse.Namespace, runs: list[dict[str, Any]], total_s: float) -> None:
    print(f"digits_flow, seed {a.seed}, {a.iterations} iterations, {torch.get_num_threads()} thread(s); total {total_s:.0f} s")
    print(f"{'method':<12}{'epochs':>7}{'iter':>6}{'reward':>9}{'judge':>9}{'KL nats':>10}{'diversity':>11}")
    for r in runs:
        for q in r["curve"]:
            print(
                f"{r['method']:<12}{r['epochs']:>7}{q['iteration']:>6}{q['reward']:>9.4f}{q['judge']:>9.4f}{q['kl']:>10.4f}{q['diversity']:>11.4f}"
            )


def main() -> None:
    a, methods, epochs = parse_arguments()
    methods, epochs, overrides = quick_settings(a, methods, epochs)
    started = time.perf_counter()
    if a.merge:
        runs, total_s = merged_runs(a)
    else:
        runs = train_runs(a, methods, epochs, overrides)
        total_s = time.perf_counter() - started
    print_table(a, runs, total_s)
    if a.plot:
        plot(
            runs,
            a.plot,
            f"digits_flow, seed {a.seed}: held-out reward and judge against KL to the base model, every {a.eval_every} iterations",
        )
    line = json.dumps({"seed": a.seed, "iterations": a.iterations, "total_s": round(total_s, 1), "runs": runs})
    if a.json:
        a.json.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
