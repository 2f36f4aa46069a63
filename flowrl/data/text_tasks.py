"""Text tasks for diffusion language models: d1's prompts and loaders for the shared data files
(``flowrl/evaluation/recorded.py`` grades recorded generations of them).

Loaders return ``list[(prompt, metadata)]`` where ``prompt`` is the *user message* (d1 puts its
instructions in the user turn; the model adapter applies the chat template) and ``metadata`` is what
the matching reward reads:

==========  ============================================  =======================
loader      metadata                                      reward
==========  ============================================  =======================
gsm8k       ``{"answer": "18"}``                           ``math_answer``
math500     ``{"answer": "16 \\sqrt{3}"}``                 ``math_answer``
countdown   ``{"numbers": [30, 100, 93], "target": 23}``   ``countdown``
sudoku      ``{"puzzle": "3102...", "solution": "3142..."}``  ``sudoku``
==========  ============================================  =======================

d1's evaluation appends ``REASONING_PREFILL`` (``"<reasoning>"``) to the templated prompt, so its
recorded completions start inside the reasoning; use ``FormatReward(reasoning_prefilled=True)`` then.

The data directory is ``$FLOWRL_DATA_DIR`` if set, else ``<repo>/../shared/data``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from flowrl.errors import FlowRLError

Example = tuple[str, dict[str, Any]]
Style = Literal["train", "eval"]

GSM8K_FILE = "gsm8k_test_llada8b_instruct_gen256.jsonl"
MATH500_FILE = "math500_test_llada8b_instruct_gen256.jsonl"
COUNTDOWN_FILE = "countdown_cd3_test.jsonl"
SUDOKU_FILE = "sudoku_4x4_test.csv"
RECORDED_FIELD = "llada_generation_256"

# ---------------------------------------------------------------------------------------------
# d1's prompts (dllm-reasoning/d1: diffu-grpo/data_utils.py for training, eval/*.py for evaluation)
# ---------------------------------------------------------------------------------------------

# Training (diffu-grpo): prepended to every question.
SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

# Evaluation of GSM8K and MATH500 (the prompt the recorded LLaDA generations answered).
# (d1's text has a space before the first newline; kept, written out so no line ends in whitespace.)
MATH_EVAL_SYSTEM_PROMPT = (
    "You are a math expert. You will be given a question to solve. Solve it step by step. "
    "Wrap the final answer in a \\boxed{}. \n"
    "Respond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>"
)

# Training prefix d1 uses for MATH after SYSTEM_PROMPT.
MATH_TRAIN_INSTRUCTION = (
    "You are a math expert. You will be given a question to solve. Solve it step by step. Wrap the final answer in a \\boxed{}. "
)

SUDOKU_SYSTEM_PROMPT = """
Please solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading left-to-right, top-to-bottom, where '0' represents empty cells.

Rules:
- Fill empty cells with digits 1-4
- Each row must contain digits 1-4 exactly once
- Each column must contain digits 1-4 exactly once
- Each 2x2 box must contain digits 1-4 exactly once

Important: Your solution must be a COMPLETE 16-character string with only the digits 1-4, representing your final solved grid.

