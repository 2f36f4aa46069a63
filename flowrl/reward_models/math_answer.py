"""Verifiable math rewards for diffusion language models: answer extraction, math-verify grading, format.

Three pieces, each usable on its own:

* ``extract_answer(text)`` pulls the final answer out of a raw completion (LLaDA's decoded text with
  ``<|eot_id|>`` / ``<|endoftext|>`` padding included).
* ``grade(answer, gold)`` decides equivalence with math-verify, gold first.
* ``MathAnswerReward`` and ``FormatReward`` score a batch of completions (``samples`` is a list of
  strings for text, where image rewards get a tensor).

Two defects of d1's grader that this module avoids (``tests/test_math_rewards.py`` demonstrates both):

* ``"\\boxed" in r`` written without a raw string is ``"\\x08oxed"`` (``\\b`` is a backspace), so the
  check never matches a real completion; here every LaTeX pattern is a raw string or a double backslash.
* d1's format regexes use ``.*?`` without ``re.DOTALL``, so any reasoning longer than one line fails
  them; here every tag pattern is compiled with ``re.DOTALL``.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Any, Mapping, Sequence

import torch

from flowrl.types import RewardOutput

logger = logging.getLogger(__name__)

# Special tokens of LLaDA / LLaMA-3 style tokenizers that appear in text decoded with
# skip_special_tokens=False (d1 records generations this way). Any "<|...|>" token is removed.
_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# "\boxed" / "\fbox"; also "boxed{" with the backslash dropped (LLaDA writes "<answer>\nboxed{27}" at
# times), but only right before a brace and not inside a longer word.
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])|(?<![A-Za-z\\])boxed(?=\s*\{)")
_EMPTY_BOX = re.compile(r"\\?(?:boxed|fbox)\s*\{\s*\}")
# A number followed only by plain words ("20 white hats", "5 changes/day", "18 dollars"): graded as the
# number too, unless a word carries mathematical meaning ("2 pi", "5 squared", "3 or 4").
_NUMBER_THEN_WORDS = re.compile(r"(\\?\$?\s*[-+]?\d[\d,]*(?:\.\d+)?)\s+([A-Za-z]{2,}[A-Za-z'/\- ]*)")
_MATH_WORDS = frozenset(
    "pi times plus minus over divided by squared cubed root roots sqrt power powers factorial and or to "
    "not no none less more than greater fewer thousand thousands million millions billion hundred hundreds "
    "dozen dozens half percent".split()
)


def _number_before_words(answer: str) -> str | None:
    m = _NUMBER_THEN_WORDS.fullmatch(answer)
    if m is None:
        return None
    words = re.split(r"[\s/\-']+", m.group(2).lower())
    return None if any(w in _MATH_WORDS for w in words) else m.group(1)

# Answers longer than this are not handed to sympy: a policy that learns to emit huge expressions must
# not be able to stall the reward (math-verify's own timeout only works in the main thread).
MAX_ANSWER_CHARS = 1000


def strip_special_tokens(text: str) -> str:
    """Remove ``<|eot_id|>``, ``<|endoftext|>``, ``<|mdm_mask|>`` and any other ``<|name|>`` token.

    The text is not cut at the first end-of-text token: LLaDA pads the completion with end-of-text
    tokens after it stops, and in the recorded d1 generations text after the first ``<|eot_id|>`` is
    only padding (one stray ``>`` in 1630 rows), so removing the tokens and cutting give the same answers.
    """
    return _SPECIAL_TOKEN.sub("", text)


def _balanced(text: str, open_at: int) -> int | None:
    """Index one past the brace closing the "{" at ``open_at``, or None if it is never closed."""
    depth = 0
    i = open_at
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace \{ or \} does not count
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _boxed_contents(text: str) -> list[str]:
    """The contents of every complete ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed x`` in order.

    ``\\boxed{`` with an unbalanced brace (a generation cut off mid-answer) is skipped. The braceless
    form ``\\boxed 5`` takes the text up to the next ``$``, whitespace-delimited end or closing tag, as
    Hendrycks' ``last_boxed_only_string`` does.
    """
    out = []
    for m in _BOX_COMMAND.finditer(text):
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _balanced(text, j)
            if end is not None:
                out.append(text[j + 1 : end - 1].strip())
        elif j > m.end() and j < len(text):
            tail = re.match(r"[^\s$<]+", text[j:])
            if tail:
                out.append(tail.group(0).strip())
    return [c for c in out if c]


def _answer_block(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>``; a final unclosed ``<answer>`` runs to the end."""
    blocks = _ANSWER_BLOCK.findall(text)
    last_open = text.rfind("<answer>")
    if last_open >= 0 and text.find("</answer>", last_open) < 0:
        return text[last_open + len("<answer>") :]  # truncated or unclosed: take what is there
    return blocks[-1] if blocks else None


def _clean(answer: str) -> str:
    # A mangled closing tag ("120\n</answer" at the end of a generation, "</answer}") and what follows.
    a = re.sub(r"</?answer.*$", "", answer, flags=re.DOTALL).strip()
    # Surrounding math delimiters and a sentence-final period.
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if a.startswith(left) and a.endswith(right) and len(a) >= len(left) + len(right):
            a = a[len(left) : len(a) - len(right)].strip()
            break
    return a.rstrip(".").strip()


def extract_answer(text: str, prefer_answer_tags: bool = False) -> str | None:
    """The final answer of a completion, or None.

    Priority: (1) the last complete boxed expression inside the last ``<answer>`` block; (2) the last
    complete ``\\boxed{}`` / ``\\fbox{}`` / ``\\boxed x`` anywhere; (3) the whole content of the last
    ``<answer>...</answer>`` block (DOTALL, so multi-line; a final unclosed ``<answer>`` counts; empty
    ``\\boxed{}`` placeholders removed). ``prefer_answer_tags=True`` swaps (2) and (3): a box in the
    reasoning then never overrides a plain answer block (what the puzzle rewards want).
    Special tokens are removed first; a mangled closing tag, surrounding ``$``/``\\(``/``\\[`` delimiters
    and trailing periods are stripped (so a ``\\boxed{...}`` placeholder reads as nothing). Returns None
    when nothing non-empty is found.
    """
    if not text:
        return None
    text = strip_special_tokens(text)
    block = _answer_block(text)
    if block is not None:
        boxed = _boxed_contents(block)
        if boxed:
            return _clean(boxed[-1]) or None
        if prefer_answer_tags:
            cleaned = _clean(_EMPTY_BOX.sub("", block))
            if cleaned:
                return cleaned
    boxed = _boxed_contents(text)
    if boxed:
        return _clean(boxed[-1]) or None
    if block is not None:
        return _clean(_EMPTY_BOX.sub("", block)) or None
    return None


def _gold_string(gold: Any) -> str:
    """Gold in the form math-verify parses reliably: numbers as plain integers when whole (18.0 -> "18"),
    LaTeX wrapped in ``$...$`` unless it already carries delimiters or a ``\\boxed``."""
    if isinstance(gold, bool):
        raise TypeError("gold answer must be a number or a string, got bool")
    if isinstance(gold, (int, float)):
        if isinstance(gold, float) and gold.is_integer():
            return str(int(gold))
        return repr(gold) if isinstance(gold, float) else str(gold)
    g = str(gold).strip()
    if re.fullmatch(r"-?\d+\.0+", g):
        g = g.split(".")[0]
    if "$" in g or "\\boxed" in g or "\\(" in g or "\\[" in g:
        return g
    return f"${g}$"


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def grade(answer_text: str | None, gold: Any, timeout_seconds: int = 5) -> bool:
    """True iff the extracted answer equals ``gold`` according to math-verify.

    ``verify(parse(gold), parse(answer))`` with gold first (math-verify's verify is not symmetric: the
    gold decides, e.g., whether an interval or a set reading is meant). ``answer_text`` is an extracted
    answer (see ``extract_answer``), parsed as the content of a ``\\boxed{}``. Any math-verify error or
    timeout grades False. math-verify's timeouts use SIGALRM, which exists only in the main thread; in
    another thread they are turned off (answers longer than MAX_ANSWER_CHARS are refused instead).
    """
    if answer_text is None or gold is None:
        return False
    answer_text = answer_text.strip()
    if not answer_text or len(answer_text) > MAX_ANSWER_CHARS:
        return False
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("grading math answers needs math-verify: pip install math-verify") from e
    timeout = timeout_seconds if _in_main_thread() else None
    try:
        gold_parsed = parse(_gold_string(gold), parsing_timeout=timeout)
        if not gold_parsed:
            return False
        candidates = [answer_text]
        number = _number_before_words(answer_text)
        if number is not None:  # "20 white hats": math-verify reads the words as a product of symbols
            candidates.append(number)
        for candidate in candidates:
            pred_parsed = parse("\\boxed{" + candidate + "}", parsing_timeout=timeout)
            if pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout):
                return True
        return False
    except Exception as e:  # math-verify / sympy failures and timeouts: never crash a run
        logger.debug("math-verify failed on %r vs %r: %s", answer_text, gold, e)
        return False


