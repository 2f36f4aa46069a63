"""Text rewards for diffusion language models: answer extraction, math-verify grading, format, Countdown,
Sudoku, and flowrl's grader on real LLaDA-8B-Instruct generations recorded by d1."""

from __future__ import annotations

import math
import re

import pytest
import torch

from flowrl.data.text_tasks import (
    GSM8K_FILE,
    MATH500_FILE,
    default_data_dir,
    load_countdown,
    load_gsm8k,
    load_math500,
    load_sudoku,
    read_jsonl,
)
from flowrl.evaluation.recorded import format_report, grade_recorded
from flowrl.reward_models import build_reward
from flowrl.reward_models.math_answer import (
    FormatReward,
    MathAnswerReward,
    extract_answer,
    grade,
)
from flowrl.reward_models.puzzles import CountdownReward, SudokuReward, safe_evaluate

DATA = default_data_dir()
try:
    import math_verify  # noqa: F401

    HAVE_MATH_VERIFY = True
except ImportError:  # the grader needs it; extraction, format and puzzles do not
    HAVE_MATH_VERIFY = False
needs_math_verify = pytest.mark.skipif(not HAVE_MATH_VERIFY, reason="math-verify not installed")
needs_data = pytest.mark.skipif(not (DATA / GSM8K_FILE).is_file(), reason="shared data files not present")

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------


