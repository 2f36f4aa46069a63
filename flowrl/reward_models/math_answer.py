"""Verifiable math rewards for diffusion language models: answer extraction, math-verify grading, format.

Three pieces, each usable on its own:

* ``extract_answer(text)`` pulls the final answer out of a raw completion (LLaDA's decoded text with
  ``<|eot_id|>`` / ``<|endoftext|>`` padding included).
* ``grade(answer, gold)`` decides equivalence with math-verify, gold first.
* ``MathAnswerReward`` and ``FormatReward`` score a batch of completions (``samples`` is a list of
  strings for text, where image rewards get a tensor).

How the final answer is read (docs/math_grading.md lists the rules with their effect on the shared
LLaDA-8B-Instruct generations; tests/test_math_rewards.py has one test per rule, from real rows):

* the last ``\\boxed{}`` inside the last ``<answer>`` block, else the last one anywhere, else the answer
  block's text; placeholders (``\\boxed{}``, ``\\boxed{...}``) count as nothing boxed;
* an unclosed ``\\boxed{`` that ends the generation (the model stopped there: end-of-text tokens, a line
  break or a closing tag follow it) is read to the end of its line; one cut off by the length limit cannot be
  read, and then nothing is taken from the reasoning either;
* when nothing is boxed and no answer block holds an answer, a final answer marked in words: the closing
  statement of the generation, if it concludes ("Therefore, ... is 40.", "So, each friend paid ... = $34.",
  "The answer is 18"), read after its last "=" / "is" / ":";
* the answer is then graded (``grade``) as written, and in the readings a careful person also accepts: a
  number followed by plain words or units ("20 white hats", ``18 \\text{ dollars}``), ``\\text{}`` unwrapped,
  a boxed phrase holding exactly one number ("The answer is 18", "Juice Box C is 2 dollars more than Juice
  Box B"), a time on the hour ("2:00 pm" is 2); thousands separators and percentages are math-verify's.

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
from collections.abc import Mapping, Sequence
from typing import Any

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
_PLACEHOLDER_BOX = re.compile(r"\\?(?:boxed|fbox)\s*\{\s*(?:\.+)?\s*\}")  # \boxed{} and the prompt's \boxed{...}
_CLOSING_TAGS_AT_END = re.compile(r"(?:\s*</?[A-Za-z]*[>}]?)+\s*$")  # "</answer>", "</answer}", "</ing>" ending a text
_ENDS_WITH_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>\s*$")
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


# \text{...}, \mbox{...}, \textbf{...}, \textrm{...} (closed, or left open by a generation that stopped)
_TEXT_COMMAND = re.compile(r"\\(?:text(?:bf|rm|it|normal)?|mbox|mathrm)\s*\{([^{}]*)(?:\}|$)")
_NUMBER = r"[-+]?\$?\s*\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\$?\s*\d+(?:\.\d+)?"
# A phrase holding the answer: words around exactly one number ("The answer is 18", "Juice Box C is 2 dollars
# more than Juice Box B"). Words that change the number's value or hedge it disqualify the phrase.
_PHRASE_BLOCKERS = (_MATH_WORDS - {"more", "less", "than", "fewer", "greater", "and", "to", "by"}) | frozenset(
    "approximately about around nearly almost roughly least most between up each every".split()
)
_CLOCK_ON_THE_HOUR = re.compile(r"(\d{1,2})(?::00)?\s*(?:[ap]\.?\s?m\.?)", re.IGNORECASE)


def _balanced_braces(text: str) -> bool:
    depth = 0
    for c in re.sub(r"\\[{}]", "", text):
        depth += (c == "{") - (c == "}")
        if depth < 0:
            return False
    return depth == 0


def _plain_text(answer: str) -> str:
    """``\\text{}``-like wrappers unwrapped, spacing commands and stray braces removed: the answer as it reads
    ("360\\text{ hours} hours" -> "360 hours hours"). ``\\$`` / ``\\%`` stay escaped: a bare "%" would
    start a LaTeX comment in what math-verify is handed."""
    a = _TEXT_COMMAND.sub(lambda m: f" {m.group(1)} ", answer)
    a = a.replace("\\ ", " ").replace("\\,", "").replace("~", " ")
    a = re.sub(r"(?<!\\)[{}]", " ", a)
    return re.sub(r"\s+", " ", a).strip().rstrip(".").strip()


def _phrase_number(answer: str) -> str | None:
    """The number of a phrase that holds exactly one, with at least two words and nothing mathematical."""
    answer = answer.replace("\\$", "$").replace("\\%", "%")
    if re.search(r"[=+*^_\\×÷<>]|\d\s*/\s*\d", answer):
        return None
    numbers = re.findall(_NUMBER, answer)
    words = re.findall(r"[A-Za-z]+(?:'[a-z]+)?", re.sub(_NUMBER, " ", answer))
    if len(numbers) != 1 or len(words) < 2 or any(w.lower() in _PHRASE_BLOCKERS for w in words):
        return None
    return numbers[0].replace("$", "").replace(" ", "")


def _clock_hour(answer: str) -> str | None:
    """ "2:00 pm" / "2 p.m." -> "2": a time on the hour read as its hour, the GSM8K convention for "what time"."""
    m = _CLOCK_ON_THE_HOUR.fullmatch(answer.strip())
    return m.group(1) if m and 1 <= int(m.group(1)) <= 12 else None


def readings(answer: str) -> list[str]:
    """The ways a careful person reads an extracted answer, as written first. Each is graded on its own and
    any match counts, so a reading may only ever add what the answer plainly says."""
    # an unbalanced "}" would close grade's \\boxed{...} early and hand math-verify only what precedes it
    out = [answer] if _balanced_braces(answer) else []
    plain = _plain_text(answer)
    for text in dict.fromkeys([answer, plain]):
        number = _number_before_words(text)  # "20 white hats": math-verify reads the words as a product of symbols
        if number is not None:
            out.append(number)
    for reading in (_clock_hour(plain), _phrase_number(plain)):  # (plain itself: math-verify reads words as symbols)
        if reading:
            out.append(reading)
    return list(dict.fromkeys(out))


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
    return [content for kind, content in _boxes(text, ended=False) if kind == "box"]


def _boxes(text: str, ended: bool) -> list[tuple[str, str]]:
    """Every box command in order, as ("box", content), or ("open", content) for an unclosed ``\\boxed{`` that
    ends the text and can be read, or ("cut", "") for one that ends the text but was cut off. ``ended``: the
    text is the end of a generation the model finished (end-of-text tokens after it, or a closing tag)."""
    out = []
    for m in _BOX_COMMAND.finditer(text):
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _balanced(text, j)
            if end is not None:
                content = text[j + 1 : end - 1].strip()
                if content:
                    out.append(("box", content))
                continue
            rest = _CLOSING_TAGS_AT_END.sub("", text[j + 1 :])
            line, newline, after = rest.partition("\n")
            if after.strip():  # more text follows on later lines: not the end of the generation, skipped
                continue
            # the model went on to a new line, wrote a closing tag or stopped: the line is complete
            finished = bool(newline) or ended or len(rest) < len(text) - j - 1
            content = re.sub(r"[<>]+$", "", line.strip()).strip()  # a mangled closing tag's remnant ("minutes>")
            out.append(("open", content) if finished else ("cut", ""))
        elif j > m.end() and j < len(text):
            tail = re.match(r"[^\s$<]+", text[j:])
            if tail and tail.group(0).strip():
                out.append(("box", tail.group(0).strip()))
    return out


def _final_box(text: str, ended: bool) -> tuple[str, str | None]:
    """("box", answer) for the last box that holds something, ("cut", None) when that last box was cut off, or
    ("none", None); placeholders (``\\boxed{}``, ``\\boxed{...}``) are skipped, as if nothing were boxed."""
    found = [(kind, _clean(_PLACEHOLDER_BOX.sub("", content))) for kind, content in _boxes(text, ended)]
    found = [(kind, content) for kind, content in found if kind == "cut" or content]
    if not found:
        return "none", None
    kind, content = found[-1]
    return ("cut", None) if kind == "cut" else ("box", content)


def _answer_block(text: str) -> tuple[str, bool] | None:
    """(content, closed) of the last ``<answer>...</answer>``; a final unclosed ``<answer>`` runs to the end."""
    blocks = _ANSWER_BLOCK.findall(text)
    last_open = text.rfind("<answer>")
    if last_open >= 0 and text.find("</answer>", last_open) < 0:
        return text[last_open + len("<answer>") :], False  # truncated or unclosed: take what is there
    return (blocks[-1], True) if blocks else None


def _clean(answer: str) -> str:
    # A mangled closing tag ("120\n</answer" at the end of a generation, "</answer}") and what follows.
    a = re.sub(r"</?answer.*$", "", answer, flags=re.DOTALL).strip()
    # Surrounding math delimiters and a sentence-final period.
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if a.startswith(left) and a.endswith(right) and len(a) >= len(left) + len(right):
            a = a[len(left) : len(a) - len(right)].strip()
            break
    return a.rstrip(".").strip()


# The closing statement of a generation concludes when it starts with one of these, or says "therefore" /
# "thus" / "hence" / "we conclude" / "the (final) answer is" anywhere ("We, therefore, conclude that ... is 81.").
_CONCLUDES = re.compile(
    r"^\W*(?:so|therefore|thus|hence|in conclusion)\b|\b(?:therefore|thus|hence|conclude|"
    r"(?:final )?answer is)\b",
    re.IGNORECASE,
)
# Where the stated value starts: after the statement's last "=", "is", "are", "was", "equals" or ":".
_VALUE_AFTER = re.compile(r"=|:|\b(?:is|are|was|were|equals)\b", re.IGNORECASE)
_TAG = re.compile(r"</?[A-Za-z]+\s*[>}]|</[A-Za-z]*|<>")  # tags, mangled ones ("</ing>", "</answer}", "<>") included


def _closing_statement(text: str, ended: bool) -> str | None:
    """The value of the generation's last statement when it concludes, else None.

    Tags and placeholder boxes are removed first; the statement is what follows the last sentence end
    ("." / "!" / "?" before whitespace) or blank line, so an intermediate "Therefore, ..." followed by more
    reasoning is never read. The generation must have finished the statement: it ends with a full stop, or a
    closing tag or the end-of-text tokens follow it (a statement cut off by the length limit is not read).
    Only used when nothing is boxed and no answer block holds an answer.
    """
    tagged = bool(re.search(r"</?[A-Za-z]*[>}]?\s*$", _PLACEHOLDER_BOX.sub("", text).rstrip()))
    body = _TAG.sub(" ", _PLACEHOLDER_BOX.sub(" ", text)).strip()
    finished = ended or tagged or bool(re.search(r"[.!?]$", body))
    body = re.sub(r"[.!?\s]+$", "", body)
    if not body or not finished:
        return None
    statement = re.split(r"(?<=[.!?])\s+|\n\s*\n", body)[-1].strip()
    if not _CONCLUDES.search(statement):
        return None
    values = list(_VALUE_AFTER.finditer(statement))
    if not values:
        return None
    value = _clean(statement[values[-1].end() :].strip())
    value = re.sub(r"\\[()\[\]]", " ", value)  # math delimiters left around or inside the value ("\[ 280} \]")
    if not _balanced_braces(value):  # "\\[ 280} \\] minutes": a brace the generation left unmatched
        value = re.sub(r"(?<!\\)[{}]", " ", value)
    value = re.sub(r"\s+", " ", value).strip()
    return value or None


def extract_answer(text: str, prefer_answer_tags: bool = False, closing_statement: bool | None = None) -> str | None:
    """The final answer of a completion, or None.

    Priority: (1) the last boxed expression inside the last ``<answer>`` block; (2) the last boxed expression
    anywhere (``\\boxed{}`` / ``\\fbox{}`` / ``\\boxed x``; an unclosed ``\\boxed{`` that ends the generation is
    read to the end of its line); (3) the whole content of the last ``<answer>...</answer>`` block (DOTALL,
    so multi-line; a final unclosed ``<answer>`` counts; placeholder boxes removed); (4) with
    ``closing_statement``, a final answer marked in words: the generation's closing statement when it
    concludes ("Therefore, the number of pies is 40."), read after its last "=" / "is" / ":".
    Placeholders (``\\boxed{}``, ``\\boxed{...}``) count as nothing boxed. If the last box was cut off by the
    length limit, the final answer cannot be read and None is returned: no earlier number is taken instead.
    ``prefer_answer_tags=True`` swaps (2) and (3): a box in the reasoning then never overrides a plain answer
    block (what the puzzle rewards want). ``closing_statement`` defaults to ``not prefer_answer_tags``: the
    puzzle rewards take tagged answers only (a sentence of the reasoning must not earn Sudoku cells).
    Special tokens are removed first; a mangled closing tag, surrounding ``$``/``\\(``/``\\[`` delimiters
    and trailing periods are stripped. Returns None when nothing non-empty is found.
    """
    if not text:
        return None
    ended = bool(_ENDS_WITH_SPECIAL_TOKEN.search(text))  # the model stopped, the length limit did not cut it
    text = strip_special_tokens(text)
    if closing_statement is None:
        closing_statement = not prefer_answer_tags
    found = _answer_block(text)
    block = found[0] if found is not None else None
    if found is not None:
        kind, answer = _final_box(block, ended or found[1])
        if kind != "none":
            return answer
        if prefer_answer_tags:
            cleaned = _clean(_EMPTY_BOX.sub("", block))
            if cleaned:
                return cleaned
    kind, answer = _final_box(text, ended)
    if kind != "none":
        return answer
    if block is not None:
        cleaned = _clean(_PLACEHOLDER_BOX.sub("", block))
        if cleaned:
            return cleaned
    return _closing_statement(text, ended) if closing_statement else None


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
        for candidate in readings(answer_text):
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

    Args:
        answer_key: the metadata key holding each prompt's gold answer.
        timeout_seconds: time limit of one answer's verification (math-verify), in seconds.
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

    Args:
        boxed_bonus: added when the answer contains a complete \\boxed{...}.
        reasoning_prefilled: prompts end with <reasoning> (d1's evaluation): a completion may close it without opening it.
    """

    name = "format"
    differentiable = False

    def __init__(self, boxed_bonus: float = 0.0, reasoning_prefilled: bool = False) -> None:
        self.boxed_bonus = float(boxed_bonus)
        self.reasoning_prefilled = bool(reasoning_prefilled)

    def score(self, text: str) -> float:
        text = strip_special_tokens(text or "")
        if _REASONING_THEN_ANSWER.search(text) or (self.reasoning_prefilled and _PREFILLED_REASONING_THEN_ANSWER.search(text)):
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
