"""Time and denoiser work to reach a held-out reward: full-trajectory Flow-GRPO against its faster variants.

Every method is a preset derived in code from configs/digits/grpo.yaml (or diffusion_nft.yaml) on the embedded
digits flow model with the README's reward (ink + digit_classifier), trained through the real ``Trainer``:

    full_sde        Flow-GRPO SDE (g = a sqrt(sigma / (1 - sigma)), a = 0.7), all 10 steps stochastic and trained (baseline)
    dance_grpo      DanceGRPO SDE (g = eta = 0.7, constant), all steps stochastic, a random 60% of them trained
    cps             coefficient-preserving sampling (std = sigma_next sin(0.7 pi / 2)), every stochastic step trained
    mixgrpo_window  MixGRPO: a 3-step SDE window (ODE elsewhere) sliding one step later every 4 iterations
    fast_window     Flow-GRPO-Fast style: steps 0-1 stochastic and trained, the rest ODE
    tempflow        full_sde with TempFlow-GRPO's noise-level step credit (objective.step_weighting=noise_level)
    diffusion_nft   configs/digits/diffusion_nft.yaml (ODE rollouts, flow matching on the clean samples)
    flow_dppo       configs/digits/flow_dppo.yaml (Flow-GRPO's SDE, no ratio clip, the exact-KL trust region)
    flow_dppo_window  flow_dppo with fast_window's 2-step SDE window, both steps trained
    awm             configs/digits/awm.yaml (Advantage Weighted Matching: ODE rollouts, advantage-weighted flow matching)
    dgpo            configs/digits/dgpo.yaml (DGPO: ODE rollouts, group-level DPO on the flow-matching loss)
    fast_window_lr1e-3, flow_dppo_window_lr1e-3   the two windows at learning rate 1e-3 (the presets: 3e-4)
    fast_window_5steps  fast_window with 5-step rollouts (steps 0-1 of 5 stochastic); the evaluation keeps 10 steps
    flash_grpo      configs/digits/flash_grpo.yaml (Flash-GRPO: one SDE step per trajectory, shared by a prompt group)
    tree_grpo       configs/digits/tree_grpo.yaml (TreeGRPO: 8 leaves per prompt as one tree, branching at steps 0, 3, 6)
    stepwise_grpo   configs/digits/stepwise_grpo.yaml (dense credit: each step's x0-estimate reward gain)
    flash_grpo_5steps, tree_grpo_5steps, stepwise_grpo_window_3steps_lr5e-4, ...   combinations (few-step rollouts,
                    an SDE window, the learning rate, TreeGRPO's edge advantage); METHODS below lists each one's changes

Each run evaluates the held-out set (20 unseen prompt phrasings x ``--eval-samples`` fixed seeds, 10-step ODE,
``Trainer.evaluate``, with the judge ``digit_realism``: never trained on, reported at the target so that a method that
reaches it by hacking the reward shows it) every ``--eval-every`` iterations and stops at the first evaluation whose reward
is >= ``--target`` (or after ``--max-iterations``). Time to target = the summed wall time of
``Trainer.train_iteration`` (rollout + reward + advantages + update) up to that evaluation; evaluations are not
counted. Denoiser work is counted with hooks on the denoiser module: forward calls and rows (samples through the
network) in the rollout, the update and the evaluation, and backward rows (a hook on the output's gradient).
Runs are interleaved seed-major (for seed: for method), so drifting load on a shared machine falls on all alike.

    python bench/time_to_reward.py [--seeds 3] [--target 1.45] [--threads 1] [--json OUT] [--plot PNG]
    python bench/time_to_reward.py --quick        # tiny: 1 seed, 2 methods, 2 iterations (the test's)
    # split over processes, one seed each, then reported together:
    python bench/time_to_reward.py --seed-list 1 --runs-out runs1.json ...; python bench/time_to_reward.py --merge runs*.json

Prints a table; the last line is one JSON object with ``speedup_vs_full_sde`` (the baseline's median time to
target / the fastest method's, among methods that reached the target in every seed), ``work_speedup_vs_full_sde``
(the baseline's median counted work to target, forward rows + 2 x backward rows in the rollout and the update, / the
least-work method's, among methods that reached the target in every seed with a median judge at the target no worse
than the baseline's) and every method's numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import read_yaml_mapping, validate  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402

BASELINE = "full_sde"
# method -> (preset in configs/digits, changes to its tree as {dotted key: value}; a value None deletes the key)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "full_sde": ("grpo.yaml", {"objective.timestep_fraction": 1.0}),
    "dance_grpo": ("grpo.yaml", {"sampler.diffusion": "dance_grpo", "sampler.noise_level": 0.7}),
    "cps": (
        "grpo.yaml",
        {"sampler.name": "flow_cps", "sampler.diffusion": None, "sampler.noise_level": 0.7, "objective.timestep_fraction": 1.0},
    ),
    "mixgrpo_window": (
        "grpo.yaml",
        {"rollout.sde_window_size": 3, "rollout.sde_window_slide_every": 4, "objective.timestep_fraction": 1.0},
    ),
    "fast_window": ("grpo.yaml", {"rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0}),
    "tempflow": ("grpo.yaml", {"objective.timestep_fraction": 1.0, "objective.step_weighting": "noise_level"}),
    "diffusion_nft": ("diffusion_nft.yaml", {}),
    "flow_dppo": ("flow_dppo.yaml", {}),
    "flow_dppo_window": ("flow_dppo.yaml", {"rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0}),
    "awm": ("awm.yaml", {}),
    "dgpo": ("dgpo.yaml", {}),
    # the search's fastest settings (bench/RESULTS.md): the same methods at learning rate 1e-3 instead of 3e-4
    "fast_window_lr1e-3": ("grpo.yaml", {"rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0, "train.learning_rate": 1e-3}),
    # fast_window on 5-step rollouts (the held-out evaluation keeps 10 steps): half the rollout's forwards
    "fast_window_5steps": (
        "grpo.yaml",
        {"rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0, "rollout.num_inference_steps": 5},
    ),
    # the control for stepwise_grpo_window_3steps_lr5e-4: the same rollouts, update and learning rate, GRPO's credit
    "fast_window_3steps_lr5e-4": (
        "grpo.yaml",
        {"rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0, "rollout.num_inference_steps": 3, "train.learning_rate": 5e-4},
    ),
    "flow_dppo_window_lr1e-3": (
        "flow_dppo.yaml",
        {"rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0, "train.learning_rate": 1e-3},
    ),
    # #40's step-credit objectives (their presets), and the combinations searched (bench/RESULTS.md lists them all)
    "flash_grpo": ("flash_grpo.yaml", {}),
    "tree_grpo": ("tree_grpo.yaml", {}),
    "stepwise_grpo": ("stepwise_grpo.yaml", {}),
    # Flash-GRPO on 5-step rollouts: the step drawn from steps 0-1 (step_fraction 0.5 of 5 -> the first 2)
    "flash_grpo_5steps": ("flash_grpo.yaml", {"rollout.num_inference_steps": 5}),
    # TreeGRPO on 5-step rollouts, branching at steps 0, 1, 2: a tree costs 1 + 2 + 4 + 8 + 8 = 23 rows (8 x 5 = 40)
    "tree_grpo_5steps": ("tree_grpo.yaml", {"rollout.num_inference_steps": 5, "objective.branch_steps": [0, 1, 2]}),
    # TreeGRPO with the parent-relative edge advantage (objective.edge_advantage: minus_parent; the preset: subtree_mean)
    "tree_grpo_minus_parent": ("tree_grpo.yaml", {"objective.edge_advantage": "minus_parent"}),
    "tree_grpo_5steps_minus_parent": (
        "tree_grpo.yaml",
        {"rollout.num_inference_steps": 5, "objective.branch_steps": [0, 1, 2], "objective.edge_advantage": "minus_parent"},
    ),
    # stepwise credit on fast_window_5steps' rollouts: steps 0-1 of 5 stochastic and trained
    "stepwise_grpo_window_5steps": (
        "stepwise_grpo.yaml",
        {"rollout.num_inference_steps": 5, "rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0},
    ),
    # stepwise credit on 3-step rollouts, steps 0-1 of 3 stochastic and trained, learning rate 5e-4
    "stepwise_grpo_window_3steps_lr5e-4": (
        "stepwise_grpo.yaml",
        {"rollout.num_inference_steps": 3, "rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0, "train.learning_rate": 5e-4},
    ),
    # the same at learning rate 1e-3 (the preset: 3e-4)
    "stepwise_grpo_window_5steps_lr1e-3": (
        "stepwise_grpo.yaml",
        {"rollout.num_inference_steps": 5, "rollout.sde_window_size": 2, "objective.timestep_fraction": 1.0, "train.learning_rate": 1e-3},
    ),
}


def set_key(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    if value is None:
        tree.pop(last, None)
    else:
        tree[last] = value


def method_config(method: str, seed: int, output_dir: str, overrides: dict[str, Any] | None = None):
    """The method's validated config: its preset's tree, the method's changes, the bench's settings, ``overrides``."""
    preset, changes = METHODS[method]
    tree = read_yaml_mapping(REPO / "configs" / "digits" / preset, "config file")
    settings = {
        # the held-out evaluation keeps the preset's 10 steps when a method's rollout takes fewer
        "eval.num_inference_steps": tree["rollout"]["num_inference_steps"],
        "seed": seed,
        "output_dir": output_dir,
        # the held-out judge (never trained on): a method that reaches the target by hacking the reward shows it
        "eval.judge": {"components": {"digit_realism": 1.0}},
        "log.progress": False,
        "log.trackers": [],
        "log.grid_prompts": 1000,
    }
    for key, value in {**changes, **settings, **(overrides or {})}.items():
        set_key(tree, key, value)
    return validate(tree)


def _first_tensor(out: Any) -> torch.Tensor:
    """The denoiser's output tensor (diffusers models return a dataclass with ``sample``)."""
    if torch.is_tensor(out):
        return out
    return out.sample if hasattr(out, "sample") else out[0]


