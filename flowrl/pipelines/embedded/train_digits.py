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

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ...data.digits import EVAL_TEMPLATES, MAX_PROMPT_TOKENS, TRAIN_TEMPLATES, build_tokenizer, load_digit_images, prompt_for
from ...samplers.forward_process import flow_noised, vp_noised
from .digits_models import build_text_encoder, build_unet
from .training import ASSETS, loss_ema, optimizer_step, parse_training_arguments, save_model, training_parser, warmup_cosine

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
    sched = warmup_cosine(opt, steps, warmup=max(1, steps // 50))
    start, ema = time.time(), None
    bar = tqdm(range(steps), desc=f"train digits_{kind}")
    for _ in bar:
        x0, ids = training_batch(images, labels, tokenizer, batch_size, gen)
        loss = loss_fn(kind, unet, text_encoder, scheduler, x0, ids, gen)
        optimizer_step(loss, opt, sched, clip=params)
        ema = loss_ema(ema, loss)
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
    parts = [("unet", unet), ("text_encoder", text_encoder), ("tokenizer", tokenizer), ("scheduler", scheduler)]
    save_model(out, parts, info)
    print(json.dumps(info))


def main() -> None:
    p = training_parser(__doc__, out=None, steps=3000, batch_size=128, lr=2e-3)
    p.add_argument("--kind", choices=["flow", "ddpm"], required=True)
    a = parse_training_arguments(p)
    out = a.out or ASSETS / f"digits_{a.kind}"
    train(a.kind, out, a.steps, a.batch_size, a.lr, a.seed)


if __name__ == "__main__":
    main()
