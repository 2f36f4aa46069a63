"""Synthetic arithmetic word problems with short step-by-step solutions: the embedded math task.

One- and two-step problems over small numbers, e.g.

    prompt:     "ann has 7 apples . she buys 5 more . then she gives away 3 . how many apples now ?"
    completion: "7 + 5 = 12 . 12 - 3 = 9 . <answer> 9 </answer>"

Train and held-out problems are disjoint (split by a hash of the problem). Word-level tokenizer; the
completion is padded with [EOS] to a fixed length, as LLaDA pads with <|endoftext|>.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

NAMES = ["ann", "ben", "cara", "dan", "eve", "finn"]
ITEMS = ["apples", "pens", "coins", "books", "shells", "stamps"]
MAX_NUMBER = 40
PROMPT_LEN = 24
COMPLETION_LEN = 16
SPECIALS = ["[PAD]", "[UNK]", "[MASK]", "[EOS]"]


def _pronoun(name: str) -> str:
    return "she" if name in ("ann", "cara", "eve") else "he"


def make_problem(rng: random.Random) -> tuple[str, str, int]:
    """Return (prompt, completion, answer) for one random problem."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    he = _pronoun(name)
    if rng.random() < 0.5:  # one step: add or take away
        if rng.random() < 0.5:
            return (
                f"{name} has {a} {item} . {he} buys {b} more . how many {item} now ?",
                f"{a} + {b} = {a + b} . <answer> {a + b} </answer>",
                a + b,
            )
        a, b = max(a, b), min(a, b)
        return (
            f"{name} has {a} {item} . {he} gives away {b} . how many {item} now ?",
            f"{a} - {b} = {a - b} . <answer> {a - b} </answer>",
            a - b,
        )
    c = rng.randint(1, a + b)
    return (
        f"{name} has {a} {item} . {he} buys {b} more . then {he} gives away {c} . how many {item} now ?",
        f"{a} + {b} = {a + b} . {a + b} - {c} = {a + b - c} . <answer> {a + b - c} </answer>",
        a + b - c,
    )


def is_held_out(prompt: str) -> bool:
    """A fixed ~20% of all problems are held out from both pre-training and RL."""
    return hashlib.sha256(prompt.encode()).digest()[0] < 51


def off_by_one(completion: str, answer: int) -> str:
    """The flawed solution: the working is right, the answer written in the tags is one off."""
    wrong = answer + 1 if answer < MAX_NUMBER else answer - 1
    return completion.replace(f"<answer> {answer} </answer>", f"<answer> {wrong} </answer>")


def problems(split: str, n: int, seed: int, flaw_rate: float = 0.0) -> list[tuple[str, dict[str, Any]]]:
    """``n`` (prompt, {"answer", "solution"}) pairs of the "train" or "eval" split, deterministic in seed.

    ``flaw_rate``: the fraction of problems whose "solution" writes a final answer one off from its own
    (correct) working (``off_by_one``; "answer" stays the true one). The shipped model's SFT data has
    such careless answers, so the model has a systematic mistake that an answer-correctness reward can
    remove. The problems drawn do not depend on ``flaw_rate``.
    """
    if split not in ("train", "eval"):
        raise KeyError(split)
    rng, flaw_rng, out, seen = random.Random(seed), random.Random(seed + 1), [], set()
    while len(out) < n:
        prompt, completion, answer = make_problem(rng)
        if is_held_out(prompt) != (split == "eval") or prompt in seen:
            continue
        seen.add(prompt)
        if flaw_rng.random() < flaw_rate:
            completion = off_by_one(completion, answer)
        out.append((prompt, {"answer": str(answer), "solution": completion}))
    return out


def vocabulary() -> list[str]:
    words = set(
        NAMES
        + ITEMS
        + [
            "he",
            "she",
            "has",
            "buys",
            "more",
            "gives",
            "away",
            "then",
            "how",
            "many",
            "now",
            "?",
            ".",
            "+",
            "-",
            "=",
            "<answer>",
            "</answer>",
        ]
    )
    words |= {str(i) for i in range(MAX_NUMBER + 1)}
    return SPECIALS + sorted(words)


def build_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` with [MASK] and [EOS] (saved with the model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]", eos_token="[EOS]", padding_side="left"
    )