def completion_texts(samples: Any) -> list[str]:
    """The batch of completions as strings (None -> ""); a bare string is refused (it would iterate chars)."""
    if isinstance(samples, str):
        raise TypeError("text rewards take a list of completion strings, got a single string")
    return ["" if s is None else str(s) for s in samples]


class MathAnswerReward:
    """1.0 if the extracted answer equals ``metadata[i]["answer"]`` (math-verify), 0.0 if it is wrong or
    nothing can be extracted, NaN if the row has no gold answer.

    ``samples``: list of B completion strings. Extras: ``extracted`` (B,) 0/1, whether an answer was found.
    """

    name = "math_answer"
    differentiable = False

    def __init__(self, answer_key: str = "answer", timeout_seconds: int = 5) -> None:
        self.answer_key = answer_key
        self.timeout_seconds = timeout_seconds

    def __call__(self, samples: Sequence[str], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        texts = completion_texts(samples)
        scores, extracted = [], []
        for i, text in enumerate(texts):
            gold = metadata[i].get(self.answer_key) if i < len(metadata) else None
            answer = extract_answer(text)
            extracted.append(0.0 if answer is None else 1.0)
            if gold is None or (isinstance(gold, float) and math.isnan(gold)):
                scores.append(math.nan)
            else:
                scores.append(1.0 if grade(answer, gold, self.timeout_seconds) else 0.0)
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            extras={"extracted": torch.tensor(extracted, dtype=torch.float32)},
        )


