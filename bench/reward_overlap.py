"""Reward scoring overlapped with the rollout (``rollout.overlap_reward``, issue #29 item 3), with a slow reward.

The reward is flowrl's ``clip_score`` on a CLIP ViT-B/32 at its real size (transformers ``CLIPModel`` with the
default ``CLIPConfig``: a 12-layer 768-wide vision tower on 224 px inputs and a 12-layer 512-wide text tower, 151 M
parameters), random weights, saved with ``save_pretrained`` and loaded back through the reward's own path; the
policy is the embedded digits model of ``digits/grpo``. Two runs from the same seed, their iterations interleaved
so that they share the machine's load alike:

- ``serial``: the default loop (rollout, then decode + reward of the whole batch), 1 intra-op thread;
- ``overlap``: rollout.overlap_reward=true, 1 intra-op thread for the rollout and 1 for the reward's worker.

Prints each iteration's perf/* split, its wall time (evaluation excluded) and the process's CPU time over all its
threads (the same work either way: the overlap can only shorten the wall time when a core is free), the median
seconds per iteration of each run, the ratio, and whether the runs' final weights are bit-identical (and if not, by how much they differ).

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/reward_overlap.py [--iterations 4] [--chunk 8] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

KEYS = ("perf/rollout_s", "perf/decode_s", "perf/score_s", "perf/reward_wait_s", "perf/reward_hidden_s", "perf/update_s")


def build_clip(directory: Path) -> None:
    """A real-size CLIP ViT-B/32 with random weights and a processor (CLIP's image processor, the digits tokenizer)."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    from flowrl.data.digits import build_tokenizer

    try:  # transformers 5.x without torchvision: the PIL backend, explicitly
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # transformers 4.x
        from transformers import CLIPImageProcessor as ImageProcessor

    tokenizer = build_tokenizer()
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(text_config=dict(vocab_size=len(tokenizer), **ids))  # every other size is CLIP ViT-B/32's
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(str(directory))
    CLIPProcessor(image_processor=ImageProcessor(), tokenizer=tokenizer).save_pretrained(str(directory))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4, help="measured iterations per run (after one warm-up)")
    parser.add_argument("--chunk", type=int, default=8, help="rollout.batch_size: samples per rollout chunk")
    parser.add_argument("--prompts", type=int, default=4, help="train.prompts_per_iteration (8 samples each)")
    parser.add_argument("--steps", type=int, default=10, help="rollout.num_inference_steps (the preset's 10)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="flowrl_overlap_") as directory:  # the CLIP weights: about 0.5 GB
        run(args, Path(directory))


def run(args: argparse.Namespace, tmp: Path) -> None:
    from flowrl import Trainer, load_config
    from flowrl.reward_models.clip_score import ClipScoreReward

    build_clip(tmp / "clip")
    reward = ClipScoreReward(pretrained=str(tmp / "clip"))  # one model, shared by the runs (they take turns)
    runs = {"serial": (False, 1), "overlap": (True, 1)}
    trainers = {}
    for name, (overlap, _) in runs.items():
        overrides = [
            f"output_dir={tmp / name}",
            f"train.iterations={args.iterations + 1}",
            f"train.prompts_per_iteration={args.prompts}",
            f"rollout.batch_size={args.chunk}",
            f"rollout.num_inference_steps={args.steps}",
            f"rollout.overlap_reward={str(overlap).lower()}",
            "eval.every=0",
            "log.checkpoint_every=0",
            "log.progress=false",
        ]
        trainers[name] = Trainer(load_config("digits/grpo", overrides), reward={"clip_score": reward})
    totals: dict[str, list[float]] = {name: [] for name in runs}
    samples = args.prompts * 8
    print(
        f"# {samples} samples per iteration in chunks of {args.chunk}, {args.steps} steps; "
        f"reward: clip_score on CLIP ViT-B/32 (real size, random); {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print("run        it  " + "  ".join(k.removeprefix("perf/") for k in KEYS) + "  total_s  cpu_s")
    for iteration in range(args.iterations + 1):
        for name, (_, threads) in runs.items():
            torch.set_num_threads(threads)
            cpu = time.process_time()
            m = trainers[name].train_iteration(iteration)
            cpu = time.process_time() - cpu  # every thread of the process: the work, however it was spread
            total = m["perf/rollout_s"] + m["perf/reward_wait_s"] + m["perf/update_s"]
            if iteration:  # the first iteration loads the reward model (shared) and warms up
                totals[name].append(total)
            print(f"{name:<10} {iteration:>2}  " + "  ".join(f"{m[k]:>{len(k) - 5}.2f}" for k in KEYS) + f"  {total:7.2f}  {cpu:5.2f}")
    base = statistics.median(totals["serial"])
    for name in runs:
        med = statistics.median(totals[name])
        print(f"{name:<10} median {med:6.2f} s/iteration   ratio to serial {med / base:.3f}")
    serial, overlap = (trainers[name].module.state_dict() for name in runs)
    same = all(torch.equal(serial[k], overlap[k]) for k in serial)
    diff = max(float((serial[k].float() - overlap[k].float()).abs().max()) for k in serial)
    print(f"final weights bit-identical: {same} (largest difference {diff:.3g})")


if __name__ == "__main__":
    main()
