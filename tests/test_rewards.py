"""Rollout rewards: the math verifier on real answer formats (never raising), pairing, callables."""

import pytest

from hl_core.rollout.rewards import CallableReward, best_and_worst, extract_answer, format_ok, math_correct

CASES = [
    ("\\boxed{19}", "19", True),
    ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", True),
    ("So we get \\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", True),
    ("<answer>42</answer>", "42", True),
    ("<think>6 times 7</think> <answer>42</answer>", "42", True),
    ("<answer>\\boxed{42}</answer>", "42", True),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}", True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\boxed{10\\text{ cm}}", "10", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{[0, 1)}", "[0,1)", True),
    ("\\boxed{\\pi}", "\\pi", True),
    ("\\boxed{-3}", "-3", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{\\infty}", "\\infty", True),
    ("\\boxed{2^{10}}", "1024", True),
    ("The final answer is 19.", "19", True),
    ("\\boxed{7} then corrected to \\boxed{8}", "8", True),
    ("<answer>8</answer> (an earlier draft said \\boxed{7})", "8", True),
    ("\\boxed{20}", "19", False),
    ("\\boxed{3}", "-3", False),
    ("\\boxed{\\frac{1}{3}}", "0.33", False),
    ("\\boxed{(1, 2)}", "(2,1)", False),
    ("\\boxed{[0, 1)}", "[0,1]", False),
    ("", "19", False),
    ("   ", "19", False),
    (None, "19", False),
    ("I don't know.", "19", False),
    ("\\boxed{}", "19", False),
    ("<answer></answer>", "19", False),
    ("random garbage }}}{{{ \\boxed{", "19", False),
    ("\\boxed{\\frac{1}{0}}", "1", False),
    ("}" * 50 + "\\boxed{" * 50, "1", False),
    ("<think>unfinished reasoning", "5", False),
]


@pytest.mark.parametrize("completion, reference, expected", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_math_verdicts(completion, reference, expected):
    assert math_correct(completion, reference) is expected


def test_table_is_large_and_balanced():
    assert len(CASES) >= 30
    assert sum(e for _, _, e in CASES) >= 15 and sum(not e for _, _, e in CASES) >= 15


def test_extract_answer_priority():
    assert extract_answer("<answer>\\boxed{3}</answer>") == "3"
    assert extract_answer("x \\boxed{1} y \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert extract_answer("<answer> 8 </answer> \\boxed{7}") == "8"
    assert extract_answer("") is None and extract_answer(None) is None


def test_format_reward():
    assert format_ok("<think>a</think>\n<answer>1</answer>")
    assert not format_ok("<answer>1</answer>")
    assert not format_ok("<think>a</think><answer>1</answer> trailing")


def test_math_reward_weights():
    from hl_core.config.sections_run import RewardConfig
    from hl_core.rollout.rewards import MathReward

    reward = MathReward(RewardConfig(kind="math", accuracy_weight=8.0, format_weight=1.0))
    scores = reward([[]] * 3,
                    ["<think>t</think><answer>4</answer>", "\\boxed{4}", "<think>t</think><answer>5</answer>"],
                    ["4", "4", "4"])
    assert scores == [9.0, 8.0, 1.0]


@pytest.mark.parametrize(
    "scores, threshold, expected",
    [
        ([0.1, 0.9, 0.5, 0.2], 0.01, (1, 0, True)),
        ([0.5, 0.5, 0.5], 0.01, (0, 0, False)),           # all tied: no pair
        ([0.3, 0.305, 0.3], 0.01, (1, 0, False)),         # gap 0.005 <= threshold
        ([0.3, 0.32, 0.3], 0.01, (1, 0, True)),           # gap 0.02 > threshold
        ([1.0, 0.0, 1.0, 0.0], 0.5, (0, 1, True)),        # ties broken by the earliest generation
        ([-2.0, -1.0], 0.0, (1, 0, True)),
    ],
)
def test_best_vs_worst_pairing(scores, threshold, expected):
    assert best_and_worst(scores, threshold) == expected


def test_pair_examples_weights():
    from hl_core.rollout import _pair_examples, _unpaired_examples

    out = []
    kept = _pair_examples(out, [1, 2], [[5, 9], [6, 9], [7, 9]], [0.2, 0.9, 0.1], 0.01)
    assert kept == [1.0] and out[0]["chosen_input_ids"] == [1, 2, 6, 9] and out[0]["rejected_input_ids"] == [1, 2, 7, 9]
    assert out[0]["chosen_completion_mask"] == [0, 0, 1, 1] and out[0]["weight"] == 1.0
    out = []
    assert _unpaired_examples(out, [1], [[5], [6]], [0.5, 0.5], 0.01) == [0.0]
    assert [e["desirable"] for e in out] == [True, False] and all(e["weight"] == 0.0 for e in out)


def scripted(prompts, completions, references):
    return [float(len(c)) for c in completions]


def test_callable_reward_by_name():
    from types import SimpleNamespace

    reward = CallableReward(SimpleNamespace(function="test_rewards:scripted"))
    assert reward([[]] * 2, ["ab", "abcd"], [None, None]) == [2.0, 4.0]
    from hl_core.errors import RecipeError

    with pytest.raises(RecipeError):
        CallableReward(SimpleNamespace(function="no_such_module_xyz:fn"))
    with pytest.raises(RecipeError):
        CallableReward(SimpleNamespace(function="not-a-spec"))


@pytest.mark.parametrize("answer, reference", [
    ("0570", "570"), ("570", "0570"), ("1.50", "1.5"), ("-3", "-3"), ("+3", "3"), ("3", "-3"), ("12", "13"),
    ("0.1", "0.10"), ("007", "7"), ("1785", "1786"), ("1000", "1000.0"), ("2", "2.0001"),
])
def test_plain_number_fast_path_agrees_with_math_verify(answer, reference, monkeypatch):
    """Plain numbers skip math-verify; the verdict must be the one math-verify gives."""
    import math_verify

    from hl_core.rollout import rewards

    fast = math_correct(answer, reference)
    monkeypatch.setattr(rewards, "_plain_number", lambda text: None)  # force the math-verify path
    calls = []
    real_verify = math_verify.verify
    monkeypatch.setattr(math_verify, "verify", lambda *a, **k: calls.append(1) or real_verify(*a, **k))
    assert math_correct(answer, reference) == fast
    assert calls, "the slow path went through math-verify"