def test_extract_boxed_forms():
    assert extract_answer("so the answer is \\boxed{18}.") == "18"
    assert extract_answer("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"  # nested braces
    assert extract_answer("first \\boxed{1} then \\boxed{\\sqrt{2}}") == "\\sqrt{2}"  # the last one
    assert extract_answer("\\fbox{7}") == "7"
    assert extract_answer("$\\boxed 5$") == "5"
    assert extract_answer("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"  # escaped braces do not count
    # the final box cut off by the length limit: unreadable, and no earlier box is taken in its place
    assert extract_answer("\\boxed{3} and then \\boxed{4") is None
    assert extract_answer("\\boxed{3} and then \\boxed{4<|eot_id|>") == "4"  # the model stopped there: readable
    assert extract_answer("\\boxed{5 is my guess\n\nNext we check \\boxed{3}") == "3"  # unclosed mid-text: not a final answer
    assert extract_answer("no answer here") is None
    assert extract_answer("") is None


def test_extract_answer_tags_multiline_and_llada_padding():
    assert extract_answer("<reasoning>\na\nb\n</reasoning>\n<answer>\n18\n</answer>") == "18"
    assert extract_answer("<answer>\n\\boxed{18}<|eot_id|><|endoftext|><|endoftext|>") == "18"
    # inside the answer block a box wins over the block text; a box in the block wins over an earlier one
    assert extract_answer("\\boxed{3}<answer>so \\boxed{4}.</answer>") == "4"
    assert extract_answer("<answer>\n120\n</answer") == "120"  # mangled closing tag
    assert extract_answer("<answer>\n\\boxed{...}\n</answer>") is None  # copied placeholder
    assert extract_answer("<answer>\nboxed{27}\n</answer>") == "27"  # backslash dropped
    # prefer_answer_tags: a box in the reasoning does not override the answer block
    text = "<reasoning>try \\boxed{1}</reasoning><answer>2</answer>"
    assert extract_answer(text) == "1"
    assert extract_answer(text, prefer_answer_tags=True) == "2"


# ---------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------


@needs_math_verify
def test_grade_cases():
    assert grade(extract_answer("\\boxed{18}"), 18.0)  # float gold from GSM8K
    assert grade("18", "18.0")
    assert not grade("17", 18.0)
    # 1/2 and 0.5 are the same number, in either role
    assert grade(extract_answer("\\boxed{\\frac{1}{2}}"), "0.5")
    assert grade("0.5", "\\frac{1}{2}")
    assert grade(extract_answer("<answer>\n18\n</answer>"), 18.0)
    assert grade(extract_answer("\\boxed{\\frac{a}{b}}"), "\\frac{a}{b}")
    assert grade("16\\sqrt{3}", "16 \\sqrt{3}")
    assert grade("\\dfrac{33}{100}", "\\dfrac{33}{100}")
    assert grade("1,000", 1000.0)
    assert grade("\\$18", 18.0)
    assert grade("20 white hats", 20.0)  # a number followed by plain words
    assert grade("5 changes/day", 5.0)
    assert not grade("2 pi", 2.0) and not grade("5 squared", 5.0) and not grade("3 thousand", 3.0)
    assert grade("120\\text{ minutes}", 120.0)
    assert not grade("2", "16 \\sqrt{3}")
    assert not grade(None, 18.0)
    assert not grade("", 18.0)
    assert not grade("x" * 5000, 18.0)  # over MAX_ANSWER_CHARS: refused, not handed to sympy
    assert not grade("\\frac{", 18.0)  # unparsable: False, no exception


@needs_math_verify
def test_grade_works_outside_the_main_thread():
    # math-verify's timeouts use SIGALRM, which raises ValueError outside the main thread; flowrl turns
    # them off there (a reward server or a thread pool must still grade).
    import threading

    results = []
    t = threading.Thread(target=lambda: results.append((grade("\\frac{1}{2}", "0.5"), grade("3", "4"))))
    t.start()
    t.join()
    assert results == [(True, False)]


@needs_math_verify
def test_gold_first_asymmetry_is_respected():
    # math-verify's verify(gold, pred) is not symmetric: a gold inequality accepts the equivalent
    # interval, a gold interval rejects the inequality. flowrl passes the gold first.
    from math_verify import parse, verify

    inequality, interval = "x<3", "(-\\infty,3)"
    assert verify(parse(f"${inequality}$"), parse(f"${interval}$"))
    assert not verify(parse(f"${interval}$"), parse(f"${inequality}$"))
    assert grade(interval, inequality)  # answer interval, gold inequality
    assert not grade(inequality, interval)  # answer inequality, gold interval
    assert grade("3", "x=3") and grade("x = 2", "2")  # equations vs values: either way round


def test_d1_backslash_b_defect():
    """d1 wrote ``"\\boxed" in r`` without a raw string: in Python source "\\b" is a backspace."""
    written_in_d1 = "\boxed"  # exactly as in d1's source: "\b" + "oxed"
    assert written_in_d1 != "\\boxed"
    assert written_in_d1[0] == "\x08" and len(written_in_d1) == 5
    completion = "<answer>\n\\boxed{18}\n</answer>"

    def naive_has_boxed(r: str) -> bool:
        return "\boxed" in r  # the defect, reproduced

    assert not naive_has_boxed(completion)  # misses a real boxed answer
    assert extract_answer(completion) == "18"  # flowrl's extractor finds it


def test_d1_format_regex_without_dotall_defect():
    completion = "<reasoning>\nStep 1: 16 - 3 - 4 = 9.\nStep 2: 9 * 2 = 18.\n</reasoning>\n<answer>\n18\n</answer>"
    d1_soft = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"  # d1's soft_format_reward_func
    assert re.match(d1_soft, completion) is None  # "." stops at the first newline
    assert FormatReward().score(completion) == 1.0
    one_line = "<reasoning>short</reasoning> <answer>18</answer>"
    assert re.match(d1_soft, one_line) is not None and FormatReward().score(one_line) == 1.0


def test_format_reward_rule():
    fmt = FormatReward()
    assert fmt.score("<answer>\n18\n</answer>") == 0.5
    assert fmt.score("the answer is 18") == 0.0
    assert fmt.score("<reasoning>a</reasoning> filler <answer>18</answer>") == 0.5  # not adjacent
    prefilled = "\nSteps...\n</reasoning>\n<answer>\n\\boxed{18}\n</answer><|eot_id|>"
    assert fmt.score(prefilled) == 0.5
    assert FormatReward(reasoning_prefilled=True).score(prefilled) == 1.0
    assert FormatReward(boxed_bonus=0.25).score("<reasoning>\nx\n</reasoning>\n<answer>\\boxed{1}</answer>") == 1.25
    out = build_reward("format")(["<answer>1</answer>", ""], ["p", "p"], [{}, {}])
    assert out.scores.tolist() == [0.5, 0.0]


@needs_math_verify
def test_math_answer_reward():
    reward = build_reward("math_answer")
    assert isinstance(reward, MathAnswerReward) and reward.name == "math_answer" and not reward.differentiable
    samples = ["<answer>\\boxed{18}</answer>", "<answer>17</answer>", "no answer", "\\boxed{5}"]
    meta = [{"answer": "18"}, {"answer": "18"}, {"answer": "18"}, {}]
    out = reward(samples, ["q"] * 4, meta)
    assert out.scores.dtype == torch.float32
    assert out.scores[:3].tolist() == [1.0, 0.0, 0.0]
    assert math.isnan(out.scores[3].item())
    assert out.extras["extracted"].tolist() == [1.0, 1.0, 0.0, 1.0]
    with pytest.raises(TypeError):
        reward("a single string", ["q"], [{"answer": "1"}])


# ---------------------------------------------------------------------------------------------
# Countdown and Sudoku
# ---------------------------------------------------------------------------------------------


def test_countdown_reward():
    reward = build_reward("countdown")
    assert isinstance(reward, CountdownReward) and reward.format_score == 0.1  # d1's compute_score default
    meta = {"numbers": [30, 100, 93], "target": 23}

    def score(text: str) -> float:
        return reward([text], ["p"], [meta]).scores.item()

    assert score("<answer>\n30 + 93 - 100\n</answer>") == 1.0
    assert score("<answer>\\boxed{(100 - 93) + 30 - 14}</answer>") == pytest.approx(0.1)  # 14 not given
    assert score("<answer>\\boxed{93 - (100 - 30)}</answer>") == 1.0  # d1 eval style
    assert score("<answer>30 + 93 - 100 = 23</answer>") == 1.0  # trailing "= target" tolerated
    assert score("<answer>93 \\times 1 + 30 - 100</answer>") == pytest.approx(0.1)  # extra number
    assert score("<answer>30 + 30 - 100</answer>") == pytest.approx(0.1)  # reuses 30, misses 93
    assert score("<answer>100 - 93 - 30</answer>") == pytest.approx(0.1)  # wrong value
    assert score("<answer>30 / (100 - 100) + 93</answer>") == pytest.approx(0.1)  # divides by zero
    assert score("no tags at all") == 0.0
    assert score("<answer>I cannot do it</answer>") == 0.0  # not an expression: no format credit
    assert CountdownReward(format_score=0.0)([" <answer>1+1</answer>"], ["p"], [meta]).scores.item() == 0.0
    # with a repeated given number, it must be used as many times as given
    assert reward(["<answer>4*4-6</answer>"], ["p"], [{"numbers": [4, 4, 6], "target": 10}]).scores.item() == 1.0


def test_countdown_never_executes_input(monkeypatch):
    import builtins

    def trap(*args, **kwargs):
        raise AssertionError("eval/exec/__import__ must never run on a completion")

    reward = CountdownReward()
    meta = {"numbers": [30, 100, 93], "target": 23}
    bad = [
        "<answer>__import__('os').system('echo pwned')</answer>",
        "<answer>(lambda: 23)()</answer>",
        "<answer>30 + 93 - 100 if True else 0</answer>",
        "<answer>[30, 93, 100].__len__()</answer>",
        "<answer>9**9**9</answer>",
        "<answer>" + "(" * 5000 + "1" + ")" * 5000 + "</answer>",
    ]
    with monkeypatch.context() as m:
        m.setattr(builtins, "eval", trap)
        m.setattr(builtins, "exec", trap)
        out = reward(bad, ["p"] * len(bad), [meta] * len(bad))
    assert out.scores.tolist() == [0.0] * len(bad)
    assert out.extras["well_formed"].tolist() == [0.0] * len(bad)
    assert safe_evaluate("__import__('os')") is None
    assert safe_evaluate("(1 + 2) * 3 / 4 - -1") == pytest.approx(3.25)


def test_sudoku_reward():
    reward = build_reward("sudoku")
    assert isinstance(reward, SudokuReward)
    puzzle, solution = "3102200002100320", "3142243142131324"  # first row of d1's test file
    empty = puzzle.count("0")
    meta = {"puzzle": puzzle, "solution": solution}

    def score(text: str) -> float:
        return reward([text], ["p"], [meta]).scores.item()

    assert score(f"<reasoning>\nfill\n</reasoning>\n<answer>\n{solution}\n</answer>") == 1.0
    first_empty = puzzle.index("0")
    wrong = solution[:first_empty] + ("1" if solution[first_empty] != "1" else "2") + solution[first_empty + 1 :]
    assert score(f"<answer>{wrong}</answer>") == pytest.approx((empty - 1) / empty)
    assert score("<answer>\n3142\n2431\n4213\n1324\n</answer>") == 1.0  # a grid reads as 16 digits
    assert score(f"<answer>{puzzle}</answer>") == 0.0  # copying the puzzle fills nothing
    assert score("no answer") == 0.0
    out = reward([f"<answer>{solution}</answer>", "x"], ["p", "p"], [meta, {}])
    assert out.extras["solved"].tolist() == [1.0, 0.0] and math.isnan(out.scores[1].item())


# ---------------------------------------------------------------------------------------------
# Loaders and real recorded generations
# ---------------------------------------------------------------------------------------------


@needs_data
def test_loaders():
    gsm = load_gsm8k(limit=3)
    assert gsm[0][1] == {"answer": "18"} and "Janet" in gsm[0][0] and "<reasoning>" in gsm[0][0]
    assert load_math500(limit=1)[0][1] == {"answer": "16 \\sqrt{3}"}
    cd = load_countdown(limit=1)
    assert cd[0][1] == {"numbers": [30, 100, 93], "target": 23} and "Target: 23" in cd[0][0]
    assert "[30, 100, 93]" in load_countdown(limit=1, style="train")[0][0]
    sd = load_sudoku(limit=1)
    assert sd[0][1] == {"puzzle": "3102200002100320", "solution": "3142243142131324"}  # leading zeros kept
    # every countdown row has an expression the reward scores 1.0 (brute force over 3 numbers)
    import itertools

    rows = load_countdown()
    assert len(rows) == 256
    answers = []
    for _, meta in rows:
        found = None
        for a, b, c in itertools.permutations(meta["numbers"]):
            for o1, o2 in itertools.product("+-*/", repeat=2):
                for expr in (f"({a} {o1} {b}) {o2} {c}", f"{a} {o1} ({b} {o2} {c})"):
                    v = safe_evaluate(expr)
                    if v is not None and abs(v - meta["target"]) < 1e-5:
                        found = expr
                        break
                if found:
                    break
            if found:
                break
        answers.append(f"<answer>{found}</answer>")
    scores = CountdownReward()(answers, [p for p, _ in rows], [m for _, m in rows]).scores
    assert scores.tolist() == [1.0] * len(rows)
    # every sudoku solution agrees with its puzzle's givens and scores 1.0
    sudoku = load_sudoku()
    assert len(sudoku) == 500  # (the data README says 256; the file holds 500)
    for _, m in sudoku:
        assert all(p == "0" or p == s for p, s in zip(m["puzzle"], m["solution"]))
    solved = SudokuReward()([f"<answer>{m['solution']}</answer>" for _, m in sudoku], [""] * 500, [m for _, m in sudoku])
    assert solved.scores.tolist() == [1.0] * 500


@needs_data
@needs_math_verify
@pytest.mark.slow
def test_grader_on_recorded_llada_generations(capsys):
    """d1 reports LLaDA-8B-Instruct at 256 tokens at 76.7% (GSM8K) and 32.4% (MATH500); its own grader reads 0.7651
    on this GSM8K file. flowrl's read 871/1128 and 179/500 before the reading rules of issue 15, 884 and 180 after
    (docs/rewards_video_and_rules.md lists the 14 newly accepted rows; each was read and is right)."""
    gsm = grade_recorded(DATA / GSM8K_FILE)
    math500 = grade_recorded(DATA / MATH500_FILE)
    with capsys.disabled():
        print("\n" + format_report(gsm) + "\n" + format_report(math500))
    assert gsm["n"] == 1128 and math500["n"] == 500
    assert sum(r["correct"] for r in gsm["rows"]) == 884 and sum(r["correct"] for r in math500["rows"]) == 180
    assert gsm["extracted_fraction"] > 0.95 and math500["extracted_fraction"] > 0.95
    # the reward agrees with the batch grader
    rows = read_jsonl(DATA / GSM8K_FILE, limit=20)
    out = MathAnswerReward()([r["llada_generation_256"] for r in rows], [""] * 20, [{"answer": r["ground_truth"]} for r in rows])
    assert out.scores.tolist() == [float(r["correct"]) for r in gsm["rows"][:20]]


# ---------------------------------------------------------------------------------------------
# Reading the final answer as a careful person does: one test per rule, from real rows of the shared
# LLaDA-8B-Instruct generations (line numbers are 1-based lines of the .jsonl files)
# ---------------------------------------------------------------------------------------------


def recorded(line: int, file: str = GSM8K_FILE) -> tuple[str, str]:
    """(generation with its end-of-text tokens, gold) of one line of a shared data file."""
    from flowrl.data.text_tasks import format_gold

    row = read_jsonl(DATA / file, limit=line)[line - 1]
    return row["llada_generation_256"], format_gold(row["ground_truth"])


def graded(line: int, file: str = GSM8K_FILE) -> tuple[str | None, bool]:
    text, gold = recorded(line, file)
    answer = extract_answer(text)
    return answer, grade(answer, gold)


@needs_data
@needs_math_verify
def test_rule_unclosed_box_ending_the_generation():
    """ "\\boxed{34<|eot_id|>": the model stopped without closing the brace; the box is read to the end of its line.
    The same text cut by the length limit (no end-of-text token) cannot be read."""
    assert graded(560) == ("34", True)  # "...\\boxed{34<|eot_id|><|endoftext|>", gold 34
    assert graded(1077) == ("70\\text{ minutes", True)  # "\\boxed{70\\text{ minutes><|eot_id|>", a mangled tag's ">"
    assert graded(514) == ("360\\text{ hours} hours", True)  # "\\boxed{360\\text{ hours} hours.\n</answer>"
    assert graded(519) == ("95", False)  # "\\boxed{95\n</answer>", gold 145: read, and wrong
    text, _ = recorded(560)
    assert extract_answer(text.replace("<|eot_id|>", "").replace("<|endoftext|>", "")) is None


@needs_data
@needs_math_verify
def test_rule_boxed_phrase_holding_the_number():
    """ "\\boxed{Juice Box C is 2 dollars more than Juice Box B.}" (gold 2) is the number it holds; a phrase with
    two numbers, a negation or a value-changing word is not read as a number."""
    assert graded(1084) == ("Juice Box C is 2 dollars more than Juice Box B", True)
    text, gold = recorded(1)  # "\\boxed{18}", gold 18
    assert grade(extract_answer(text.replace("\\boxed{18}", "\\boxed{The answer is 18}")), gold)
    assert grade(extract_answer(text.replace("\\boxed{18}", "\\boxed{\\text{The answer is } 18}")), gold)
    for phrase in ("No, 18 is not enough", "about 18 dollars", "18 dozen eggs", "18 and 9 dollars"):
        assert not grade(extract_answer(text.replace("\\boxed{18}", "\\boxed{" + phrase + "}")), gold), phrase


@needs_data
@needs_math_verify
def test_rule_time_on_the_hour():
    """ "\\boxed{2:00 pm}" answers "what is the latest time..." whose gold is 2."""
    assert graded(567) == ("2:00 pm", True)
    text, gold = recorded(567)
    assert grade(extract_answer(text.replace("2:00 pm}", "2:00 \\text{ PM}}")), gold)
    assert not grade(extract_answer(text.replace("2:00 pm}", "2:30 pm}")), gold)  # not on the hour: not the hour


@needs_data
@needs_math_verify
def test_rule_thousands_separators():
    assert graded(128) == ("6,250", True)  # gold 6250
    assert graded(973) == ("17,500", True)  # "Thus, James made \\(\\boxed{17,500}\\).", gold 17500
    assert graded(305) == ("252,000", False)  # gold 262500


@needs_data
@needs_math_verify
def test_rule_units():
    assert graded(224) == ("72 \\text{ cubic inches}", True)
    assert graded(481) == ("50 mph", True)
    assert graded(194) == ("20 white hats", True)
    assert graded(122) == ("330 miles", False)  # gold 255


@needs_data
@needs_math_verify
def test_rule_percentages():
    assert graded(1027) == ("35\\%", True)  # "what percentage", gold 35
    assert graded(1042) == ("50\\%", True)
    assert graded(111) == ("20\\%", False)  # gold 8


@needs_data
@needs_math_verify
def test_rule_text_wrappers():
    assert graded(436) == ("4 \\text{ minutes}", True)
    text, gold = recorded(436)
    assert grade(extract_answer(text.replace("\\boxed{4 \\text{ minutes}}", "\\boxed{\\text{4 minutes}}")), gold)
    assert grade(extract_answer(text.replace("\\boxed{4 \\text{ minutes}}", "\\boxed{\\text{4}}")), gold)


@needs_data
@needs_math_verify
def test_rule_final_answer_marked_in_words_when_nothing_is_boxed():
    """No box and no answer in an answer block (or only a \\boxed{} / \\boxed{...} placeholder): the closing
    statement, when it concludes, is the final answer."""
    assert graded(292) == ("81", True)  # "We, therefore, conclude that the number ... is 81.\n</reasoning>"
    assert graded(488) == ("40", True)  # "Therefore, the number of Greek orange pies they can make is 40."
    assert graded(743) == ("1260", True)  # "Therefore, the total ... is \\( 1050 \\times 1.20 = 1260 \\).\n</ing>"
    assert graded(443) == ("$34", True)  # "So, each friend paid $102 / 3 = $34." then \\boxed{...}
    assert graded(589) == ("50 miles per hour", True)  # "Therefore, ... is 50 miles per hour." then \\boxed{}
    assert graded(24, MATH500_FILE) == ("\\pi", True)  # "Thus, the smallest possible value of \\( c \\) is \\( \\pi \\)."
    assert graded(960) == ("9 kids in the park", False)  # gold 18: read, and wrong
    # a "Therefore" in the middle is not a final answer: row 840 goes on ("Next, let's assume...") and is cut off
    assert graded(840) == (None, False)
    # a closing statement that does not conclude is not read (row 761: "- Average distance = 820 / 2 = 410 feet.")
    assert graded(761) == (None, False)


@needs_data
@needs_math_verify
def test_rule_never_a_number_from_the_reasoning_when_a_final_answer_is_marked():
    """The gold appears in the reasoning, the marked final answer is something else: wrong, whatever the reasoning."""
    assert graded(112) == ("5", False)  # "75 - 65 = 10" then \\boxed{5}, gold 10
    assert graded(190) == ("10", False)  # "80 + 20 = 100 dollars" then \\boxed{10}, gold 100
    assert graded(1015) == ("9", False)  # "54 - 33 = 21." then \\boxed{9}, gold 21
    text, gold = recorded(112)  # a final box cut off by the length limit is not replaced by an earlier number
    cut = text.split("<answer>")[0].replace("\\[ 75 - 65 = 10 \\]", "\\[ \\boxed{10} \\]") + "<answer>\n\\boxed{5"
    assert extract_answer(cut) is None and not grade(extract_answer(cut), gold)
