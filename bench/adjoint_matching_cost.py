"""Cost of Adjoint Matching on the embedded digits model, measured in one run.

time:   one Adjoint Matching iteration (configs/digits/adjoint_matching.yaml) against one GRPO iteration
        (configs/digits/grpo.yaml) at equal samples (64) and denoising steps (10): ``Trainer.train_iteration``
        of the two trainers alternately, in one process, after a warm-up iteration each; median of the
        repetitions, per phase (rollout / score / update). Adjoint Matching's update is one lean-adjoint pass
        (one base forward + one vector-Jacobian product per step, per minibatch) plus its trained steps
        (4, stratified); GRPO's is a forward + backward on 60% of the steps (6). A second row gives Adjoint
        Matching 6 trained steps too. The ratio line is ``am_over_grpo_ratio=<AM / GRPO>``.
memory: for K denoising steps (10, 20, 40), each in a fresh process (one thread): one Adjoint Matching
        iteration's rollout and reward gradients, then its update (adjoint pass, trained steps, backward,
        optimizer step). The number is how far the process's peak resident memory rose during the update
        above its resident memory just before it (Linux: the peak is reset through /proc/self/clear_refs),
        next to the stored trajectory's size (states (B, K+1, 1, 8, 8), log-probs, reward gradients).
        Measured twice: with glibc's default malloc, whose heap keeps freed blocks resident and fragments
        with the number of allocate / free cycles, and with MALLOC_MMAP_THRESHOLD_=65536, under which every
        block over 64 KiB (every activation here) is its own mapping, returned when freed, so the resident
        peak follows the live tensors.

    python bench/adjoint_matching_cost.py [--reps 5] [--threads 2] [--steps 10 20 40] [--samples 64] [--skip-time] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import load_config  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402

PHASES = ("total", "rollout", "score", "update")


def trainer(preset: str, tmp: str, overrides: list[str]) -> Trainer:
    return Trainer(
        load_config(REPO / "configs" / "digits" / preset, [f"output_dir={tmp}/{preset}-{len(overrides)}", "log.progress=false", *overrides])
    )


def timed_iteration(t: Trainer, iteration: int) -> tuple[float, ...]:
    t0 = time.perf_counter()
    m = t.train_iteration(iteration)
    return time.perf_counter() - t0, m["perf/rollout_s"], m["perf/score_s"], m["perf/update_s"]


def time_ratio(reps: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    settings = {"AM, 4 trained steps (preset)": [], "AM, 6 trained steps": ["objective.num_trained_steps=6"]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        grpo = trainer("grpo.yaml", tmp, [])
        ams = {name: trainer("adjoint_matching.yaml", tmp, extra) for name, extra in settings.items()}
        timed_iteration(grpo, 0)
        for am in ams.values():
            timed_iteration(am, 0)  # warm-up (lazy loads, allocator)
        runs: dict[str, list] = {"GRPO": [], **{name: [] for name in ams}}
        for rep in range(reps):
            runs["GRPO"].append(timed_iteration(grpo, rep + 1))
            for name, am in ams.items():
                runs[name].append(timed_iteration(am, rep + 1))
    med = {name: [statistics.median(r[i] for r in rs) for i in range(len(PHASES))] for name, rs in runs.items()}
    for name in ams:
        rows.append(
            {
                "setting": name,
                **{f"{p}_s": round(med[name][i], 3) for i, p in enumerate(PHASES)},
                **{f"grpo_{p}_s": round(med["GRPO"][i], 3) for i, p in enumerate(PHASES)},
                "ratio": round(med[name][0] / med["GRPO"][0], 3),
            }
        )
    return rows


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_one(steps: int, samples: int) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        t = trainer(
            "adjoint_matching.yaml",
            tmp,
            [
                f"rollout.num_inference_steps={steps}",
                f"train.batch_size={samples}",
                f"train.prompts_per_iteration={samples // 8}",
                "train.num_generations=8",
            ],
        )
        t.train_iteration(0)  # warm-up: optimizer state, allocator
        batch = t.advantages(t.score(t.collect(1)))
        stored = sum(x.nbytes for x in (batch.latents, batch.log_probs, batch.reward_grads) if x is not None)
        before = status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current resident size
        t.update(batch, 1)
        peak = status_kb("VmHWM")
    return {"steps": steps, "samples": samples, "trajectory_mb": round(stored / 2**20, 3), "peak_rise_mb": round((peak - before) / 1024, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, nargs="+", default=[10, 20, 40])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the timing (the memory runs use one)")
    p.add_argument("--skip-time", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(memory_one(a.one, a.samples)))
        return
    result: dict = {}
    if not a.skip_time:
        rows = time_ratio(a.reps, a.threads)
        print(f"one iteration, 64 samples, 10 steps, {a.threads} threads, median of {a.reps} (seconds)")
        print(f"{'setting':<30}" + "".join(f"{ph + ' AM':>12}{ph + ' GRPO':>13}" for ph in PHASES) + f"{'ratio':>8}")
        for r in rows:
            print(
                f"{r['setting']:<30}"
                + "".join(f"{r[ph + '_s']:>12.3f}{r['grpo_' + ph + '_s']:>13.3f}" for ph in PHASES)
                + f"{r['ratio']:>8.3f}"
            )
        result["time"] = rows
        print(f"am_over_grpo_ratio={rows[0]['ratio']:.3f}")
    if a.skip_memory:
        print(json.dumps(result))
        return
    mem = []
    for malloc, env in (("default", {}), ("mmap>64KiB", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
        for k in a.steps:
            out = subprocess.run(
                [sys.executable, __file__, "--samples", str(a.samples), "--one", str(k)],
                capture_output=True,
                text=True,
                check=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            )
            mem.append({"malloc": malloc, **json.loads(out.stdout.strip().splitlines()[-1])})
    print(f"Adjoint Matching update, {a.samples} samples in one minibatch, 1 thread: peak resident memory rise (MB)")
    print(f"{'malloc':<12}{'steps K':>8}{'trajectory MB':>15}{'peak rise MB':>14}")
    for r in mem:
        print(f"{r['malloc']:<12}{r['steps']:>8}{r['trajectory_mb']:>15.3f}{r['peak_rise_mb']:>14.1f}")
    result["memory"] = mem
    print(json.dumps(result))


if __name__ == "__main__":
    main()
