"""Train the embedded text-to-digit generators and write them where flowrl ships them.

    python -m flowrl.pipelines.embedded.train_digits --kind flow --out flowrl/assets/digits_flow
    python -m flowrl.pipelines.embedded.train_digits --kind ddpm --out flowrl/assets/digits_ddpm

``flow``: rectified flow, velocity target ``noise - x0`` at ``x = (1 - sigma) x0 + sigma noise``.
``ddpm``: DDPM (linear betas 1e-4..0.02, T = 1000), epsilon target.
Both drop the prompt 10% of the time so classifier-free guidance works. The output directory has
the diffusers/transformers layout (unet/, text_encoder/, tokenizer/, scheduler/), weights in
safetensors, and loads through flowrl's own loading path (``flowrl.pipelines.digits``).
Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...atomic_files import atomic_directory
from ...data.digits import EVAL_TEMPLATES, MAX_PROMPT_TOKENS, TRAIN_TEMPLATES, build_tokenizer, load_digit_images, prompt_for
from ...samplers.forward_process import flow_noised, vp_noised
from .digits_models import build_text_encoder, build_unet

CFG_DROPOUT = 0.1


def make_scheduler(kind: str):
    from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

    if kind == "flow":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    return DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="linear", beta_start=1e-4, beta_end=0.02, prediction_type="epsilon", clip_sample=False
    )


def training_batch(images, labels, tokenizer, batch_size, gen):
    idx = torch.randint(0, images.shape[0], (batch_size,), generator=gen)
    templates = TRAIN_TEMPLATES + EVAL_TEMPLATES
    t_idx = torch.randint(0, len(templates), (batch_size,), generator=gen).tolist()
    drop = (torch.rand(batch_size, generator=gen) < CFG_DROPOUT).tolist()
    prompts = ["" if d else prompt_for(int(labels[i]), templates[t]) for i, t, d in zip(idx.tolist(), t_idx, drop)]
    ids = tokenizer(prompts, padding="max_length", max_length=MAX_PROMPT_TOKENS, truncation=True, return_tensors="pt").input_ids
    return images[idx], ids


def loss_fn(kind, unet, text_encoder, scheduler, x0, ids, gen):
    b = x0.shape[0]
    noise = torch.randn(x0.shape, generator=gen)
    ctx = text_encoder(ids).last_hidden_state
    if kind == "flow":
        sigma = torch.rand(b, generator=gen)
        x, target = flow_noised(x0, noise, sigma.view(b, 1, 1, 1))
        pred = unet(x, sigma * scheduler.config.num_train_timesteps, ctx).sample
    else:
        t = torch.randint(0, scheduler.config.num_train_timesteps, (b,), generator=gen)
        x, target = vp_noised(x0, noise, scheduler.alphas_cumprod[t].float().view(b, 1, 1, 1))
        pred = unet(x, t, ctx).sample
    return torch.nn.functional.mse_loss(pred, target)


def train(kind: str, out: Path, steps: int, batch_size: int, lr: float, seed: int) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    images, labels = load_digit_images()
    tokenizer = build_tokenizer()
    unet, text_encoder, scheduler = build_unet(), build_text_encoder(), make_scheduler(kind)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    warmup = max(1, steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc=f"train digits_{kind}")
    for _ in bar:
        x0, ids = training_batch(images, labels, tokenizer, batch_size, gen)
        loss = loss_fn(kind, unet, text_encoder, scheduler, x0, ids, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.4f}")
    info = {
        "kind": kind,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "final_loss_ema": ema,
        "train_seconds": round(time.time() - start, 1),
        "command": f"python -m flowrl.pipelines.embedded.train_digits --kind {kind} --steps {steps} --seed {seed}",
    }
    with atomic_directory(out) as tmp:  # a crash never leaves a half-written model
        unet.save_pretrained(tmp / "unet")
        text_encoder.save_pretrained(tmp / "text_encoder")
        tokenizer.save_pretrained(tmp / "tokenizer")
        scheduler.save_pretrained(tmp / "scheduler")
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=["flow", "ddpm"], required=True)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    out = a.out or Path(__file__).resolve().parents[2] / "assets" / f"digits_{a.kind}"
    train(a.kind, out, a.steps, a.batch_size, a.lr, a.seed)


if __name__ == "__main__":
    main()
