"""DiffusionOPD on digits: one student distilled from two task teachers, against GDPO and the weighted sum trained on
both rewards, at equal student samples.

The two tasks (the GDPO bench's pair, bench/gdpo_two_rewards.py): ``ink`` (bolder strokes, easy) and
``one_likeness`` (the classifier's probability of a 1, which bolder ink works against). DiffusionOPD's recipe:

1. stage 1, the teachers (trained once, seed 0, if absent): GRPO's digits preset (configs/digits/grpo.yaml) on ``ink``
   alone -> runs/diffusion_opd_teachers/ink, and on ``one_likeness`` alone -> .../one_likeness, ``--teacher-iterations``
   each (64 samples an iteration);
2. stage 2, the student: configs/digits/diffusion_opd.yaml (even digits' prompts -> the ink teacher, odd -> the
   one-likeness teacher), ``--iterations`` x 64 samples.

Baselines at the student's samples (same iterations x 64, same seed, prompts, evaluation): GRPO's digits preset on
ink + one_likeness (1:1) with ``multi_reward: weighted_sum`` and ``gdpo``. Every run is evaluated on the presets'
held-out setting (80 samples: 20 unseen phrasings x 4 seeds, 10-step ODE): ink, one_likeness, ``task`` (each item's
own task reward: ink for an even digit, one_likeness for an odd one; weight 0: measured, never trained on) and the
judge digit_realism. Writes bench/results/diffusion_opd_digits.json and docs/images/diffusion_opd_digits.png.

    OMP_NUM_THREADS=1 .venv/bin/python bench/diffusion_opd_digits.py --teachers-only          # stage 1 (~2 x 2 min)
    OMP_NUM_THREADS=1 .venv/bin/python bench/diffusion_opd_digits.py --seeds 0 1 2             # teachers if absent + 3 x 3 runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

import flowrl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdpo_two_rewards import one_likeness  # noqa: E402  (the GDPO bench's hard reward, the one task)

REPO = Path(__file__).resolve().parents[1]
TEACHERS = REPO / "runs" / "diffusion_opd_teachers"
PRESET_TEACHER_ITERATIONS = 30  # the preset's teacher checkpoints: runs/diffusion_opd_teachers/<task>/checkpoints/step_000030


def teacher_dir(task: str, iterations: int) -> Path:
    """A teacher's run: the preset's under its task's name, one trained longer or shorter under ``<task>_<iterations>``."""
    return TEACHERS / (task if iterations == PRESET_TEACHER_ITERATIONS else f"{task}_{iterations}")


EVEN = {0, 2, 4, 6, 8}  # the ink teacher's prompts (configs/digits/diffusion_opd.yaml's route)
QUIET = ["log.progress=false", "log.trackers=[]", "train.num_threads=1"]


def task_reward(samples, prompts, metadata):
    """Each item's own task reward: ink for an even digit's prompt, one_likeness for an odd one's."""
    ink = flowrl.reward("ink")(samples, prompts, metadata).scores.to(samples.device).float()
    one = one_likeness(samples, prompts, metadata).float()
    even = torch.tensor([int(m["digit"]) in EVEN for m in metadata], device=samples.device)
    return torch.where(even, ink, one)


def rewards(train_on: dict[str, float]) -> tuple[dict, dict]:
    """The reward components (ink, one_likeness, task) and weights: ``train_on``'s, 0 for the measured-only ones."""
    components = {"ink": flowrl.reward("ink"), "one_likeness": one_likeness, "task": task_reward}
    return components, {k: train_on.get(k, 0.0) for k in components}


