"""Framework overhead of a GRPO iteration on the embedded model, measured in one run.

ours: wall time of Trainer.train_iteration (rollout -> score -> prepare -> update).
raw:  the model compute that iteration needs, written as bare PyTorch with the same shapes: the text
      encoder, K denoiser forwards per rollout chunk, the reward model forward, and for every trained
      step one denoiser forward + backward plus one AdamW step per minibatch.
Both are timed alternately, several repetitions each, and compared by median. The last line is
``overhead_ratio=<ours / raw>``.

    python bench/overhead.py [--record] [key=value overrides for configs/digits/grpo.yaml]

``--record`` also writes the numbers to bench/results/overhead.json under the overrides' setting (docs/results.md is
generated from it).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import record  # noqa: E402  (bench/record.py)

from flowrl.config import load_config  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402


def raw_iteration(trainer: Trainer, stats: dict[str, float]) -> None:
    """The same model work as one flowrl iteration, without flowrl."""
    cfg = trainer.config
    unet = trainer.accelerator.unwrap_model(trainer.pipeline.denoiser)
    pipe = trainer.pipeline
    n = cfg.train.prompts_per_iteration * cfg.train.num_generations
    k_steps, cfg_mult = cfg.rollout.num_inference_steps, (2 if cfg.rollout.guidance_scale != 1.0 else 1)
    ids = pipe.tokenizer(["a handwritten seven"] * n, padding="max_length", max_length=8, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    with torch.no_grad():
        ctx = pipe.text_encoder(ids).last_hidden_state
        outs = []
        for start in range(0, n, cfg.rollout.batch_size):
            x = torch.randn(min(cfg.rollout.batch_size, n - start), 1, 8, 8)
            c = ctx[: x.shape[0]]
            for _ in range(k_steps):
                xin, cin = (torch.cat([x, x]), torch.cat([c, c])) if cfg_mult == 2 else (x, c)
                x = x - 0.1 * unet(xin, torch.full((xin.shape[0],), 500.0), cin).sample[: x.shape[0]]
            outs.append(x)
        samples = (torch.cat(outs).clamp(-1, 1) + 1) / 2
    t1 = time.perf_counter()
    with torch.no_grad():
        trainer.reward(samples, ["a handwritten seven"] * n, [{"digit": 7}] * n)
    t2 = time.perf_counter()
    steps_trained = max(1, int(cfg.objective.timestep_fraction * k_steps))
    for start in range(0, n, cfg.train.batch_size):
        b = min(cfg.train.batch_size, n - start)
        trainer.optimizer.zero_grad(set_to_none=True)
        for _ in range(steps_trained):
            x = torch.randn(b * cfg_mult, 1, 8, 8)
            unet(x, torch.full((b * cfg_mult,), 500.0), ctx[: b * cfg_mult]).sample.square().mean().backward()
        trainer.optimizer.step()
    t3 = time.perf_counter()
    stats.update(rollout=t1 - t0, score=t2 - t1, update=t3 - t2)


def main() -> None:
    torch.set_num_threads(2)
    keep = "--record" in sys.argv
    overrides = [a for a in sys.argv[1:] if a != "--record"]
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(REPO / "configs" / "digits" / "grpo.yaml", [f"output_dir={tmp}", "log.progress=false", *overrides])
        trainer = Trainer(config)
        trainer.train_iteration(0)  # warm-up (lazy loads, allocator)
        raw_iteration(trainer, {})
        ours, raw = [], []
        for rep in range(5):
            t0 = time.perf_counter()
            m = trainer.train_iteration(rep + 1)
            ours.append((time.perf_counter() - t0, m["perf/rollout_s"], m["perf/score_s"], m["perf/update_s"]))
            s: dict[str, float] = {}
            t0 = time.perf_counter()
            raw_iteration(trainer, s)
            raw.append((time.perf_counter() - t0, s["rollout"], s["score"], s["update"]))
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    n = config.train.prompts_per_iteration * config.train.num_generations
    print(
        f"GRPO iteration on digits_flow: {n} samples, {config.rollout.num_inference_steps} steps, "
        f"guidance {config.rollout.guidance_scale}, {torch.get_num_threads()} threads, median of 5"
    )
    print(f"{'phase':<10}{'flowrl s':>10}{'raw s':>10}{'ratio':>8}")
    for i, phase in enumerate(["total", "rollout", "score", "update"]):
        o, r = med(ours, i), med(raw, i)
        print(f"{phase:<10}{o:>10.3f}{r:>10.3f}{o / r:>8.3f}")
    print(f"overhead_ratio={med(ours, 0) / med(raw, 0):.3f}")
    if keep:
        phases = {p: {"flowrl_s": med(ours, i), "raw_s": med(raw, i)} for i, p in enumerate(["total", "rollout", "score", "update"])}
        setting = {
            "overrides": overrides,
            "samples": n,
            "steps": config.rollout.num_inference_steps,
            "guidance": config.rollout.guidance_scale,
            "threads": torch.get_num_threads(),
            "phases": phases,
            **record.stamp(record.this_command()),
        }
        results = record.read("overhead") or {"about": __doc__.split("\n\n")[0], "settings": {}}
        results["settings"][" ".join(overrides) or "preset"] = setting
        record.write("overhead", results)


if __name__ == "__main__":
    main()
