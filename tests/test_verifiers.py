"""Unit tests for common/verifiers.py: extraction, math grading, format and exact checks."""

import threading
import time

import pytest

from common import math_grader as G
from common import verifiers as V

# ----------------------------------------------------------------------------------------------
# extraction
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{3} no wait \\boxed{5}", "5"),  # last box wins
        ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),  # balanced braces
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("\\boxed 5$", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{5} then \\boxed{\\frac{1}{", None),  # last box truncated -> nothing
        ("<answer> 42 </answer>", "42"),
        ("<answer>42</answer>", "42"),
        ("<answer>1</answer> <answer>$2$</answer>", "2"),
        ("<answer>\\boxed{9}</answer>", "9"),
        ("work...\nAnswer: 7", "7"),
        ("work...\n**Answer:** $\\frac{3}{4}$", "\\frac{3}{4}"),
        ("Final Answer: The final answer is $5$. I hope it is correct.", "5"),
        ("Final answer: $\\$18$.", "\\$18"),  # an escaped dollar does not end the math span
        ("Answer: 5.\nAnswer:", "5"),  # an empty Answer: line does not count
        ("\\boxed{$5$}", "5"),
        ("<answer>$$7$$</answer>", "7"),
        ("\\boxed{$69$,$84$}", "69, 84"),  # a list of $...$ spans is the list of their contents
        ("Answer: $69$, $84$.", "69, 84"),
        ("\\boxed{$x$ or $y$}", "$x$ or $y$"),  # several spans are not one pair of enclosing dollars
        ("\\boxed{\\(1\\), \\(2\\)}", "\\(1\\), \\(2\\)"),
        ("The answer is 42", None),  # no marker on purpose
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    assert V.extract_answer(completion) == expected


def test_extraction_is_linear_on_adversarial_text():
    adversarial = [
        "Answer: x" + " " * 100_000 + "y",  # quadratic for a lazy group followed by [ \t]*$
        "\\boxed{" + "$" * 100_000 + "}",
        "\\boxed{" + "{" * 100_000,
        "\\boxed{" * 20_000,
        "Answer: $" + "\\$" * 50_000,
        "\\boxed{" + "$1$," * 25_000 + "$}",
        "\\boxed{" + "\\(" * 50_000 + "x" + "\\)" * 50_000 + "}",
        "<think>" + "</thin" * 20_000,
    ]
    for text in adversarial:
        start = time.monotonic()
        V.extract_answer(text)
        V.format_reward_r1(text)
        assert time.monotonic() - start < 0.5, text[:20]


def test_last_boxed():
    assert V.last_boxed("a \\boxed{1} b \\boxed{x^{2}}") == "x^{2}"
    assert V.last_boxed("no box") is None
    assert V.last_boxed("\\boxedfoo{1}") is None  # a different macro


def test_extract_gsm8k_gold():
    assert V.extract_gsm8k_gold("He pays 2*500 = 1,000 dollars.\n#### 1,000") == "1000"
    assert V.extract_gsm8k_gold("a #### b #### -3 ") == "-3"


def test_extract_gsm8k_gold_missing_marker():
    with pytest.raises(ValueError, match="####") as err:
        V.extract_gsm8k_gold("The answer is 72 without a marker")
    assert "72 without a marker" in str(err.value)  # quotes the offending field
    with pytest.raises(ValueError, match="####"):
        V.extract_gsm8k_gold("#### ")


def test_extract_math_gold():
    assert V.extract_math_gold("So $x = \\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="boxed"):
        V.extract_math_gold("The answer is 5.")


# ----------------------------------------------------------------------------------------------
# grade_math
# ----------------------------------------------------------------------------------------------

GSM8K_FIELD = "Each costs 500, so 2*500 = 1,000.\n#### 1,000"

TRUE_CASES = [
    ("The total is \\boxed{1000}.", V.extract_gsm8k_gold(GSM8K_FIELD)),
    ("The total is \\boxed{1,000}.", "1000"),
    ("The total is \\boxed{1000}.", "1,000"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{2}{4}}", "\\frac{1}{2}"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{\\$18}", "18"),
    ("\\boxed{x=3}", "3"),
    ("\\boxed{72.0}", "72"),
    ("\\boxed{3} hmm, actually \\boxed{5}", "5"),  # last box wins
    ("<answer> 42 </answer>", "42"),
    ("<answer>42</answer>", "42"),
    ("<answer>42</answer>", "84/2"),  # not an exact string match: goes through math-verify
    ("Step 1...\nAnswer: 7", "7"),
    ("Step 1...\nAnswer: $7.0$", "7"),
    ("\\boxed{(1,2)}", "(1, 2)"),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("so $\\boxed{\\text{(C)}}$", "\\text{(C)}"),
    ("\\boxed{(-\\infty, 3)}", "x<3"),  # verify() is asymmetric; this pair pins gold-first order
    ("\\boxed{7}", "$7$"),
    ("\\boxed{\\frac{1}{2}}", "$\\frac{1}{2}$"),
    # OlympiadBench stores a multi-answer gold as $...$ spans joined by commas
    ("\\boxed{69, 84}", "$69$,$84$"),
    ("\\boxed{69,84}", "$69$,$84$"),
    ("Answer: $69$, $84$", "$69$,$84$"),
    ("\\boxed{x=1, y=2}", "$x=1$, $y=2$"),
]

FALSE_CASES = [
    ("\\boxed{3} hmm, actually \\boxed{5}", "3"),  # an earlier box does not count
    ("\\boxed{4}", "3"),
    ("\\boxed{-5}", "5"),
    ("\\boxed{0.49}", "\\frac{1}{2}"),
    ("\\boxed{1001}", "1,000"),
    ("<answer>41</answer>", "42"),
    ("Answer: 8", "7"),
    ("The answer is 42", "42"),  # no answer marker
    ("", "3"),  # empty completion
    ("\\boxed{}", "3"),
    ("\\boxed{5}", ""),  # empty gold
    ("\\boxed{???}", "???"),  # unparsable gold, even with an identical prediction
    ("\\boxed{\\frac{}", "\\frac{"),
    ("\\boxed{x^2+2x}", "(x+1)^2"),
    ("\\boxed{x<3}", "(-\\infty, 3)"),  # True if verify() were called as verify(pred, gold)
    ("\\boxed{69}", "$69$,$84$"),  # one element of a multi-answer gold is not the answer
    ("\\boxed{84}", "$69$,$84$"),
    ("\\boxed{69, 85}", "$69$,$84$"),
]


@pytest.mark.parametrize("completion, gold", TRUE_CASES)
def test_grade_math_true(completion, gold):
    assert V.grade_math(completion, gold) is True


@pytest.mark.parametrize("completion, gold", FALSE_CASES)
def test_grade_math_false(completion, gold):
    assert V.grade_math(completion, gold) is False


def test_grade_math_batch_matches_single_calls():
    cases = TRUE_CASES + FALSE_CASES
    got = V.grade_math_batch([c for c, _ in cases], [g for _, g in cases])
    assert got == [True] * len(TRUE_CASES) + [False] * len(FALSE_CASES)
    with pytest.raises(ValueError, match="2 golds"):
        V.grade_math_batch(["\\boxed{1}"], ["1", "2"])


def test_fast_path_agrees_with_math_verify():
    # The sympy-free fast paths must decide exactly as math-verify itself does.
    for gold in ["1000", "-7", "0.25", "\\frac{3}{4}"]:
        assert G.verify_answer(gold, gold) is True
    for gold, pred in [("3", "4"), ("100000000000000000000", "100000000000000000001")]:
        assert G.verify_answer(gold, pred) is False  # integers: exact, like the fast path
    for gold, pred in [("7", "007"), ("0", "-0")]:
        assert G.verify_answer(gold, pred) is True
        assert V.grade_math(f"\\boxed{{{pred}}}", gold) is True
    assert G.verify_answer("???", "???") is False  # raw-string fallback of math-verify refused


def test_grade_math_off_main_thread():
    results = {}

    def run(key, completion, gold):
        results[key] = V.grade_math(completion, gold)

    threads = [
        threading.Thread(target=run, args=("right", "\\boxed{\\frac{2}{4}}", "0.5")),
        threading.Thread(target=run, args=("wrong", "\\boxed{\\frac{3}{4}}", "0.5")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {"right": True, "wrong": False}


PATHOLOGICAL = {
    "nested_frac_open": "\\boxed{" + "\\frac{" * 200 + "}",
    "nested_frac_balanced": "\\boxed{" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "}",
    "digits_5000": "\\boxed{" + "7" * 5000 + "}",
    "chars_100k_boxed": "\\boxed{" + "1+" * 50_000 + "1}",
    "chars_100k_text": "x" * 100_000,
    "power_tower": "\\boxed{9^{9^{9^{9^{9}}}}}",
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_outputs_are_bounded(name):
    timeout_s = 1.5
    start = time.monotonic()
    result = V.grade_math(PATHOLOGICAL[name], "1", timeout_s=timeout_s)
    elapsed = time.monotonic() - start
    assert result is False
    assert elapsed < timeout_s + 2.0, f"{name} took {elapsed:.1f} s"


def test_pool_still_works_after_timeouts():
    start = time.monotonic()
    got = V.grade_math_batch(
        [PATHOLOGICAL["power_tower"], "\\boxed{\\frac{1}{2}}", "\\boxed{3}"],
        ["1", "0.5", "4"],
        timeout_s=1.5,
    )
    assert got == [False, True, False]
    assert time.monotonic() - start < 1.5 + 2.0
    assert V.grade_math("\\boxed{" + "7" * 5000 + "}", "7" * 5000) is True


# ----------------------------------------------------------------------------------------------
# tiny-task checker, format check, rewards
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("49+97=146;146-53=93;\\boxed{93}", "93", True),
        ("\\boxed{ 93 }", "93", True),
        ("\\boxed{93}", " 93\n", True),
        ("\\boxed{92} \\boxed{93}", "93", True),
        ("\\boxed{93} \\boxed{92}", "93", False),
        ("\\boxed{93.0}", "93", False),  # exact match, no sympy
        ("\\boxed{-93}", "93", False),
        ("93", "93", False),
        ("", "93", False),
    ],
)
def test_grade_boxed_exact(completion, gold, expected):
    assert V.grade_boxed_exact(completion, gold) is expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>reason</think><answer>42</answer>", True),
        ("<think>\nreason\n</think>\n<answer>\n42\n</answer>\n", True),
        (" reason started by the template</think> <answer>42</answer>", True),
        ("<think>a</think><answer>42</answer> trailing text", False),
        ("<think>a</think> extra <answer>42</answer>", False),
        ("<think>a</think><answer> </answer>", False),
        ("<answer>42</answer><think>a</think>", False),
        ("<think>a</think><think>b</think><answer>42</answer>", False),
        ("<think>a</think><answer>1</answer><answer>2</answer>", False),
        ("<think>a<answer>42</answer>", False),
        ("42", False),
    ],
)
def test_format_reward_r1(completion, expected):
    assert V.format_reward_r1(completion) is expected


def test_reward_functions_and_registry():
    assert V.get_reward_fn("math")("\\boxed{0.5}", "\\frac{1}{2}") == V.RewardOutput(1.0, True)
    assert V.get_reward_fn("math")("\\boxed{2}", "3") == V.RewardOutput(0.0, False)
    assert V.get_reward_fn("exact")("\\boxed{12}", "12") == V.RewardOutput(1.0, True)
    assert V.get_reward_fn("exact")("\\boxed{12.0}", "12") == V.RewardOutput(0.0, False)
    assert set(V.REWARD_FNS) == {"math", "exact", "code", "code-partial", "per-row"}
    assert V.compute_rewards("math", ["\\boxed{1/2}", "\\boxed{1}"], ["0.5", "0.5"]) == [
        V.RewardOutput(1.0, True),
        V.RewardOutput(0.0, False),
    ]


def test_get_reward_fn_unknown_name():
    with pytest.raises(ValueError) as err:
        V.get_reward_fn("nope")
    message = str(err.value)
    assert "'nope'" in message and "'exact'" in message and "'math'" in message
