"""The choice term of the masked-image step's log-prob on the embedded digits_masked model (#41 item 2).

A step of AmusedScheduler's rule commits a set C of masked positions chosen by the Gumbel-perturbed confidences of
the drafted tokens; its exact log-prob (``sampler.score: step``) is the committed tokens' log softmax plus
log P(C | x_C) (samplers/masked_image.py). flowrl's former score (``score: committed_tokens``) was the first sum
alone. This script rolls out the preset's setting (configs/digits/masked_grpo.yaml: 8 steps, guidance 1) for
``--prompts`` train prompts x ``--samples`` samples and prints, per step, how many tokens it commits, the mean of
each part and the spread of log P(C | x_C) across the samples (what a policy gradient would have left out), and the
correlation of the two parts over the samples. Then the cost of the choice term: seconds for one log-prob call with
its backward at the preset's training minibatch (32 rows) with and without it, and at aMUSEd-256's shape (one row,
256 positions, 8192 codebook entries, random logits).

    OMP_NUM_THREADS=1 python bench/masked_commit_probability.py [--prompts 8] [--samples 8] [--seed 0]

The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrl.config import load_config  # noqa: E402
from flowrl.prompts import sample_prompts  # noqa: E402
from flowrl.samplers.masked_image import MaskedImageSampler  # noqa: E402
from flowrl.samplers.rollout import rollout  # noqa: E402
from flowrl.trainer import Trainer  # noqa: E402


def rollout_parts(trainer: Trainer, prompts: list[str], seed: int) -> list[dict]:
    """One rollout of the preset's sampler; per step the committed count and the two parts of each sample's log-prob."""
    pipe, sampler, rc = trainer.pipeline, trainer.modality.sampler, trainer.config.rollout
    tokens_only = MaskedImageSampler(
        sampler.mask_token_id, sampler.masking, sampler.token_temperature, sampler.choice_temperature, "committed_tokens"
    )
    sigmas = pipe.schedule.sigmas(rc.num_inference_steps)
    traj = rollout(
        pipe,
        sampler,
        prompts,
        [{} for _ in prompts],
        torch.arange(len(prompts)),
        sigmas,
        torch.Generator().manual_seed(seed),
        rc.guidance_scale,
        initial_noise=pipe.initial_noise(len(prompts), None),
    )
    rows = []
    with torch.no_grad():
        for k in range(rc.num_inference_steps):
            x, nxt = traj.latents[:, k], traj.latents[:, k + 1]
            logits = pipe.predict(x, sigmas[k], traj.cond, rc.guidance_scale)
            tokens = tokens_only.log_prob(logits, x, nxt, sigmas[k], sigmas[k + 1]).double()
            choice = traj.log_probs[:, k].double() - tokens
            committed = int(((x == sampler.mask_token_id) & (nxt != sampler.mask_token_id)).sum(-1)[0])
            corr = float(torch.corrcoef(torch.stack([tokens, choice]))[0, 1]) if choice.std() > 0 else 0.0
            rows.append(
                {
                    "step": k,
                    "committed": committed,
                    "tokens_mean": float(tokens.mean()),
                    "choice_mean": float(choice.mean()),
                    "choice_std": float(choice.std()),
                    "tokens_std": float(tokens.std()),
                    "corr": corr,
                }
            )
    return rows


def seconds(
    sampler: MaskedImageSampler, logits: torch.Tensor, x: torch.Tensor, nxt: torch.Tensor, sigma, sigma_next, repeats: int
) -> float:
    """Median seconds of one log-prob call and its backward."""
    times = []
    for _ in range(repeats):
        leaf = logits.clone().requires_grad_()
        start = time.perf_counter()
        sampler.log_prob(leaf, x, nxt, sigma, sigma_next).sum().backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cost(rows: int, length: int, vocab: int, committed: int, repeats: int) -> dict:
    """Seconds per call with and without the choice term, random logits, step 0 of 8 committing ``committed`` tokens."""
    gen = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(rows, length, vocab, generator=gen)
    x = torch.full((rows, length), float(vocab))
    nxt = x.clone()
    nxt[:, :committed] = torch.randint(vocab, (rows, committed), generator=gen).float()
    sigmas = torch.linspace(1.0, 0.0, 9)
    out = {}
    for score in ("step", "committed_tokens"):
        sampler = MaskedImageSampler(vocab, "cosine", 1.0, (2.0, 0.0), score)
        out[score] = seconds(sampler, logits, x, nxt, sigmas[0], sigmas[1], repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(REPO / "configs" / "digits" / "masked_grpo.yaml", [f"output_dir={tmp}", "log.progress=false"])
        trainer = Trainer(config)
        pool = sample_prompts(trainer.modality.train_pool, args.prompts, random.Random(args.seed))
        steps = rollout_parts(trainer, [prompt for prompt, _ in pool for _ in range(args.samples)], args.seed)
    print("step  committed  tokens part (mean, std)  log P(C | x_C) (mean, std)  corr")
    for r in steps:
        print(
            f"{r['step']:>4}  {r['committed']:>9}  {r['tokens_mean']:>9.3f} {r['tokens_std']:>6.3f}"
            f"  {r['choice_mean']:>15.3f} {r['choice_std']:>6.3f}  {r['corr']:>6.2f}"
        )
    timing = {"digits_minibatch": cost(32, 16, 64, 1, 5), "amused256_row": cost(1, 256, 8192, 8, 2)}
    for name, t in timing.items():
        print(f"{name}: log-prob + backward {t['step']:.3f} s with the choice term, {t['committed_tokens']:.4f} s without")
    print(json.dumps({"steps": steps, "seconds": timing, "prompts": args.prompts, "samples": args.samples, "seed": args.seed}))


if __name__ == "__main__":
    main()