class DenoiserWork:
    """Counts what the denoiser module does, per phase (rollout / train / eval): forward calls, forward rows
    (samples through the network) and backward rows (gradients reaching the module's output)."""

    PHASES = ("rollout", "train", "eval")

    def __init__(self, module: torch.nn.Module):
        self.phase = "rollout"
        self.counts = {f"{p}_{what}": 0 for p in self.PHASES for what in ("forward_calls", "forwards", "backwards")}
        self._handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module, args, out) -> None:
        y = _first_tensor(out)
        self.counts[f"{self.phase}_forward_calls"] += 1
        self.counts[f"{self.phase}_forwards"] += y.shape[0]
        if y.requires_grad:
            phase = self.phase
            y.register_hook(lambda grad: self._on_backward(phase, grad))

    def _on_backward(self, phase: str, grad: torch.Tensor) -> None:
        self.counts[f"{phase}_backwards"] += grad.shape[0]

    def during(self, phase: str, fn):
        """``fn`` with its denoiser calls counted under ``phase``."""

        def wrapped(*args, **kwargs):
            previous, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = previous

        return wrapped

    def training_work(self) -> dict[str, int]:
        return {k: v for k, v in self.counts.items() if not k.startswith("eval")}

    def close(self) -> None:
        self._handle.remove()


