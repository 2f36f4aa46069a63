"""Offline preference pairs for Diffusion-DPO.

A pairs directory holds ``pairs.safetensors`` (``winner`` and ``loser``: (N, *S) clean samples in the
denoiser's own space, i.e. latents for VAE models, pixels in [-1, 1] for the embedded ones) and
``pairs.jsonl`` (one line per pair: ``prompt``, ``metadata``, and optionally ``winner_reward`` /
``loser_reward``). Any labelled data converted to this layout trains (human labels included); the
builder below makes pairs from a model and a reward (AI feedback):

    python -m flowrl.preference_pairs configs/digits/diffusion_dpo.yaml --num-prompts 512 --out pairs/digits

draws two samples per training prompt with the evaluation (ODE) sampler from independent noise, scores
them with the config's reward and keeps the pair, better one first, unless the two tie.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .errors import FlowRLError


@dataclass
class PreferencePairs:
    winners: Tensor  # (N, *S)
    losers: Tensor  # (N, *S)
    prompts: list[str]
    metadata: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompts)


def write_pairs(directory: str | Path, pairs: PreferencePairs, rewards: tuple[Tensor, Tensor] | None = None) -> Path:
    """Write a pairs directory atomically (nothing is left behind if writing fails)."""
    from safetensors.torch import save_file

    from .checkpoint import atomic_directory

    directory = Path(directory)
    if directory.exists():
        raise FlowRLError(f"pairs directory '{directory}' already exists; choose a new one.")
    with atomic_directory(directory) as tmp:
        save_file({"winner": pairs.winners.contiguous(), "loser": pairs.losers.contiguous()}, str(tmp / "pairs.safetensors"))
        with open(tmp / "pairs.jsonl", "w") as f:
            for i, (prompt, meta) in enumerate(zip(pairs.prompts, pairs.metadata)):
                row = {"prompt": prompt, "metadata": meta}
                if rewards is not None:
                    row.update(winner_reward=float(rewards[0][i]), loser_reward=float(rewards[1][i]))
                f.write(json.dumps(row) + "\n")
    return directory


def read_pairs(directory: str | Path) -> PreferencePairs:
    """Read and check a pairs directory; every problem is one sentence."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    tensors, rows = directory / "pairs.safetensors", directory / "pairs.jsonl"
    if not tensors.is_file() or not rows.is_file():
        raise FlowRLError(f"'{directory}' is not a pairs directory (it needs pairs.safetensors and pairs.jsonl).")
    try:
        data = load_file(str(tensors))
        lines = [json.loads(line) for line in rows.read_text().splitlines() if line.strip()]
    except (SafetensorError, OSError, ValueError) as e:
        raise FlowRLError(f"could not read the pairs in '{directory}': {str(e).splitlines()[0][:160]}") from None
    if set(data) != {"winner", "loser"} or data["winner"].shape != data["loser"].shape:
        raise FlowRLError(f"'{tensors}' must hold 'winner' and 'loser' tensors of one shape.")
    if len(lines) != data["winner"].shape[0] or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in lines):
        raise FlowRLError(f"'{rows}' must have one JSON object with a 'prompt' per pair ({data['winner'].shape[0]} pairs).")
    return PreferencePairs(data["winner"].float(), data["loser"].float(), [r["prompt"] for r in lines], [dict(r.get("metadata") or {}) for r in lines])


@torch.no_grad()
def build_pairs(config, num_prompts: int, generator: torch.Generator) -> tuple[PreferencePairs, tuple[Tensor, Tensor], int]:
    """Two ODE samples per training prompt of ``config`` from independent noise, labelled by its reward.

    Returns the pairs (ties and pairs with a non-finite reward left out), their rewards, and the number
    left out.
    """
    from . import seeding
    from .config import ODEConfig, resolve_device
    from .pipelines import build_pipeline
    from .prompts import prompt_pool, sample_prompts
    from .reward_models import build_reward_from_config
    from .samplers import build_sampler
    from .samplers.rollout import rollout

    device = resolve_device(config.pipeline.device)  # exactly pipeline.device, refused if this machine lacks it
    device = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")  # auto
    pipeline = build_pipeline(config.pipeline, device)
    sampler, reward, rc = build_sampler(ODEConfig(), pipeline), build_reward_from_config(config.reward), config.rollout
    pool = prompt_pool(config.prompts.dataset, config.prompts.train_split, file=config.prompts.train_file)
    chosen = sample_prompts(pool, num_prompts, seeding.python_rng(config.seed, 0, 0, "pair_prompts"))
    sigmas = pipeline.schedule.sigmas(rc.num_inference_steps).to(device)
    per_batch = max(1, rc.batch_size // 2)  # prompts per rollout batch of two samples each
    keep_w, keep_l, prompts, metadata, rw, rl, dropped = [], [], [], [], [], [], 0
    pipeline.denoiser.eval()
    for start in range(0, len(chosen), per_batch):
        part = chosen[start : start + per_batch]
        ps, ms = [p for p, _ in part for _ in range(2)], [m for _, m in part for _ in range(2)]
        traj = rollout(pipeline, sampler, ps, ms, torch.arange(len(ps)), sigmas, generator, rc.guidance_scale, same_noise_in_group=False)
        scores = reward(traj.samples, ps, ms).scores.float().cpu()
        x0 = traj.latents[:, -1].cpu()
        for i, (prompt, meta) in enumerate(part):
            a, b = float(scores[2 * i]), float(scores[2 * i + 1])
            if not (torch.isfinite(scores[2 * i : 2 * i + 2]).all() and a != b):
                dropped += 1
                continue
            w, lo = (2 * i, 2 * i + 1) if a > b else (2 * i + 1, 2 * i)
            keep_w.append(x0[w])
            keep_l.append(x0[lo])
            prompts.append(prompt)
            metadata.append(dict(meta))
            rw.append(max(a, b))
            rl.append(min(a, b))
    if not prompts:
        raise FlowRLError("every pair was a tie or had a non-finite reward; no pairs to write.")
    return PreferencePairs(torch.stack(keep_w), torch.stack(keep_l), prompts, metadata), (torch.tensor(rw), torch.tensor(rl)), dropped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flowrl.preference_pairs", description="Build offline preference pairs from a model and a reward.")
    p.add_argument("config", help="a YAML config: its pipeline, reward, prompts and rollout settings are used")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--num-prompts", type=int, default=512, help="training prompts to draw (with replacement), one pair each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the pairs directory to write (must not exist)")
    args = p.parse_args(argv)
    try:
        from .config import load_config

        if args.out.exists():
            raise FlowRLError(f"pairs directory '{args.out}' already exists; choose a new one.")
        pairs, rewards, dropped = build_pairs(load_config(args.config, args.overrides), args.num_prompts, torch.Generator().manual_seed(args.seed))
        write_pairs(args.out, pairs, rewards)
    except FlowRLError as e:
        print(f"flowrl: error: {e}", file=sys.stderr)
        return 2
    gap = float((rewards[0] - rewards[1]).mean())
    print(json.dumps({"pairs": len(pairs), "dropped": dropped, "mean_reward_gap": round(gap, 6), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
