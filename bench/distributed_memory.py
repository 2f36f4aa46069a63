"""Per-GPU memory of the trained module under DDP, FSDP (full shard) and ZeRO, and the measured per-process
memory of a 2-process CPU run of flowrl with and without sharding.

1. The table (computed, no run): per-GPU bytes of the trained transformer's weights, gradients and AdamW state
   for FLUX.1-dev, SD3.5-Medium and Wan2.1-14B, LoRA and full fine-tuning, N GPUs. Mixed-precision accounting
   of the ZeRO paper (Rajbhandari et al. 2020, sec. 3.1): per trained parameter 2 bytes of bf16 weights, 2 of
   bf16 gradients and K = 12 of fp32 state (master weights, AdamW's m and v), 16 in all; a frozen parameter
   (LoRA's base) 2 bytes. DDP keeps everything on every GPU; ZeRO-2 shards gradients and the fp32 state;
   FSDP full shard and ZeRO-3 shard all of it (accelerate's FSDP2 keeps the trained weights in fp32 and casts
   to bf16 for compute: 4 + 4 + 8 = 16 bytes a parameter, the same total). Left out: activations, the gathered
   block FSDP holds while computing it, the frozen text encoders and VAE (never sharded; offloadable), and the
   KL reference copy of a full fine-tuning run with beta > 0 (2 bytes a parameter, not sharded by flowrl).
2. The measurement: the embedded digits model widened (``--width``: block channels [w, 2w], randomly
   initialised, so that its parameters and AdamW state dominate the process's memory) trained for one GRPO
   iteration as 1 process, 2 processes DDP, FSDP, DeepSpeed ZeRO-2 and ZeRO-3 (configs/accelerate/), CPU over
   gloo. Each process reports the bytes of its own parameters + gradients + AdamW state (exact, from its tensors;
   not for DeepSpeed, whose engine keeps gradients and fp32 master partitions in its own buffers) and its
   peak resident memory (ru_maxrss, which also counts the Python/torch runtime and the full weights every
   process loads before sharding) after loading, through training (rollouts, update, evaluation), and with
   the final checkpoint (under FSDP the main process gathers the whole model and AdamW state to write it).

    python bench/distributed_memory.py [--gpus 8] [--width 256] [--lora-rank 32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30

# Trained transformer sizes (published, rounded) and the attention projections flowrl's default LoRA targets
# (to_q, to_k, to_v, to_out.0) in each, as (count, d_in + d_out), from the models' diffusers configs.
MODELS = {
    "FLUX.1-dev": (11.9e9, [(19 * 4, 3072 + 3072), (38 * 3, 3072 + 3072)]),  # 19 double blocks, 38 single (no to_out)
    "SD3.5-Medium": (2.5e9, [(24 * 4, 1536 + 1536), (13 * 4, 1536 + 1536)]),  # 24 joint blocks, 13 with a second attention
    "Wan2.1-14B": (14.0e9, [(40 * 8, 5120 + 5120)]),  # 40 blocks, self- and cross-attention
}
BYTES_TRAINED, BYTES_FROZEN = 16, 2


def lora_parameters(projections: list[tuple[int, int]], rank: int) -> float:
    """A rank-r LoRA on a d_in -> d_out linear adds r * (d_in + d_out) parameters (A: r x d_in, B: d_out x r)."""
    return sum(count * rank * width for count, width in projections)


def per_gpu_bytes(trained: float, frozen: float, gpus: int) -> dict[str, float]:
    """Weights + gradients + optimizer state on one GPU, by strategy (module docstring)."""
    return {
        "DDP": BYTES_TRAINED * trained + BYTES_FROZEN * frozen,
        "ZeRO-2": (2 * trained + BYTES_FROZEN * frozen) + (BYTES_TRAINED - 2) * trained / gpus,
        "FSDP full shard": (BYTES_TRAINED * trained + BYTES_FROZEN * frozen) / gpus,
        "ZeRO-3": (BYTES_TRAINED * trained + BYTES_FROZEN * frozen) / gpus,
    }


def table(gpus: int, rank: int) -> str:
    rows = [
        "| model | mode | trained params | " + " | ".join(per_gpu_bytes(1, 0, gpus)) + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in per_gpu_bytes(1, 0, gpus)) + " |",
    ]
    for name, (total, projections) in MODELS.items():
        lora = lora_parameters(projections, rank)
        for mode, trained, frozen in (("full", total, 0.0), (f"LoRA r={rank}", lora, total)):
            cells = " | ".join(f"{v / GiB:.1f} GiB" for v in per_gpu_bytes(trained, frozen, gpus).values())
            rows.append(f"| {name} | {mode} | {trained / 1e6:,.0f} M | {cells} |")
    return "\n".join(rows)


# -- measurement -----------------------------------------------------------------------------------
def widened_model(width: int, directory: Path) -> Path:
    """The digits_flow model directory with its UNet widened to block channels [width, 2 * width] (random init)."""
    from diffusers import UNet2DConditionModel

    source = REPO / "flowrl" / "assets" / "digits_flow"
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("unet"))
    config = UNet2DConditionModel.load_config(str(source / "unet"))
    config.update(block_out_channels=[width, 2 * width], norm_num_groups=16, attention_head_dim=8)
    UNet2DConditionModel.from_config(config).save_pretrained(str(directory / "unet"))
    return directory


def worker(overrides: list[str], report: Path) -> None:
    """Run inside each launched process: one GRPO iteration, then this process's tensor bytes and peak RSS."""
    sys.path.insert(0, str(REPO))
    import torch

    from flowrl.config import load_config
    from flowrl.trainer import Trainer
    from flowrl.training.distributed import end_process_group

    torch.set_num_threads(1)
    trainer = Trainer(load_config(REPO / "configs" / "digits" / "grpo.yaml", overrides))

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    load_peak, peaks = peak(), []  # loading and sharding, before any step
    save = trainer.run.save

    def save_after_noting_the_peak():  # fit() saves last: the peak of rollouts, updates and evaluation comes first
        peaks.append(peak())
        return save()

    trainer.run.save = save_after_noting_the_peak
    trainer.fit()
    trainer.optimizer.zero_grad(set_to_none=False)  # gradients allocated as during a step (fit() leaves them freed or not by strategy)

    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for p in trainer.module.parameters()]
    state = [v for s in trainer.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    if trainer.deepspeed:  # the engine keeps gradients and fp32 master partitions in its own buffers: only RSS is comparable
        row = {
            "rank": trainer.rank,
            "world": trainer.world,
            "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
            "param_bytes": None,
            "grad_bytes": None,
            "adam_bytes": None,
            "load_peak_rss_bytes": load_peak,
            "train_peak_rss_bytes": peaks[0],
            "peak_rss_bytes": peak(),
        }
        with open(report, "a") as f:
            f.write(json.dumps(row) + "\n")
        end_process_group()
        return
    row = {
        "rank": trainer.rank,
        "world": trainer.world,
        "parameters": sum(p.numel() for p in params),
        "param_bytes": sum(local_bytes(p) for p in params),
        "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "adam_bytes": sum(local_bytes(v) for v in state),
        "load_peak_rss_bytes": load_peak,
        "train_peak_rss_bytes": peaks[0],
        "peak_rss_bytes": peak(),
    }
    with open(report, "a") as f:
        f.write(json.dumps(row) + "\n")
    end_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(model: Path, launch: str | None, scratch: Path) -> list[dict]:
    report = scratch / f"{launch or 'single'}.jsonl"
    overrides = [
        f"output_dir={scratch / (launch or 'single')}",
        f"pipeline.pretrained={model}",
        "train.iterations=1",
        "train.prompts_per_iteration=2",
        "train.num_generations=2",
        "train.batch_size=2",
        "rollout.num_inference_steps=2",
        "eval.every=0",
        "eval.samples_per_prompt=1",
        "log.checkpoint_every=0",
        "log.progress=false",
        "eval.judge=null",
    ]
    script = [str(Path(__file__).resolve()), "--worker", str(report), *overrides]
    if launch is None:
        cmd = [sys.executable, *script]
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(REPO / "configs" / "accelerate" / f"{launch}.yaml"),
            "--num_processes",
            "2",
            "--main_process_port",
            str(_free_port()),
            *script,
        ]
    # Every tensor of 128 KiB or more in its own mmap, returned to the OS when freed (glibc's adaptive threshold
    # otherwise moves freed buffers into the heap, where they stay resident): the peak is that of live memory.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"{launch or 'single'} run failed:\n{proc.stderr[-3000:]}")
    return sorted((json.loads(line) for line in report.read_text().splitlines()), key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--worker", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker[1:], Path(args.worker[0]))
    print(f"Per-GPU weights + gradients + AdamW state, N = {args.gpus} GPUs (GiB = 2^30 bytes):\n")
    print(table(args.gpus, args.lora_rank))
    if args.skip_measure:
        return
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model = widened_model(args.width, scratch / "model")
        results = {
            name: measure(model, launch, scratch)
            for name, launch in (
                ("1 process", None),
                ("2 processes DDP", "ddp"),
                ("2 processes FSDP", "fsdp"),
                ("2 processes ZeRO-2", "deepspeed_zero2"),
                ("2 processes ZeRO-3", "deepspeed_zero3"),
            )
        }
    n = results["1 process"][0]["parameters"]
    print(
        f"\nMeasured: digits UNet widened to [{args.width}, {2 * args.width}] channels ({n / 1e6:.1f} M parameters), one GRPO "
        "iteration, CPU (gloo), per process (MiB):\n"
    )
    print("| run | rank | params | grads | AdamW state | params + grads + AdamW | peak RSS: loading | + training | + checkpoint |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rows in results.items():
        for r in rows:
            mib = {k: "-" if r[k] is None else f"{r[k] / 2**20:.0f}" for k in ("param_bytes", "grad_bytes", "adam_bytes")}
            total = "-" if r["param_bytes"] is None else f"{(r['param_bytes'] + r['grad_bytes'] + r['adam_bytes']) / 2**20:.0f}"
            print(
                f"| {name} | {r['rank']} | {mib['param_bytes']} | {mib['grad_bytes']} | {mib['adam_bytes']} | "
                f"{total} | {r['load_peak_rss_bytes'] / 2**20:.0f} | {r['train_peak_rss_bytes'] / 2**20:.0f} | "
                f"{r['peak_rss_bytes'] / 2**20:.0f} |"
            )
    state = {
        k: max(r["param_bytes"] + r["grad_bytes"] + r["adam_bytes"] for r in v)
        for k, v in results.items()
        if v[0]["param_bytes"] is not None
    }
    print(f"\nFSDP / DDP per process: params + grads + AdamW {state['2 processes FSDP'] / state['2 processes DDP']:.2f}x")
    for name in ("2 processes FSDP", "2 processes ZeRO-2", "2 processes ZeRO-3"):
        ratio = {}
        for key in ("train_peak_rss_bytes", "peak_rss_bytes"):
            per_rank = [f[key] / d[key] for f, d in zip(results[name], results["2 processes DDP"])]
            ratio[key] = ", ".join(f"rank {i} {x:.2f}x" for i, x in enumerate(per_rank))
        print(
            f"{name.split()[-1]} / DDP per process: peak RSS through training {ratio['train_peak_rss_bytes']}; "
            f"with the checkpoint {ratio['peak_rss_bytes']} (same run)"
        )


if __name__ == "__main__":
    main()
