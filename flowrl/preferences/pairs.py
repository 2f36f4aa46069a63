"""Offline preference pairs for Diffusion-DPO.

A pairs directory holds ``pairs.safetensors`` (``winner`` and ``loser``: (N, *S) clean samples in the
denoiser's own space, i.e. latents for VAE models, pixels in [-1, 1] for the embedded ones) and
``pairs.jsonl`` (one line per pair: ``prompt``, ``metadata``, and optionally ``winner_reward`` /
``loser_reward``). Any labelled data converted to this layout trains (human labels included); the
builder below makes pairs from a model and a reward (AI feedback):

    python -m flowrl.preferences.pairs configs/digits/diffusion_dpo.yaml --num-prompts 512 --out pairs/digits

draws two samples per training prompt with the evaluation (ODE) sampler from independent noise, scores
them with the config's reward and keeps the pair, better one first, unless the two tie.

Two optional parts serve human labelling (``flowrl label``, docs/labeling.md): ``images/NNNNNN_winner.png``
and ``images/NNNNNN_loser.png``, the decoded samples a person looks at (the tensors may be VAE latents);
and, with ``--trajectories``, ``trajectories.safetensors``: every state of both denoising trajectories
(``winner`` / ``loser``: (N, K+1, *S), ``sigmas`` (K+1,), ``stochastic`` (K,)), sampled as D3PO samples
online (the config's stochastic sampler, one shared x_T per pair when ``rollout.same_noise_in_group``), so
D3PO can train on the human labels of these very trajectories (``objective.preference: human``).
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

from ..errors import FlowRLError

SLOTS = ("winner", "loser")  # the stored order of a pair: the builder's reward ranks the first above the second


@dataclass
class PairTrajectories:
    """Both denoising trajectories of every pair (what D3PO's loss re-scores step by step)."""

    winners: Tensor  # (N, K+1, *S), noise -> data
    losers: Tensor  # (N, K+1, *S)
    sigmas: Tensor  # (K+1,)
    stochastic: Tensor  # (K,) bool
    guidance_scale: float


@dataclass
class PreferencePairs:
    winners: Tensor  # (N, *S)
    losers: Tensor  # (N, *S)
    prompts: list[str]
    metadata: list[dict[str, Any]]
    trajectories: PairTrajectories | None = None
    images: Tensor | None = None  # (N, 2, C, H, W) decoded winner / loser in [0, 1]; written as PNGs, never read back

    def __len__(self) -> int:
        return len(self.prompts)

    def reordered(self, indices: list[int], swap: list[bool]) -> PreferencePairs:
        """The pairs ``indices``, winner and loser exchanged where ``swap`` (a human preferred the stored loser)."""
        idx, flip = torch.tensor(indices, dtype=torch.long), torch.tensor(swap, dtype=torch.bool)

        def pick(first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
            a, b = first[idx], second[idx]
            where = flip.view((-1,) + (1,) * (a.ndim - 1))
            return torch.where(where, b, a), torch.where(where, a, b)

        winners, losers = pick(self.winners, self.losers)
        traj = self.trajectories
        if traj is not None:
            tw, tl = pick(traj.winners, traj.losers)
            traj = PairTrajectories(tw, tl, traj.sigmas, traj.stochastic, traj.guidance_scale)
        return PreferencePairs(winners, losers, [self.prompts[i] for i in indices], [dict(self.metadata[i]) for i in indices], traj)


def image_path(directory: str | Path, pair: int, slot: str) -> Path:
    """Where the picture of one side (``slot`` in SLOTS) of pair ``pair`` lives in a pairs directory."""
    return Path(directory) / "images" / f"{pair:06d}_{slot}.png"


def _write_images(directory: Path, images: Tensor) -> None:
    """One PNG per sample; samples that are not pictures (2-D points) get none, and the labelling page says so."""
    from PIL import Image

    if images.ndim != 5 or images.shape[2] not in (1, 3):
        return
    (directory / "images").mkdir()
    pixels = (images.detach().float().clamp(0, 1).cpu() * 255).round().to(torch.uint8)
    for i in range(pixels.shape[0]):
        for j, slot in enumerate(SLOTS):
            img = pixels[i, j]
            img = img.expand(3, -1, -1) if img.shape[0] == 1 else img
            Image.fromarray(img.permute(1, 2, 0).numpy()).save(image_path(directory, i, slot), format="PNG")


def write_pairs(directory: str | Path, pairs: PreferencePairs, rewards: tuple[Tensor, Tensor] | None = None) -> Path:
    """Write a pairs directory atomically (nothing is left behind if writing fails)."""
    from safetensors.torch import save_file

    from ..atomic_files import atomic_directory

    directory = Path(directory)
    if directory.exists():
        raise FlowRLError(f"pairs directory '{directory}' already exists; choose a new one.")
    with atomic_directory(directory) as tmp:
        save_file({"winner": pairs.winners.contiguous(), "loser": pairs.losers.contiguous()}, str(tmp / "pairs.safetensors"))
        if pairs.trajectories is not None:
            t = pairs.trajectories
            save_file(
                {
                    "winner": t.winners.contiguous(),
                    "loser": t.losers.contiguous(),
                    "sigmas": t.sigmas.contiguous(),
                    "stochastic": t.stochastic.contiguous(),
                },
                str(tmp / "trajectories.safetensors"),
                metadata={"guidance_scale": repr(float(t.guidance_scale))},
            )
        if pairs.images is not None:
            _write_images(tmp, pairs.images)
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
    pairs = PreferencePairs(
        data["winner"].float(), data["loser"].float(), [r["prompt"] for r in lines], [dict(r.get("metadata") or {}) for r in lines]
    )
    if (directory / "trajectories.safetensors").exists():
        pairs.trajectories = _read_trajectories(directory / "trajectories.safetensors", pairs)
    return pairs


def _read_trajectories(path: Path, pairs: PreferencePairs) -> PairTrajectories:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            data, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        guidance = float(meta.get("guidance_scale", "1.0"))
    except (SafetensorError, OSError, ValueError) as e:
        raise FlowRLError(f"could not read the trajectories in '{path}': {str(e).splitlines()[0][:160]}") from None
    n, shape = len(pairs), tuple(pairs.winners.shape[1:])
    ok = set(data) == {"winner", "loser", "sigmas", "stochastic"} and data["winner"].shape == data["loser"].shape
    ok = ok and data["winner"].ndim == len(shape) + 2 and tuple(data["winner"].shape[:1] + data["winner"].shape[2:]) == (n, *shape)
    ok = ok and data["sigmas"].shape == (data["winner"].shape[1],) and data["stochastic"].shape == (data["winner"].shape[1] - 1,)
    if not ok:
        raise FlowRLError(
            f"'{path}' must hold 'winner' and 'loser' trajectories ({n}, K+1, {', '.join(map(str, shape))}), 'sigmas' (K+1,) and 'stochastic' (K,)."
        )
    return PairTrajectories(data["winner"].float(), data["loser"].float(), data["sigmas"].float(), data["stochastic"].bool(), guidance)


def read_pair_prompts(directory: str | Path) -> list[str]:
    """The prompts of a pairs directory, checked against the number of stored pairs without loading the
    tensors (the labelling page needs no more, and trajectories of latents can be gigabytes)."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    tensors, rows = directory / "pairs.safetensors", directory / "pairs.jsonl"
    if not tensors.is_file() or not rows.is_file():
        raise FlowRLError(f"'{directory}' is not a pairs directory (it needs pairs.safetensors and pairs.jsonl).")
    try:
        with safe_open(str(tensors), framework="pt") as f:
            n = f.get_slice("winner").get_shape()[0] if "winner" in f.keys() else -1
        lines = [json.loads(line) for line in rows.read_text().splitlines() if line.strip()]
    except (SafetensorError, OSError, ValueError) as e:
        raise FlowRLError(f"could not read the pairs in '{directory}': {str(e).splitlines()[0][:160]}") from None
    if len(lines) != n or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in lines):
        raise FlowRLError(f"'{rows}' must have one JSON object with a 'prompt' per pair of '{tensors}' ({n} pairs).")
    return [r["prompt"] for r in lines]


@torch.no_grad()
def build_pairs(
    config, num_prompts: int, generator: torch.Generator, trajectories: bool = False
) -> tuple[PreferencePairs, tuple[Tensor, Tensor], int]:
    """Two ODE samples per training prompt of ``config`` from independent noise, labelled by its reward.
    With ``trajectories``: two samples of the config's rollout sampler instead, from one x_T per pair when
    ``rollout.same_noise_in_group`` (D3PO's online pairs), every state kept.

    Returns the pairs (ties and pairs with a non-finite reward left out; their decoded samples in ``images``),
    their rewards, and the number left out.
    """
    from .. import seeding
    from ..pipelines import build_pipeline
    from ..pipelines.common import resolve_device
    from ..prompts import prompts_for, sample_prompts
    from ..reward_models import build_reward_from_config
    from ..samplers import ODEConfig, build_sampler
    from ..samplers.rollout import rollout

    device = resolve_device(config.pipeline.device)  # exactly pipeline.device, refused if this machine lacks it
    device = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")  # auto
    pipeline = build_pipeline(config.pipeline, device)
    sampler = build_sampler(config.sampler if trajectories else ODEConfig(), pipeline)
    reward, rc = build_reward_from_config(config.reward), config.rollout
    if trajectories and not sampler.stochastic:
        raise FlowRLError(f"--trajectories records pairs for D3PO, which needs a stochastic sampler; '{sampler.name}' is deterministic.")
    pool = prompts_for(config.prompts, "train")
    chosen = sample_prompts(pool, num_prompts, seeding.python_rng(config.seed, 0, 0, "pair_prompts"))
    sigmas = pipeline.schedule.sigmas(rc.num_inference_steps).to(device)
    per_batch = max(1, rc.batch_size // 2)  # prompts per rollout batch of two samples each
    keep_w, keep_l, images, states, prompts, metadata, rw, rl, dropped = [], [], [], [], [], [], [], [], 0
    pipeline.denoiser.eval()
    for start in range(0, len(chosen), per_batch):
        part = chosen[start : start + per_batch]
        ps, ms = [p for p, _ in part for _ in range(2)], [m for _, m in part for _ in range(2)]
        if trajectories:  # as D3PO's online rollout: the pair's two samples are one group
            traj = rollout(
                pipeline,
                sampler,
                ps,
                ms,
                torch.arange(len(part)).repeat_interleave(2),
                sigmas,
                generator,
                rc.guidance_scale,
                same_noise_in_group=rc.same_noise_in_group,
            )
        else:
            traj = rollout(
                pipeline, sampler, ps, ms, torch.arange(len(ps)), sigmas, generator, rc.guidance_scale, same_noise_in_group=False
            )
        scores = reward(traj.samples, ps, ms).scores.float().cpu()
        x0, decoded = traj.latents[:, -1].cpu(), traj.samples.detach().float().cpu()
        for i, (prompt, meta) in enumerate(part):
            a, b = float(scores[2 * i]), float(scores[2 * i + 1])
            if not (torch.isfinite(scores[2 * i : 2 * i + 2]).all() and a != b):
                dropped += 1
                continue
            w, lo = (2 * i, 2 * i + 1) if a > b else (2 * i + 1, 2 * i)
            keep_w.append(x0[w])
            keep_l.append(x0[lo])
            images.append(torch.stack([decoded[w], decoded[lo]]))
            if trajectories:
                states.append((traj.latents[w].cpu(), traj.latents[lo].cpu()))
            prompts.append(prompt)
            metadata.append(dict(meta))
            rw.append(max(a, b))
            rl.append(min(a, b))
    if not prompts:
        raise FlowRLError("every pair was a tie or had a non-finite reward; no pairs to write.")
    recorded = None
    if trajectories:
        recorded = PairTrajectories(
            torch.stack([w for w, _ in states]),
            torch.stack([lo for _, lo in states]),
            sigmas.cpu(),
            traj.stochastic.cpu(),
            float(rc.guidance_scale),
        )
    pairs = PreferencePairs(torch.stack(keep_w), torch.stack(keep_l), prompts, metadata, recorded, torch.stack(images))
    return pairs, (torch.tensor(rw), torch.tensor(rl)), dropped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flowrl.preferences.pairs", description="Build offline preference pairs from a model and a reward."
    )
    p.add_argument("config", help="a YAML config: its pipeline, reward, prompts and rollout settings are used")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--num-prompts", type=int, default=512, help="training prompts to draw (with replacement), one pair each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the pairs directory to write (must not exist)")
    p.add_argument(
        "--trajectories",
        action="store_true",
        help="sample with the config's stochastic sampler as D3PO does online and keep every state, so D3PO can "
        "train on human labels of these pairs (objective.preference: human)",
    )
    args = p.parse_args(argv)
    try:
        from ..config import load_config

        if args.out.exists():
            raise FlowRLError(f"pairs directory '{args.out}' already exists; choose a new one.")
        pairs, rewards, dropped = build_pairs(
            load_config(args.config, args.overrides),
            args.num_prompts,
            torch.Generator().manual_seed(args.seed),
            trajectories=args.trajectories,
        )
        write_pairs(args.out, pairs, rewards)
    except FlowRLError as e:
        print(f"flowrl: error: {e}", file=sys.stderr)
        return 2
    gap = float((rewards[0] - rewards[1]).mean())
    print(json.dumps({"pairs": len(pairs), "dropped": dropped, "mean_reward_gap": round(gap, 6), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