def train(preset: str, out: Path, overrides: list[str], train_on: dict[str, float]) -> dict:
    """Train ``preset`` into ``out`` (a completed run there is read, not retrained); its held-out curve and wall time."""
    summary = out / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("status") == "completed":
        wall = json.loads((out / "bench_wall.json").read_text())["wall_s"] if (out / "bench_wall.json").exists() else None
    else:
        components, weights = rewards(train_on)
        trainer = flowrl.Trainer(
            preset, [f"output_dir={out}", "overwrite=true", *QUIET, *overrides], reward=components, reward_weights=weights
        )
        start = time.perf_counter()
        trainer.train()
        wall = round(time.perf_counter() - start, 1)
        (out / "bench_wall.json").write_text(json.dumps({"wall_s": wall}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r for r in rows if "eval/reward/task" in r}
    return {"curve": curve, "wall_s": wall}


def teachers(iterations: int) -> dict:
    """Stage 1: one GRPO teacher per task reward, seed 0 (kept in runs/diffusion_opd_teachers)."""
    common = ["seed=0", f"train.iterations={iterations}", f"eval.every={iterations}", f"log.checkpoint_every={iterations}"]
    return {
        "ink": train("digits/grpo", teacher_dir("ink", iterations), common, {"ink": 1.0}),
        "one_likeness": train("digits/grpo", teacher_dir("one_likeness", iterations), common, {"one_likeness": 1.0}),
    }


def routed_teachers(teacher_iterations: int, out: Path) -> dict:
    """The teachers as the router uses them (the student's ceiling if it matched each teacher on its own prompts): each
    teacher's held-out ``task`` reward on its own items (ink teacher: even digits, one-likeness teacher: odd), summed as
    shares of the 80 items, so it reads on the students' ``task`` scale."""
    from flowrl.training.checkpoint import read_weights

    def share(parity: int):
        def reward(samples, prompts, metadata):
            mine = torch.tensor([int(m["digit"]) % 2 == parity for m in metadata], device=samples.device)
            return torch.where(mine, task_reward(samples, prompts, metadata), torch.zeros(len(samples), device=samples.device))

        return reward

    total = {}
    for name, parity in (("ink", 0), ("one_likeness", 1)):
        trainer = flowrl.Trainer(
            "digits/grpo", [f"output_dir={out / 'routed' / name}", "overwrite=true", *QUIET], reward={"share": share(parity)}
        )
        trainer.load_weights(read_weights(teacher_dir(name, teacher_iterations) / "checkpoints" / f"step_{teacher_iterations:06d}"))
        metrics = trainer.evaluate()
        total[name] = round(float(metrics["eval/reward/share"]), 4)
    return {"task": round(sum(total.values()), 4), "shares": total}


def student_and_baselines(seed: int, iterations: int, every: int, teacher_iterations: int, student: list[str], out: Path) -> dict:
    common = [f"seed={seed}", f"train.iterations={iterations}", f"eval.every={every}", "log.checkpoint_every=0"]
    ckpt = f"checkpoints/step_{teacher_iterations:06d}"
    teachers_override = (
        f"objective.teachers=[{{name: ink, checkpoint: {teacher_dir('ink', teacher_iterations) / ckpt}, route: [0, 2, 4, 6, 8]}}, "
        f"{{name: one, checkpoint: {teacher_dir('one_likeness', teacher_iterations) / ckpt}, route: [1, 3, 5, 7, 9]}}]"
    )
    opd = [*common, teachers_override, *student]
    both = {"ink": 1.0, "one_likeness": 1.0}
    return {
        "diffusion_opd": train("digits/diffusion_opd", out / f"seed{seed}" / opd_dir(student, teacher_iterations), opd, {}),
        "weighted_sum": train("digits/grpo", out / f"seed{seed}" / "weighted_sum", [*common, "objective.multi_reward=weighted_sum"], both),
        "gdpo": train("digits/grpo", out / f"seed{seed}" / "gdpo", [*common, "objective.multi_reward=gdpo"], both),
    }


def gdpo_at_total_samples(seed: int, iterations: int, every: int, out: Path) -> dict:
    """GDPO given every sample the student's recipe used: the student's and both teachers' iterations."""
    common = [f"seed={seed}", f"train.iterations={iterations}", f"eval.every={every}", "log.checkpoint_every=0"]
    run = train(
        "digits/grpo",
        out / f"seed{seed}" / f"gdpo_{iterations}",
        [*common, "objective.multi_reward=gdpo"],
        {"ink": 1.0, "one_likeness": 1.0},
    )
    return {
        "iterations": iterations,
        "final": final(run),
        "best_task": max(round(float(r[KEYS["task"]]), 4) for r in run["curve"].values()),
    }


def opd_dir(student: list[str], teacher_iterations: int) -> str:
    """The student run's directory: ``diffusion_opd`` for the preset's settings, else named by its overrides and its
    teachers' iterations."""
    parts = [o.split("=")[0].split(".")[-1] + o.split("=", 1)[1] for o in student]
    if teacher_iterations != PRESET_TEACHER_ITERATIONS:
        parts.append(f"teachers{teacher_iterations}")
    return "_".join(["diffusion_opd", *parts])


def lr_search(out: Path, seed: int) -> dict:
    """The student's search: every completed student run of ``seed`` in ``out`` (the preset's settings are
    ``diffusion_opd``), its learning rate and schedule, and its held-out numbers at each evaluation."""
    found = {}
    for run in sorted((out / f"seed{seed}").glob("diffusion_opd*")):
        summary = run / "summary.json"
        if summary.exists() and json.loads(summary.read_text()).get("status") == "completed":
            tc = yaml.safe_load((run / "config.yaml").read_text())["train"]
            curve = train("digits/diffusion_opd", run, [], {})["curve"]
            found[run.name] = {
                "learning_rate": tc["learning_rate"],
                "lr_schedule": tc["lr_schedule"],
                "held_out": {str(step): {k: round(float(row[v]), 4) for k, v in KEYS.items()} for step, row in sorted(curve.items())},
            }
    return found


KEYS = {"task": "eval/reward/task", "ink": "eval/reward/ink", "one_likeness": "eval/reward/one_likeness", "judge": "eval/judge/mean"}


def final(run: dict) -> dict:
    last = run["curve"][max(run["curve"])]
    return {k: round(float(last[v]), 4) for k, v in KEYS.items()}


def plot(results: dict, teacher_rows: dict, routed: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(14, 3.3))
    for ax, key in zip(axes, KEYS):
        for method, color in (("diffusion_opd", "C0"), ("weighted_sum", "C1"), ("gdpo", "C2")):
            for j, runs in enumerate(results.values()):
                curve = runs[method]["curve"]
                steps = sorted(curve)
                ax.plot(steps, [curve[s][KEYS[key]] for s in steps], color=color, alpha=0.8, label=method if j == 0 else None)
        for name, style in (("ink", ":"), ("one_likeness", "--")):
            ax.axhline(teacher_rows[name][key], color="grey", linestyle=style, label=f"teacher {name}")
        if key == "task":
            ax.axhline(routed["task"], color="black", linestyle="-.", label="teachers, routed")
        ax.set_title(key)
        ax.set_xlabel("student iteration (64 samples)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("DiffusionOPD (2 task teachers -> 1 student) vs GRPO on both rewards (weighted sum, GDPO), digits, held-out", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--iterations", type=int, default=30, help="student and baseline iterations (64 samples each)")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--teacher-iterations", type=int, default=30)
    p.add_argument("--student", nargs="*", default=[], help="overrides of the student's run (the search), e.g. train.learning_rate=1e-3")
    p.add_argument("--teachers-only", action="store_true", help="stage 1 alone")
    p.add_argument("--total-samples", action="store_true", help="also GDPO at the whole recipe's samples (student + teachers), seed 0")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "diffusion_opd_bench")
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "diffusion_opd_digits.json")
    p.add_argument("--png", type=Path, default=REPO / "docs" / "images" / "diffusion_opd_digits.png")
    args = p.parse_args()
    torch.set_num_threads(1)
    stage1 = teachers(args.teacher_iterations)
    teacher_rows = {name: final(run) for name, run in stage1.items()}
    for name, row in teacher_rows.items():
        print(f"teacher {name:14s} {row}  wall {stage1[name]['wall_s']} s")
    if args.teachers_only:
        return
    routed = routed_teachers(args.teacher_iterations, args.out)
    print(f"teachers routed by prompt (the student's ceiling), held-out task reward {routed}")
    results = {
        seed: student_and_baselines(seed, args.iterations, args.every, args.teacher_iterations, args.student, args.out)
        for seed in args.seeds
    }
    methods = ("diffusion_opd", "weighted_sum", "gdpo")
    start = {k: round(float(next(iter(results.values()))["gdpo"]["curve"][0][v]), 4) for k, v in KEYS.items()}
    table = {m: {str(s): final(results[s][m]) for s in args.seeds} for m in methods}
    means = {m: {k: round(statistics.mean(table[m][str(s)][k] for s in args.seeds), 4) for k in KEYS} for m in methods}
    print(f"held-out at iteration {args.iterations} (start {start}); seeds {args.seeds}")
    for m in methods:
        walls = [results[s][m]["wall_s"] for s in args.seeds]
        print(f"  {m:14s} mean {means[m]}  per seed {table[m]}  wall {walls}")
    for k in ("task", "ink", "one_likeness"):
        print(
            f"  {k}: gain over start, OPD / weighted sum {(means['diffusion_opd'][k] - start[k]) / max(means['weighted_sum'][k] - start[k], 1e-9):.2f}x, "
            f"OPD / GDPO {(means['diffusion_opd'][k] - start[k]) / max(means['gdpo'][k] - start[k], 1e-9):.2f}x"
        )
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "command": f"OMP_NUM_THREADS=1 .venv/bin/python bench/diffusion_opd_digits.py --seeds {' '.join(map(str, args.seeds))}"
        + (f" --student {' '.join(args.student)}" if args.student else "")
        + (" --total-samples" if args.total_samples else "")
        + (f" --teacher-iterations {args.teacher_iterations}" if args.teacher_iterations != PRESET_TEACHER_ITERATIONS else ""),
        "samples_per_iteration": 64,
        "student_iterations": args.iterations,
        "teacher_iterations": args.teacher_iterations,
        "start": start,
        "teachers": {n: {**teacher_rows[n], "wall_s": stage1[n]["wall_s"]} for n in stage1},
        "routed_teachers": routed,
        "student_lr_search_seed0": lr_search(args.out, 0),
        "gdpo_at_total_samples_seed0": gdpo_at_total_samples(0, args.iterations + 2 * args.teacher_iterations, args.every, args.out)
        if args.total_samples
        else None,
        "final_per_seed": table,
        "final_mean": means,
        "wall_s": {m: [results[s][m]["wall_s"] for s in args.seeds] for m in methods},
        "curves": {
            m: {
                str(s): {str(step): {k: row[v] for k, v in KEYS.items()} for step, row in results[s][m]["curve"].items()}
                for s in args.seeds
            }
            for m in methods
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2) + "\n")
    plot(results, teacher_rows, routed, args.png)
    print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
