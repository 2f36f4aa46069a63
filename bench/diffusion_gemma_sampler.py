"""DiffusionGemma: flowrl's entropy-bound sampler against transformers' ``generate``, and what re-scoring costs, measured
in one run on the tiny random-weight model (``pipelines/diffusion_gemma.py::write_tiny_random``).

    python bench/diffusion_gemma_sampler.py [--batch 16] [--canvases 3] [--steps 8] [--repeats 5]

Per repeat, in turn: ``generate`` (torch's global generator), flowrl's sampler with one ``torch.Generator`` (the same
draws: the tokens are checked equal), flowrl's sampler with per-row streams (training rollouts and evaluation), the
re-scoring replay without gradient (``old_and_ref``) and with gradient plus backward (one step_grpo update's work).
Times are medians over the repeats, as ratios to ``generate``. Single-threaded; run it under ``nice``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.pipelines.diffusion_gemma import load_diffusion_gemma, write_tiny_random  # noqa: E402
from flowrl.samplers.entropy_bound import EntropyBoundSamplerConfig, generate, resolve_settings, step_log_probs  # noqa: E402
from flowrl.seeding import RowGenerators  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--canvases", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        lm = load_diffusion_gemma(str(write_tiny_random(tmp)))
    lm.model.eval()
    settings = resolve_settings(lm, EntropyBoundSamplerConfig(gen_length=8 * args.canvases, steps=args.steps))
    ids = torch.randint(4, 70, (args.batch, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    times: dict[str, list[float]] = {
        k: [] for k in ("generate", "flowrl, one generator", "flowrl, row streams", "re-score", "re-score + backward")
    }
    same = True
    for r in range(args.repeats):
        t = time.perf_counter()
        torch.manual_seed(r)
        ref = lm.model.generate(ids, attention_mask=mask, max_new_tokens=settings.gen_length, max_denoising_steps=settings.steps)
        times["generate"].append(time.perf_counter() - t)
        t = time.perf_counter()
        traj = generate(lm, ids, mask, settings, torch.Generator().manual_seed(r))
        times["flowrl, one generator"].append(time.perf_counter() - t)
        new = ref.sequences[:, ids.shape[1] :]
        same &= torch.equal(traj.completion_ids[:, : new.shape[1]], new)
        t = time.perf_counter()
        traj = generate(lm, ids, mask, settings, RowGenerators.keyed(0, r, "rollout", range(args.batch)))
        times["flowrl, row streams"].append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            step_log_probs(lm, traj)
        times["re-score"].append(time.perf_counter() - t)
        t = time.perf_counter()
        (step_log_probs(lm, traj) * traj.counted).sum().backward()
        times["re-score + backward"].append(time.perf_counter() - t)
        lm.model.zero_grad(set_to_none=True)
    base = statistics.median(times["generate"])
    print(
        f"tiny random DiffusionGemma, {args.batch} prompts x {args.canvases} canvases of 8 x {args.steps} steps, "
        f"median of {args.repeats}, 1 thread; tokens equal to generate's: {same}"
    )
    for k, v in times.items():
        print(f"  {k:<24} {statistics.median(v):8.3f} s   x{statistics.median(v) / base:5.2f}")


if __name__ == "__main__":
    main()