_REASONING_THEN_ANSWER = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
_PREFILLED_REASONING_THEN_ANSWER = re.compile(r"^(?:(?!<reasoning>).)*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
_ANSWER_ONLY = re.compile(r"<answer>.*?</answer>", re.DOTALL)


class FormatReward:
    """d1-style format reward, with the multi-line bug fixed.

    The exact rule, on the completion with special tokens removed (all patterns DOTALL):

    * 1.0 if it contains ``<reasoning>...</reasoning>`` followed, after optional whitespace only, by
      ``<answer>...</answer>`` (the tags may sit anywhere in the text; both bodies may span lines);
    * else 0.5 if it contains ``<answer>...</answer>``;
    * else 0.0;
    * plus ``boxed_bonus`` if the answer block (or, with no answer block, the completion) contains a
      complete ``\\boxed{...}``.

    ``reasoning_prefilled=True`` is for prompts that end with ``<reasoning>`` (d1's evaluation appends
    it after the chat template, so the recorded LLaDA completions start inside the reasoning): then a
    completion with ``...</reasoning>`` followed by ``<answer>...</answer>`` and no opening tag of its own
    earns the full 1.0 as well.
    """

    name = "format"
    differentiable = False

    def __init__(self, boxed_bonus: float = 0.0, reasoning_prefilled: bool = False) -> None:
        self.boxed_bonus = float(boxed_bonus)
        self.reasoning_prefilled = bool(reasoning_prefilled)

    def score(self, text: str) -> float:
        text = strip_special_tokens(text or "")
        if _REASONING_THEN_ANSWER.search(text) or (
            self.reasoning_prefilled and _PREFILLED_REASONING_THEN_ANSWER.search(text)
        ):
            s = 1.0
        elif _ANSWER_ONLY.search(text):
            s = 0.5
        else:
            s = 0.0
        if self.boxed_bonus:
            blocks = _ANSWER_BLOCK.findall(text)
            where = blocks[-1] if blocks else text
            if _boxed_contents(where):
                s += self.boxed_bonus
        return s

    def __call__(self, samples: Sequence[str], prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> RewardOutput:
        return RewardOutput(scores=torch.tensor([self.score(t) for t in completion_texts(samples)], dtype=torch.float32))


__all__ = ["FormatReward", "MathAnswerReward", "completion_texts", "extract_answer", "grade", "strip_special_tokens"]
