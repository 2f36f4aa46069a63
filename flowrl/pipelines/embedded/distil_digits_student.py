"""Distil the embedded digit generator into its 2-step student and ship it as an embedded model.

    python -m flowrl.pipelines.embedded.distil_digits_student --out flowrl/assets/digits_flow_2step

Runs the DMD2 preset's recipe (configs/digits/dmd2.yaml: the 2-step student as the policy's LoRA, a fake-score
adapter, the 10-step ``digits_flow`` as the teacher) through flowrl's own Trainer, folds the student's LoRA into a
copy of the teacher's UNet (``merged_denoiser``) and writes a model directory of the ``digits_flow`` layout (unet/,
text_encoder/, tokenizer/, scheduler/) with ``training_info.json``: the command, ``num_inference_steps: 2`` (the grid
it was distilled for: sample it with ``rollout.num_inference_steps: 2``), and the held-out evaluation of the LoRA
run and of the written model itself (``flowrl eval``'s setting: 20 unseen phrasings x 4 seeds). Load it as
``pipeline.pretrained: digits_flow_2step``. Deterministic for a thread count (one by default): a second run wrote
the same UNet and text encoder files byte for byte (2026-11-28, 276 s of training on the shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .training import ASSETS, save_model

PRESET = "digits/dmd2"
STEPS = 2  # the preset's rollout.num_inference_steps: the grid the student is distilled for
EVAL_KEYS = {"reward": "eval/reward/mean", "judge": "eval/judge/mean", "diversity": "eval/diversity"}


def _held_out(metrics: dict) -> dict:
    return {name: round(float(metrics[key]), 6) for name, key in EVAL_KEYS.items()}


def distil(run_dir: Path, overrides: list[str]) -> tuple[object, dict, float]:
    """Train the preset in ``run_dir``; the trainer (its pipeline holds the student), its final evaluation, seconds."""
    from ...trainer import Trainer

    trainer = Trainer(PRESET, [f"output_dir={run_dir}", "overwrite=true", "log.progress=false", *overrides])
    start = time.perf_counter()
    trainer.fit()
    return trainer, _held_out(trainer.evaluate()), time.perf_counter() - start


def evaluate_model(model_dir: str | Path, run_dir: Path) -> dict:
    """The written model at 2 steps on the preset's held-out setting."""
    from ...trainer import Trainer

    # the preset's policy LoRA starts at zero (peft's B = 0), so the evaluated model is the written one exactly
    overrides = [f"pipeline.pretrained={model_dir}", f"output_dir={run_dir}", "overwrite=true"]
    return _held_out(Trainer(PRESET, [*overrides, "log.progress=false", "train.iterations=1"]).evaluate())


def write_student(trainer, out: Path, info: dict) -> None:
    """The merged student with the teacher's text encoder, tokenizer and scheduler, written atomically."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipeline = trainer.pipeline
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(ASSETS / "digits_flow"), subfolder="scheduler")
    parts = [("unet", pipeline.merged_denoiser()), ("text_encoder", pipeline.text_encoder), ("tokenizer", pipeline.tokenizer)]
    save_model(out, [*parts, ("scheduler", scheduler)], info)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ASSETS / "digits_flow_2step", help="Where the model directory is written.")
    p.add_argument("--run-dir", type=Path, default=None, help="The DMD2 run's directory (default: a temporary one).")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the weights depend on it).")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = a.run_dir or Path(tmp) / "run"
        trainer, lora_eval, seconds = distil(run_dir, [f"train.num_threads={a.threads}"])
        config = trainer.config
        info = {
            "kind": "flow",
            "distilled_from": "digits_flow",
            "method": "dmd2",
            "preset": f"configs/{PRESET}.yaml",
            "num_inference_steps": STEPS,
            "iterations": config.train.iterations,
            "seed": config.seed,
            "threads": a.threads,
            "train_seconds": round(seconds, 1),
            "held_out_lora_run": lora_eval,
            "command": f"python -m flowrl.pipelines.embedded.distil_digits_student --threads {a.threads}",
        }
        write_student(trainer, a.out, info)
        info["held_out"] = evaluate_model(a.out, Path(tmp) / "eval")
        (a.out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
        if a.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