Respond in this exact format:
<reasoning>
Your step-by-step solving process
</reasoning>
<answer>
[16-character solution string with no spaces or separators]
</answer>
"""

# Training (diffu-grpo): SYSTEM_PROMPT, then this with the numbers as a Python list and the target.
COUNTDOWN_TRAIN_TEMPLATE = (
    "Using only the numbers {numbers}, create an arithmetic expression that evaluates to exactly {target}. "
    "You must use all numbers from the list, and each number must be used exactly once. You may use the "
    "operations +, -, *, and / as needed. After reasoning, provide only your final expression inside "
    "<answer></answer> tags without including an equals sign or the target number. For example, if the "
    "numbers are [2, 3, 4] and the target is 5, a valid answer is: <answer>\n2*4-3\n</answer>"
)

# Evaluation (eval/countdown.py): system prompt, then "Numbers: [..]\nTarget: t".
COUNTDOWN_EVAL_SYSTEM_PROMPT = (
    "Using only the provided numbers, create an arithmetic expression that evaluates to exactly the provided "
    "target number. You may use the operations +, -, *, and / as needed, but each number must be used exactly "
    "once. Think step-by-step. After reasoning, provide only your final expression inside \\boxed{} tags "
    "without including an equals sign or the target number. For example: \\boxed{a + b * c}"
    "Respond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n<answer>\n\\boxed{...}\n</answer>"
)

REASONING_PREFILL = "<reasoning>"


def _check_style(style: str) -> None:
    if style not in ("train", "eval"):
        raise FlowRLError(f"prompt style must be 'train' or 'eval', got '{style}'.")


def gsm8k_prompt(question: str, style: Style = "eval") -> str:
    _check_style(style)
    head = SYSTEM_PROMPT if style == "train" else MATH_EVAL_SYSTEM_PROMPT
    return f"{head}\n\n{question}"


def math_prompt(question: str, style: Style = "eval") -> str:
    _check_style(style)
    if style == "train":
        return f"{SYSTEM_PROMPT}\n\n{MATH_TRAIN_INSTRUCTION}\n\n{question}"
    return f"{MATH_EVAL_SYSTEM_PROMPT}\n\n{question}"


def countdown_prompt(numbers: Sequence[int], target: int, style: Style = "eval") -> str:
    _check_style(style)
    numbers = list(numbers)
    if style == "train":
        return f"{SYSTEM_PROMPT}\n" + COUNTDOWN_TRAIN_TEMPLATE.format(numbers=numbers, target=target)
    return f"{COUNTDOWN_EVAL_SYSTEM_PROMPT}\n\nNumbers: {numbers}\nTarget: {target}"


def sudoku_prompt(puzzle: str) -> str:
    return f"{SUDOKU_SYSTEM_PROMPT}\n\nSolve the following Sudoku puzzle: {puzzle}\n"


# ---------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    env = os.environ.get("FLOWRL_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _resolve(path: str | os.PathLike | None, default_name: str) -> Path:
    p = Path(path) if path is not None else default_data_dir() / default_name
    if not p.is_file():
        raise FlowRLError(f"data file not found: {p} (set FLOWRL_DATA_DIR or pass a path).")
    return p


def read_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows


def format_gold(value: Any) -> str | None:
    """A gold answer as a string: 18.0 -> "18", 2.5 -> "2.5", LaTeX strings unchanged, None/NaN -> None."""
    if value is None:
        return None
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    s = str(value).strip()
    return s or None


def _math_examples(path: Path, limit: int | None, style: Style, prompt_fn) -> list[Example]:
    out = []
    for row in read_jsonl(path, limit):
        gold = format_gold(row.get("ground_truth"))
        if gold is None:  # two GSM8K rows of the recorded file lost their (negative) gold answer
            continue
        out.append((prompt_fn(row["question"], style), {"answer": gold}))
    return out


def load_gsm8k(path: str | os.PathLike | None = None, limit: int | None = None, style: Style = "eval") -> list[Example]:
    """GSM8K test questions -> (prompt, {"answer": "18"}); rows without a gold answer are skipped."""
    _check_style(style)
    return _math_examples(_resolve(path, GSM8K_FILE), limit, style, gsm8k_prompt)


def load_math500(path: str | os.PathLike | None = None, limit: int | None = None, style: Style = "eval") -> list[Example]:
    """MATH500 -> (prompt, {"answer": LaTeX gold})."""
    _check_style(style)
    return _math_examples(_resolve(path, MATH500_FILE), limit, style, math_prompt)


def load_countdown(path: str | os.PathLike | None = None, limit: int | None = None, style: Style = "eval") -> list[Example]:
    """d1's cd3 test set ({"input": "30,100,93", "output": "23"}) -> (prompt, {"numbers": [...], "target": int})."""
    _check_style(style)
    out = []
    for row in read_jsonl(_resolve(path, COUNTDOWN_FILE), limit):
        numbers = [int(n) for n in str(row["input"]).split(",")]
        target = int(row["output"])
        out.append((countdown_prompt(numbers, target, style), {"numbers": numbers, "target": target}))
    return out


def load_sudoku(path: str | os.PathLike | None = None, limit: int | None = None) -> list[Example]:
    """4x4 Sudoku CSV (Puzzle, Solution; 16 digits, 0 = empty) -> (prompt, {"puzzle", "solution"}) as strings."""
    out = []
    with open(_resolve(path, SUDOKU_FILE), newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(out) >= limit:
                break
            puzzle, solution = row["Puzzle"].strip(), row["Solution"].strip()
            out.append((sudoku_prompt(puzzle), {"puzzle": puzzle, "solution": solution}))
    return out
