"""Rule-based puzzle rewards for diffusion language models (d1's Countdown and 4x4 Sudoku tasks).

``samples`` is a list of completion strings. The answer is read with
``flowrl.reward_models.math_answer.extract_answer``: a boxed expression inside the last
``<answer>...</answer>`` block, else the whole last answer block, else the last ``\\boxed{}`` anywhere
(``extract_answer(..., prefer_answer_tags=True)``; d1's training
prompts ask for ``<answer>`` tags, its evaluation prompts for ``\\boxed{}`` inside them; both are read).

Countdown never calls ``eval``: the expression is parsed with ``ast`` and only numbers, ``+ - * /``,
unary signs and parentheses are accepted; it is evaluated with exact fractions.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

from flowrl.errors import FlowRLError
from flowrl.reward_models.math_answer import completion_texts, extract_answer
from flowrl.types import RewardOutput

MAX_EXPRESSION_CHARS = 200

_OPERATOR_SPELLINGS = (
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\u00d7", "*"),  # multiplication sign
    ("\u22c5", "*"),  # dot operator
    ("\u00b7", "*"),  # middle dot
    ("\\div", "/"),
    ("\u00f7", "/"),  # division sign
    ("\u2212", "-"),  # minus sign
    ("\\left", ""),
    ("\\right", ""),
    ("$", ""),
)


class _NotArithmetic(Exception):
    """The text is not an expression of numbers, + - * / and parentheses."""


def _normalise_expression(text: str, allow_trailing_equals: bool) -> str:
    expr = text.strip()
    for spelling, op in _OPERATOR_SPELLINGS:
        expr = expr.replace(spelling, op)
    expr = expr.replace("{", "(").replace("}", ")")
    if allow_trailing_equals and expr.count("=") == 1:
        lhs, rhs = expr.split("=")
        if re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", rhs):
            expr = lhs  # "30 + 93 - 100 = 23": the left side is the answer
    return expr.strip().rstrip(".").strip()


def parse_arithmetic(text: str) -> tuple[ast.expr, list[Fraction]]:
    """Parse ``text`` as an arithmetic expression; return its AST body and the numbers it uses.

    Raises ``_NotArithmetic`` for anything else (names, calls, attributes, strings, ``**``, ``//``, ...).
    """
    if len(text) > MAX_EXPRESSION_CHARS or not text:
        raise _NotArithmetic("empty or too long")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise _NotArithmetic(str(e)) from e
    numbers: list[Fraction] = []

    def check(node: ast.AST) -> None:
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
                raise _NotArithmetic(f"operator {type(node.op).__name__}")
            check(node.left)
            check(node.right)
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                raise _NotArithmetic(f"operator {type(node.op).__name__}")
            check(node.operand)
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _NotArithmetic(f"constant {v!r}")
            numbers.append(Fraction(v))
        else:
            raise _NotArithmetic(f"syntax {type(node).__name__}")

    check(tree.body)
    return tree.body, numbers


def _evaluate(node: ast.expr) -> Fraction:
    """Exact value of an expression that ``parse_arithmetic`` accepted (ZeroDivisionError propagates)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        v = _evaluate(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    assert isinstance(node, ast.BinOp)
    a, b = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        return a + b
    if isinstance(node.op, ast.Sub):
        return a - b
    if isinstance(node.op, ast.Mult):
        return a * b
    return a / b


def safe_evaluate(text: str) -> float | None:
    """The value of an arithmetic expression, or None if it is not one (or divides by zero). Never eval()s."""
    try:
        node, _ = parse_arithmetic(text)
        return float(_evaluate(node))
    except (_NotArithmetic, ZeroDivisionError):
        return None


class CountdownReward:
    """Countdown (d1 "cd3"): build ``metadata["target"]`` from ``metadata["numbers"]``, each used exactly once.

    Score of one completion:

    * 1.0 if the answer is an arithmetic expression that uses each given number exactly once (as a
      multiset: a number given twice must appear twice) and equals the target within 1e-5;
    * ``format_score`` (default 0.1, d1's ``compute_score`` default) if the answer is a well-formed
      arithmetic expression but uses the wrong numbers, misses the target or divides by zero;
    * 0.0 if no answer can be extracted, or the answer is not an arithmetic expression at all
      (d1 gives format credit to anything inside ``<answer>`` tags; here a non-expression such as
      ``__import__('os')`` or prose earns nothing, and is never executed);
    * NaN if the row has no numbers/target.

    ``\\times``/``\\cdot``/``×`` read as ``*``, ``\\div``/``÷`` as ``/``, braces as parentheses. With
    ``allow_trailing_equals`` (default) a single trailing ``= <number>`` is dropped and the left side
    graded (d1's prompt asks for no ``=``; its number check would count the target as a used number).
    Extras: ``well_formed`` (B,) 0/1.

    Args:
        format_score: the score of a well-formed expression that uses the wrong numbers or misses the target.
        correct_score: the score of a correct answer.
        allow_trailing_equals: drop a single trailing "= <number>" and grade the left side.
        tolerance: how close to the target the expression's value must be.
    """

    name = "countdown"
    differentiable = False

    def __init__(
        self, format_score: float = 0.1, correct_score: float = 1.0, allow_trailing_equals: bool = True, tolerance: float = 1e-5
    ) -> None:
        self.format_score = float(format_score)
        self.correct_score = float(correct_score)
        self.allow_trailing_equals = allow_trailing_equals
        self.tolerance = tolerance

    def score(self, text: str, numbers: Sequence[float], target: float) -> tuple[float, bool]:
        """(score, well_formed) for one completion."""
        answer = extract_answer(text, prefer_answer_tags=True)
        if answer is None:
            return 0.0, False
        expr = _normalise_expression(answer, self.allow_trailing_equals)
        try:
            node, used = parse_arithmetic(expr)
        except _NotArithmetic:
            return 0.0, False
        if sorted(used) != sorted(Fraction(n) for n in numbers):
            return self.format_score, True
        try:
            value = _evaluate(node)
        except ZeroDivisionError:
            return self.format_score, True
        if abs(float(value) - float(target)) < self.tolerance:
            return self.correct_score, True
        return self.format_score, True

    def __call__(self, samples: Sequence[str], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        scores, formed = [], []
        for i, text in enumerate(completion_texts(samples)):
            meta = metadata[i] if i < len(metadata) else {}
            numbers, target = meta.get("numbers"), meta.get("target")
            if numbers is None or target is None:
                scores.append(math.nan)
                formed.append(0.0)
                continue
            s, ok = self.score(text, list(numbers), target)
            scores.append(s)
            formed.append(1.0 if ok else 0.0)
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            extras={"well_formed": torch.tensor(formed, dtype=torch.float32)},
        )


def _grid(value: Any, field: str) -> str:
    s = str(value).strip()
    if len(s) != 16 or not s.isdigit():
        raise ValueError(f"sudoku metadata '{field}' must be 16 digits (0 = empty), got {value!r}")
    return s


class SudokuReward:
    """4x4 Sudoku (d1): fraction of the originally empty cells that the answer fills correctly.

    The answer is every digit of the extracted answer (the last ``<answer>`` block, or a boxed grid),
    concatenated, then zero-padded or cut to 16 characters, as d1 does: so ``"3142 2431 ..."`` and a
    four-line grid both read as 16 digits, while stray digits (e.g. row labels) shift the grid, as in d1.
    Score = (# cells with ``puzzle[i] == "0"`` and ``answer[i] == solution[i]``) / (# cells with
    ``puzzle[i] == "0"``); 0.0 with no answer; NaN for a row without puzzle/solution, or a puzzle without
    empty cells (d1 scores that 0.0; here it is "not applicable"). Extras: ``solved`` (B,) 0/1, all
    16 cells equal to the solution. Metadata: ``{"puzzle": "3102...", "solution": "3142..."}``.
    ``grade="solved"`` scores that instead (1.0 when all 16 cells equal the solution, else 0.0): the accuracy the
    embedded Sudoku LM's presets report, where a miscopied clue fails the puzzle.

    Args:
        grade: "cells" (d1's score: the fraction of empty cells filled right) or "solved" (1 when all 16 cells are right).
    """

    name = "sudoku"
    differentiable = False

    def __init__(self, grade: str = "cells") -> None:
        if grade not in ("cells", "solved"):
            raise FlowRLError(f"sudoku grade must be 'cells' or 'solved', not {grade!r}.")
        self.grade = grade

    def score(self, text: str, puzzle: str, solution: str) -> tuple[float, bool]:
        puzzle, solution = _grid(puzzle, "puzzle"), _grid(solution, "solution")
        empty = [i for i in range(16) if puzzle[i] == "0"]
        if not empty:
            return math.nan, False
        answer = extract_answer(text, prefer_answer_tags=True)
        digits = "".join(c for c in (answer or "") if c.isdigit())
        if not digits:
            return 0.0, False
        digits = (digits + "0" * 16)[:16]
        correct = sum(digits[i] == solution[i] for i in empty)
        return correct / len(empty), digits == solution

    def __call__(self, samples: Sequence[str], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        scores, solved = [], []
        for i, text in enumerate(completion_texts(samples)):
            meta = metadata[i] if i < len(metadata) else {}
            if meta.get("puzzle") is None or meta.get("solution") is None:
                scores.append(math.nan)
                solved.append(0.0)
                continue
            s, ok = self.score(text, meta["puzzle"], meta["solution"])
            scores.append(float(ok) if self.grade == "solved" and not math.isnan(s) else s)
            solved.append(1.0 if ok else 0.0)
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            extras={"solved": torch.tensor(solved, dtype=torch.float32)},
        )


class SudokuConstraintReward:
    """A verifier of 4x4 Sudoku answers that never sees the solution (best-of-N's selection rule): it reads the
    puzzle from the prompt, whose 16 digits (0 = empty) are the compact prompt ``flowrl.data.sudoku`` writes (d1's
    long prompt carries other digits, so it is refused there: NaN), and the answer's 16 cells as ``SudokuReward``
    does. Score = 1 - (rows, columns and boxes without 1-4 once + clues not kept) / 28, so 1.0 exactly when the
    answer is a valid grid keeping every clue, which for a puzzle with one solution is the solution; 0.0 with no
    answer. Metadata is not read.
    """

    name = "sudoku_constraints"
    differentiable = False

    def score(self, text: str, prompt: str) -> float:
        from ..data.sudoku import sudoku_violations

        puzzle = "".join(c for c in prompt if c.isdigit())
        if len(puzzle) != 16:
            return math.nan
        digits = "".join(c for c in (extract_answer(text, prefer_answer_tags=True) or "") if c.isdigit())
        if not digits:
            return 0.0
        grid = (digits + "0" * 16)[:16]
        broken_clues = sum(p != "0" and p != g for p, g in zip(puzzle, grid, strict=True))
        return 1.0 - (sudoku_violations(grid) + broken_clues) / 28

    def __call__(self, samples: Sequence[str], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        texts = completion_texts(samples)
        return RewardOutput(scores=torch.tensor([self.score(t, p) for t, p in zip(texts, prompts, strict=True)], dtype=torch.float32))


__all__ = ["CountdownReward", "SudokuConstraintReward", "SudokuReward", "parse_arithmetic", "safe_evaluate"]
