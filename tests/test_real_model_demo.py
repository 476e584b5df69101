"""The real-model demo's task (eval/addition.py, recipes/real/smollm2_addition_grpo.yaml): the shipped data is
exactly what the generator writes, train and held-out problems are disjoint, the reward by hand, the plot. No model
is loaded here (the recipe's 2-update run is in test_real_model_runs.py)."""

from __future__ import annotations

import json

import pytest

from eval import addition
from helpers import REPO


def test_shipped_data_is_what_the_generator_writes(tmp_path):
    for path in addition.write(tmp_path):
        assert path.read_bytes() == (REPO / "recipes/real/data" / path.name).read_bytes(), path.name


def test_problems_are_disjoint_and_right():
    rows = addition.problems()
    train, held_out = rows["train"], rows["eval"]
    assert (len(train), len(held_out)) == (addition.TRAIN_ROWS, addition.EVAL_ROWS)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert row["answer"] == str(a + b) and 10 <= a <= 49 and 10 <= b <= 49


@pytest.mark.parametrize("completion, score", [
    ("70", 1.0), (" 70.", 1.0), ("070", 1.0), ("34 + 36 = 70", 0.5 - 0.10), ("The answer is 71", -0.14),
    ("170", -0.01), ("To add 34 and 36, we need to add", -0.25), ("", 0.0), ("70 apples", 0.5 - 0.07),
])
def test_sum_credit_by_hand(completion, score):
    assert addition.sum_credit(None, [completion], ["70"]) == [pytest.approx(score)]


def test_sum_credit_needs_the_reference():
    with pytest.raises(ValueError, match="reference"):
        addition.sum_credit(None, ["70"], [None])


def test_accuracy_counts_the_number_alone():
    assert addition.accuracy(["70", "34 + 36 = 70", " 12.", "x"], ["70", "70", "12", "5"]) == 0.5


def test_holds_sum_counts_the_right_sum_anywhere():
    assert addition.holds_sum(["70", "34 + 36 = 70", "34 + 36 = 71", "700", "To add 34"], ["70"] * 5) == 2


def test_plot_of_runs(tmp_path):
    run = tmp_path / "seed0"
    run.mkdir()
    rows = [(0, 0.1), (4, 0.5)]
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "reward": r}) + "\n" for s, r in rows))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n"
                                               for s in range(4)))
    out = addition.plot_runs([run], tmp_path / "curve.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
