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

import json
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ...data.arith import COMPLETION_LEN, PROMPT_LEN, build_tokenizer, problems, vocabulary
from .training import ASSETS, loss_ema, optimizer_step, parse_training_arguments, save_model, training_parser, warmup_cosine


def bidirectional_lm(vocab_size: int, positions: int, hidden: int = 128, layers: int = 4, heads: int = 4):
    """The embedded masked-diffusion LMs' architecture: a BertForMaskedLM (bidirectional attention, no dropout)."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=positions,
        type_vocab_size=1,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def build_model(hidden: int = 128, layers: int = 4, heads: int = 4):
    """arith_mdlm's architecture, a bidirectional BertForMaskedLM (the shipped size by default; flowrl tiny builds it
    smaller)."""
    return bidirectional_lm(len(vocabulary()), PROMPT_LEN + COMPLETION_LEN, hidden, layers, heads)


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


def masked_completion_loss(
    model, tokenizer, x: torch.Tensor, attention_mask: torch.Tensor, gen: torch.Generator, prompt_len: int = PROMPT_LEN
) -> torch.Tensor:
    """LLaDA's SFT loss on a batch of encoded problems (``prompt_len`` prompt tokens, then the completion): each
    completion token masked with probability t ~ U(0, 1) (at least one per row), the prompt never; the mean
    cross-entropy of the masked tokens. (The Sudoku LM's script shares it with its own prompt length.)"""
    batch_size, completion_len = x.shape[0], x.shape[1] - prompt_len
    t = torch.rand(batch_size, 1, generator=gen)
    masked = torch.rand(batch_size, completion_len, generator=gen) < t
    masked[torch.arange(batch_size), torch.randint(0, completion_len, (batch_size,), generator=gen)] = True
    masked = torch.cat([torch.zeros(batch_size, prompt_len, dtype=torch.bool), masked], dim=1)
    logits = model(input_ids=torch.where(masked, tokenizer.mask_token_id, x), attention_mask=attention_mask).logits
    return torch.nn.functional.cross_entropy(logits[masked], x[masked])


def fit_on_problems(
    out: Path, name: str, make_model, batch_loss, settings: dict[str, Any], extra: dict[str, Any], command: str, encoded=None
) -> dict[str, Any]:
    """Train a math LM on the (flawed) SFT solutions and write it with its tokenizer into ``out``: the loop both
    embedded math LMs share. ``make_model()`` builds the model once the seed is set (its initial weights);
    ``batch_loss(model, tokenizer, ids, attention_mask, gen)`` noises a batch of encoded problems and returns the
    loss; ``settings``: steps, batch_size, lr, seed, train_problems and flaw_rate; ``extra``: the script's own
    training_info entries. ``encoded()``: another task's (tokenizer, input_ids, attention_mask) to train on instead
    (sudoku_bd3lm's puzzles; it must not draw from torch's generator). Returns the training_info written."""
    steps, batch_size, seed = settings["steps"], settings["batch_size"], settings["seed"]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if encoded is None:
        tokenizer = build_tokenizer()
        ids, attn = encode(tokenizer, problems("train", settings["train_problems"], seed, settings["flaw_rate"]))
    else:
        tokenizer, ids, attn = encoded()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.01)
    sched = warmup_cosine(opt, steps, warmup=max(1, steps // 20))
    start, ema = time.time(), None
    for _ in (bar := tqdm(range(steps), desc=f"train {name}")):
        idx = torch.randint(0, ids.shape[0], (batch_size,), generator=gen)
        loss = batch_loss(model, tokenizer, ids[idx], attn[idx], gen)
        optimizer_step(loss, opt, sched, clip=model.parameters())
        ema = loss_ema(ema, loss)
        bar.set_postfix(loss=f"{ema:.3f}")
    info = {**settings, **extra, "final_loss_ema": ema, "train_seconds": round(time.time() - start, 1), "command": command}
    save_model(out, [("", model), ("", tokenizer)], info)  # one directory holding model and tokenizer, like a hub checkpoint
    print(json.dumps(info))
    return info


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, num_problems: int, flaw_rate: float) -> None:
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "train_problems": num_problems, "flaw_rate": flaw_rate}
    command = f"python -m flowrl.pipelines.embedded.train_arith --steps {steps} --seed {seed} --flaw-rate {flaw_rate}"
    fit_on_problems(out, "arith_mdlm", build_model, masked_completion_loss, settings, {}, command)


def main() -> None:
    p = training_parser(__doc__, out=ASSETS / "arith_mdlm", steps=1000, batch_size=128, lr=1e-3, threads=2)
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--flaw-rate", type=float, default=0.3, help="fraction of SFT solutions whose final answer is one off")
    a = parse_training_arguments(p)
    train(a.out, a.steps, a.batch_size, a.lr, a.seed, a.problems, a.flaw_rate)


if __name__ == "__main__":
    main()
