"""Train the embedded masked-diffusion math LM and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_arith [--steps 1000] [--flaw-rate 0.3] [--out flowrl/assets/arith_mdlm]

The model is a tiny ``transformers.BertForMaskedLM`` (bidirectional attention) trained as a masked
diffusion LM in LLaDA's SFT form: the prompt is never masked; each completion token is masked with
probability t ~ U(0, 1) (at least one), and the loss is the cross-entropy of the masked tokens (their
plain mean; LLaDA's 1/t weighting gives the same minimiser with more variance at this scale).

The SFT data is deliberately imperfect: in 30% of the solutions the working is right but the answer
written in the tags is one off (``flowrl.data.arith.off_by_one``). The model learns that habit (about a quarter
of its greedy answers are one off), and an answer-correctness reward can remove it: a systematic
mistake is what RL fixes quickly. Making the arithmetic itself better is what it does not do at this
scale on a CPU (measured: docs/objectives/dllm.md).

Writes the model, its tokenizer and ``training_info.json`` into one directory; deterministic for a seed and thread count.
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
from ...data.arith import COMPLETION_LEN, PROMPT_LEN, build_tokenizer, problems, vocabulary


def build_model():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=len(vocabulary()),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=PROMPT_LEN + COMPLETION_LEN,
        type_vocab_size=1,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def encode(tokenizer, pairs):
    """(input_ids (N, P+G), attention_mask (N, P+G)) with left-padded prompts and [EOS]-padded completions."""
    prompts = tokenizer([p for p, _ in pairs], padding="max_length", max_length=PROMPT_LEN, truncation=True, return_tensors="pt")
    tokenizer.padding_side = "right"
    comps = tokenizer(
        [m["solution"] for _, m in pairs], padding="max_length", max_length=COMPLETION_LEN, truncation=True, return_tensors="pt"
    )
    tokenizer.padding_side = "left"
    comp_ids = torch.where(comps.attention_mask.bool(), comps.input_ids, tokenizer.eos_token_id)
    ids = torch.cat([prompts.input_ids, comp_ids], dim=1)
    mask = torch.cat([prompts.attention_mask, torch.ones_like(comp_ids)], dim=1)
    return ids, mask


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, num_problems: int, flaw_rate: float) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    tokenizer = build_tokenizer()
    ids, attn = encode(tokenizer, problems("train", num_problems, seed, flaw_rate))
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )
    start, ema = time.time(), None
    for _ in (bar := tqdm(range(steps), desc="train arith_mdlm")):
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        x, a = ids[idx], attn[idx]
        t = torch.rand(batch_size, 1, generator=gen)
        masked = torch.rand(batch_size, COMPLETION_LEN, generator=gen) < t
        masked[torch.arange(batch_size), torch.randint(0, COMPLETION_LEN, (batch_size,), generator=gen)] = True
        masked = torch.cat([torch.zeros(batch_size, PROMPT_LEN, dtype=torch.bool), masked], dim=1)
        logits = model(input_ids=torch.where(masked, tokenizer.mask_token_id, x), attention_mask=a).logits
        loss = torch.nn.functional.cross_entropy(logits[masked], x[masked])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    info = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_problems": num_problems,
        "flaw_rate": flaw_rate,
        "final_loss_ema": ema,
        "train_seconds": round(time.time() - start, 1),
        "command": f"python -m flowrl.pipelines.embedded.train_arith --steps {steps} --seed {seed} --flaw-rate {flaw_rate}",
    }
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)  # one directory holding model and tokenizer, like a hub checkpoint
        tokenizer.save_pretrained(tmp)
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "assets" / "arith_mdlm")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--flaw-rate", type=float, default=0.3, help="fraction of SFT solutions whose final answer is one off")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    train(a.out, a.steps, a.batch_size, a.lr, a.seed, a.problems, a.flaw_rate)


if __name__ == "__main__":
    main()