def held_out(trainer: Trainer) -> dict[str, float]:
    """The held-out reward and its two parts (so a reward reached by ink alone, the digit lost, shows)."""
    metrics = trainer.evaluate()
    return {
        "reward": metrics["eval/reward/mean"],
        "ink": metrics["eval/reward/ink"],
        "classifier": metrics["eval/reward/digit_classifier"],
        "judge": metrics["eval/judge/mean"],
        "diversity": metrics["eval/diversity"],
    }


def run_method(
    method: str, seed: int, target: float, max_iterations: int, eval_every: int, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Train one method until its held-out reward reaches ``target`` (checked every ``eval_every`` iterations) or
    ``max_iterations``; returns the curve (training seconds, counted work, held-out reward at every evaluation)
    and the first point at or above the target (None if never)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = method_config(method, seed, f"{tmp}/{method}", {"train.iterations": max_iterations, **(overrides or {})})
        trainer = Trainer(config)
        work = DenoiserWork(trainer.module)
        trainer.loop.collect = work.during("rollout", trainer.loop.collect)  # the loop's own methods, counted
        trainer.loop.update = work.during("train", trainer.loop.update)
        evaluate = work.during("eval", lambda: held_out(trainer))
        curve = [{"iteration": 0, "train_s": 0.0, **evaluate(), **work.training_work()}]
        train_s, reached = 0.0, None
        for i in range(max_iterations):
            t0 = time.perf_counter()
            trainer.train_iteration(i)
            train_s += time.perf_counter() - t0
            if (i + 1) % eval_every == 0 or i + 1 == max_iterations:
                curve.append({"iteration": i + 1, "train_s": train_s, **evaluate(), **work.training_work()})
                if curve[-1]["reward"] >= target:
                    reached = curve[-1]
                    break
        work.close()
    return {
        "method": method,
        "seed": seed,
        "reached": reached,
        "curve": curve,
        "eval_work": {k: v for k, v in work.counts.items() if k.startswith("eval")},
    }


def work_rows(point: dict[str, Any]) -> int:
    """Counted denoiser work up to a point of a curve: forward rows (rollout and update) + 2 x backward rows (a
    backward costs about two forwards)."""
    return point["rollout_forwards"] + point["train_forwards"] + 2 * point["train_backwards"]


def summarise(runs: list[dict[str, Any]], methods: list[str], seeds: list[int]) -> dict[str, Any]:
    """Per method: medians over seeds of time, forwards and backwards to target (None unless every seed reached it),
    the per-seed values, and the final reward of each run."""
    out = {}
    for m in methods:
        mine = [r for r in runs if r["method"] == m]
        hit = [r["reached"] for r in mine]
        per_seed = {
            str(r["seed"]): None
            if r["reached"] is None
            else {
                "train_s": round(r["reached"]["train_s"], 3),
                "iterations": r["reached"]["iteration"],
                "reward": round(r["reached"]["reward"], 4),
                "ink": round(r["reached"]["ink"], 4),
                "classifier": round(r["reached"]["classifier"], 4),
                "judge": round(r["reached"]["judge"], 4),
                "forwards": r["reached"]["rollout_forwards"] + r["reached"]["train_forwards"],
                "work": work_rows(r["reached"]),
                "rollout_forwards": r["reached"]["rollout_forwards"],
                "train_forwards": r["reached"]["train_forwards"],
                "backwards": r["reached"]["train_backwards"],
            }
            for r in mine
        }
        all_hit = all(h is not None for h in hit) and len(hit) == len(seeds)
        med = (lambda key, per_seed=per_seed: statistics.median(per_seed[str(s)][key] for s in seeds)) if all_hit else (lambda key: None)
        out[m] = {
            "reached_in_all_seeds": all_hit,
            "seeds_reached": sum(h is not None for h in hit),
            "median_train_s": med("train_s"),
            "median_iterations": med("iterations"),
            "median_forwards": med("forwards"),
            "median_rollout_forwards": med("rollout_forwards"),
            "median_train_forwards": med("train_forwards"),
            "median_backwards": med("backwards"),
            "median_work": med("work"),
            "median_reached_reward": med("reward"),
            "median_reached_ink": med("ink"),
            "median_reached_classifier": med("classifier"),
            "median_reached_judge": med("judge"),
            "start_judge": round(statistics.median(r["curve"][0]["judge"] for r in mine), 4),
            "median_final_reward": round(statistics.median(r["curve"][-1]["reward"] for r in mine), 4),
            "per_seed": per_seed,
        }
    return out


def speedup(summary: dict[str, Any]) -> tuple[float | None, str | None]:
    """Baseline median time / the fastest median time among methods that reached the target in every seed."""
    base = summary.get(BASELINE, {}).get("median_train_s")
    reached = {m: s["median_train_s"] for m, s in summary.items() if s["median_train_s"] is not None}
    if base is None or not reached:
        return None, None
    best = min(reached, key=reached.get)
    return round(base / reached[best], 3), best


def work_speedup(summary: dict[str, Any]) -> tuple[float | None, str | None]:
    """Baseline median counted work to target / the least median work among methods that reached the target in every
    seed with a median judge at the target no worse than the baseline's (the baseline itself qualifies: 1.0)."""
    base = summary.get(BASELINE, {})
    if base.get("median_work") is None:
        return None, None
    eligible = {
        m: s["median_work"]
        for m, s in summary.items()
        if s["median_work"] is not None
        and s["median_reached_judge"] is not None
        and s["median_reached_judge"] >= base["median_reached_judge"]
    }
    best = min(eligible, key=eligible.get)
    return round(base["median_work"] / eligible[best], 3), best


def plot(runs: list[dict[str, Any]], methods: list[str], target: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # two x axes: wall time, and the counted denoiser work (forward rows + 2 x backward rows, a backward costing
    # about two forwards), which the machine's load does not move; both logarithmic (the methods span 20x and more),
    # so each curve starts at its first trained iteration
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), dpi=100)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {m: (palette[i % len(palette)], "-" if i < len(palette) else "--") for i, m in enumerate(methods)}
    work = work_rows
    for ax, x_of, xlabel in (
        (axes[0], lambda p: p["train_s"], "training wall time, s (evaluations excluded)"),
        (axes[1], work, "denoiser rows: forward + 2 x backward (rollout and update)"),
    ):
        for r in runs:
            points = [p for p in r["curve"] if p["iteration"] > 0]
            xs, ys = [x_of(p) for p in points], [p["reward"] for p in points]
            first = r["seed"] == min(x["seed"] for x in runs if x["method"] == r["method"])
            color, ls = styles[r["method"]]
            ax.plot(xs, ys, ls, color=color, alpha=0.8, lw=1.2, label=r["method"] if first else None)
        ax.axhline(target, color="k", ls=":", lw=0.8, label=f"target {target:g}")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel + " (log)")
        ax.set_ylabel("held-out reward")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def train_runs(
    methods: list[str],
    seeds: list[int],
    target: float,
    max_iterations: int,
    eval_every: int,
    overrides: dict[str, Any],
    runs_out: Path | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Every (seed, method) run, seed-major (every method sees the same stretch of machine load); and the wall time.
    ``runs_out`` is rewritten after every run, so a stopped process leaves the runs it finished."""
    runs = []
    started = time.perf_counter()
    for seed in seeds:
        for m in methods:
            r = run_method(m, seed, target, max_iterations, eval_every, overrides)
            runs.append(r)
            if runs_out is not None:
                total_s = round(time.perf_counter() - started, 1)
                runs_out.write_text(json.dumps({"target": target, "total_s": total_s, "runs": runs}) + "\n")
            last = r["reached"] or r["curve"][-1]
            print(
                f"seed {seed} {m:<35} {'reached' if r['reached'] else 'missed '} at it {last['iteration']:>3}  "
                f"{last['train_s']:7.1f} s  reward {last['reward']:.4f}  judge {last['judge']:.4f} (start {r['curve'][0]['judge']:.4f})",
                file=sys.stderr,
                flush=True,
            )
    return runs, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from: " + ", ".join(METHODS))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--target", type=float, default=1.45, help="held-out reward to reach")
    p.add_argument("--max-iterations", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-samples", type=int, default=4, help="fixed seeds per held-out prompt (20 prompts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="1 seed, full_sde and fast_window, 2 iterations on 3 steps, 8 samples, target 0")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a config key of every method's run (YAML value), e.g. --set train.learning_rate=1e-3; repeatable",
    )
    p.add_argument("--seed-list", default=None, help="comma-separated seeds to run instead of 0 .. --seeds - 1 (one share of a split run)")
    p.add_argument("--runs-out", type=Path, default=None, help="write every run (its whole curve) to this JSON, for --merge")
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="train nothing: report the runs of these --runs-out files together")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="reward-vs-time PNG")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method '{unknown[0]}'; choose from {', '.join(METHODS)}")
    overrides: dict[str, Any] = {"eval.samples_per_prompt": a.eval_samples}
    for item in a.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            p.error(f"--set takes KEY=VALUE, got '{item}'")
        overrides[key.strip()] = yaml.safe_load(value)
    if a.quick:
        # target 0: every run "reaches" it at its first evaluation, so the speedup path runs too
        methods, a.seeds, a.max_iterations, a.eval_every, a.target = [BASELINE, "fast_window"], 1, 2, 1, 0.0
        overrides.update(
            {
                "rollout.num_inference_steps": 3,
                "eval.num_inference_steps": 3,
                "train.prompts_per_iteration": 2,
                "train.num_generations": 4,
                "train.batch_size": 8,
                "eval.samples_per_prompt": 1,
            }
        )
    seeds = [int(x) for x in a.seed_list.split(",")] if a.seed_list else list(range(a.seeds))
    if a.merge:  # runs trained by several processes (each a --seed-list share), reported as one
        shares = [json.loads(path.read_text()) for path in a.merge]
        runs = [r for share in shares for r in share["runs"]]
        methods = list(dict.fromkeys(r["method"] for r in runs))
        seeds = sorted({r["seed"] for r in runs})
        a.target, total_s = shares[0]["target"], max(share["total_s"] for share in shares)
    else:
        runs, total_s = train_runs(methods, seeds, a.target, a.max_iterations, a.eval_every, overrides, a.runs_out)
    summary = summarise(runs, methods, seeds)
    ratio, best = speedup(summary)
    work_ratio, work_best = work_speedup(summary)
    print(
        f"digits_flow, target held-out reward {a.target:g} (20 prompts x {overrides['eval.samples_per_prompt']} seeds, ODE); "
        f"{torch.get_num_threads()} thread(s); median of {len(seeds)} seed(s); training time only; total {total_s:.0f} s"
        + (f" (the longest of {len(a.merge)} processes)" if a.merge else "")
    )
    print(
        f"{'method':<36}{'reached':>8}{'time s':>9}{'iters':>7}{'fwd rows':>10}{'bwd rows':>10}{'work':>10}{'judge@tgt':>11}{'final rew':>11}"
    )
    for m, s in summary.items():
        fmt = lambda v, w, f: f"{'-':>{w}}" if v is None else format(v, f"{w}{f}")  # noqa: E731
        print(
            f"{m:<36}{s['seeds_reached']:>6}/{len(seeds)}{fmt(s['median_train_s'], 9, '.1f')}{fmt(s['median_iterations'], 7, '.0f')}"
            f"{fmt(s['median_forwards'], 10, '.0f')}{fmt(s['median_backwards'], 10, '.0f')}{fmt(s['median_work'], 10, '.0f')}"
            f"{fmt(s['median_reached_judge'], 11, '.4f')}"
            f"{s['median_final_reward']:>11.4f}"
        )
    print(
        f"speedup_vs_full_sde (wall time) {ratio} ({best}); work_speedup_vs_full_sde (forward + 2 x backward rows, judge no worse) "
        f"{work_ratio} ({work_best})"
    )
    if a.plot:
        plot(
            runs,
            methods,
            a.target,
            a.plot,
            f"digits_flow, held-out reward vs training time and counted denoiser work, {len(seeds)} seed(s), {torch.get_num_threads()} thread(s)",
        )
    result = {
        "speedup_vs_full_sde": ratio,
        "best_method": best,
        "work_speedup_vs_full_sde": work_ratio,
        "best_work_method": work_best,
        "target": a.target,
        "seeds": len(seeds),
        "threads": torch.get_num_threads(),
        "total_s": round(total_s, 1),
        "methods": summary,
        "curves": {f"{r['method']}/{r['seed']}": [[round(p["train_s"], 2), round(p["reward"], 4)] for p in r["curve"]] for r in runs},
    }
    line = json.dumps(result)
    if a.json:
        a.json.write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
