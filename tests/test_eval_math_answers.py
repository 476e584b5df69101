"""MATH-500 answer checking (issue 56): the extraction rule and normal form of ``eval/math500/tasks/answer.py``, the
pack's verdicts against a person's on the graded table ``tests/fixtures/eval/math_graded_pairs.jsonl`` (real
math-verify), the pinned LaTeX parser runtime and its refusal, and ``python -m eval.math500.agreement``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from eval._common import EvalError
from eval.math500 import agreement, run_math500
from eval.math500.tasks import answer as A, utils as m5
from helpers import REPO, _env

TABLE = agreement.read_table()
GRADED = [r for r in TABLE if r["human"] != "ambiguous"]
ISSUE_FORMS = {"several boxes", "thousands", "fbox", "trailing period", "repeating decimal", "scientific", "percent",
               "text", "answer tag"}


# ------------------------------------------------------------------------------------------- the graded table


def test_the_graded_table_covers_the_forms_with_a_reason_for_every_grade():
    assert len(TABLE) >= 150 and len({r["id"] for r in TABLE}) == len(TABLE)
    for r in TABLE:
        assert r["human"] in agreement.VERDICTS and r["reason"].strip() and r["problem"].strip(), r["id"]
        assert isinstance(r["gold"], str) and isinstance(r["completion"], str), r["id"]
    forms = {r["form"] for r in TABLE}
    assert ISSUE_FORMS <= forms and "ordinary" in forms
    for form in ISSUE_FORMS:  # each form has answers a checker must accept and answers it must reject
        assert {r["human"] for r in TABLE if r["form"] == form} >= {"correct", "wrong"}, form
    noted = [r for r in TABLE if "scorer_disagrees" in r]
    assert len(noted) <= 3 and all(r["human"] == "correct" for r in noted)  # documented: false rejects only


def test_the_pack_agrees_with_the_person_on_every_unambiguous_pair_but_the_documented_ones():
    """No false accept at all; the false rejects are exactly the rows whose `scorer_disagrees` says why (<= 3)."""
    false_accepts, false_rejects = [], []
    for r in GRADED:
        verdict = m5.is_correct(r["completion"], {"answer": r["gold"]})
        if verdict and r["human"] == "wrong":
            false_accepts.append((r["id"], r["gold"], r["completion"]))
        if not verdict and r["human"] == "correct":
            false_rejects.append(r["id"])
    assert false_accepts == []
    assert false_rejects == [r["id"] for r in GRADED if "scorer_disagrees" in r]
    assert len(false_rejects) <= 3


def test_math_verify_alone_gets_the_issue_forms_wrong_so_the_table_can_fail_a_checker():
    """The control: math-verify with its defaults, on the same rows, falsely accepts `1\\,234` for 235 and
    rejects many right answers the pack accepts."""
    rows = [r for r in GRADED if r["form"] in ("thousands", "trailing period", "repeating decimal", "scientific")]
    wrong = [r["id"] for r in rows
             if agreement.math_verify_alone(r["gold"], r["completion"]) != (r["human"] == "correct")]
    accepted_sum = agreement.math_verify_alone("235", r"$\boxed{1\,234}$")
    assert accepted_sum and len(wrong) >= 10


# ------------------------------------------------------------------------------------------- extraction rule


@pytest.mark.parametrize("completion, expected", [
    (r"\boxed{3} wait, that is wrong: it is \boxed{5}", ("5", True)),
    (r"$x = \boxed{-2}$ or $x = \boxed{1}$", ("-2, 1", True)),
    (r"\boxed{1}, \boxed{2} and \boxed{3}", ("1, 2, 3", True)),
    (r"\boxed{\frac{1}{2}}", (r"\frac{1}{2}", True)),
    (r"So $\fbox{7}$.", ("7", True)),
    (r"the sum is \boxed 5$", ("5", True)),
    (r"<think>\boxed{4}</think><answer>6</answer>", ("6", False)),
    (r"<answer>4</answer> no: <answer>\boxed{6}</answer>", ("6", True)),
    ("<think>..</think><answer> 42", ("42", False)),
    ("The answer is 12.", ("The answer is 12.", False)),
    (r"cut off \boxed{\frac{1}{", (r"\frac{1}{", True)),
])
def test_final_answer_takes_the_last_box_or_answer_tag(completion, expected):
    assert A.final_answer(completion) == expected


@pytest.mark.parametrize("text, expected", [
    ("1,234", "1234"), ("1{,}234", "1234"), (r"1\,234", "1234"), ("1\u2009234", "1234"), ("1\u202f234", "1234"),
    ("1 234", "1234"), (r"1\ 234", "1234"), (r"1\thinspace 234", "1234"), ("12,345,678", "12345678"),
    ("1,234.5", "1234.5"), (r"x = 1{,}000", "x = 1000"),
    # not thousands: lists, pairs, other groupings, a leading zero, mixed separators
    ("1,23", "1,23"), ("0,123", "0,123"), ("(1,234)", "(1,234)"), ("1, 234", "1, 234"), ("1,234, 5", "1,234, 5"),
    ("12,34,567", "12,34,567"), (r"1,234\,567", r"1,234\,567"), ("1234,5678", "1234,5678"),
])
def test_thousands_separators_only_where_they_separate_thousands(text, expected):
    assert A.strip_thousands(text) == expected


def test_prose_keeps_plain_commas_and_spaces():
    assert A.strip_thousands("2 100 times, 1,234", plain=False) == "2 100 times, 1,234"
    assert A.strip_thousands(r"about $1\,234$ apples", plain=False) == "about $1234$ apples"


@pytest.mark.parametrize("text, expected", [
    ("5.", "5"), ("$5$.", "5"), (r"\frac{1}{2}.", r"\frac{1}{2}"), ("1, 2, ...", "1, 2, ..."), ("5.0", "5.0"),
    (r"0.\overline{3}", r"\frac{1}{3}"), (r"0.1\overline{6}", r"\frac{1}{6}"), (r"-1.\overline{3}", r"-\frac{4}{3}"),
    (r"0.\overline{9}", "1"), (r"0.\overline3", r"\frac{1}{3}"), (r"\overline{AB}", r"\overline{AB}"),
    ("3.2e4", "32000"), ("3.2E-4", "0.00032"), ("-1.5e+3", "-1500"), (r"6.02\times10^{23}", "6" + "02" + "0" * 21),
    (r"2 \cdot 10^3", "2000"), ("2e", "2e"), ("x^3e4", "x^3e4"), (r"2^3\times 10^2", r"2^3\times 10^2"),
    (r"25\%", "25"), ("12.5%", "12.5"), (r"12.5\text{%}", "12.5"), ("50 percent", "50"), (r"30\text{ percent}", "30"),
    (r"2\frac{1}{4}", r"\frac{9}{4}"), (r"-2\dfrac{1}{4}", r"-\frac{9}{4}"), (r"2\frac{5}{4}", r"2\frac{5}{4}"),
    (r"x\frac{1}{4}", r"x\frac{1}{4}"), (r"3\frac{\pi}{2}", r"3\frac{\pi}{2}"),
])
def test_normal_form(text, expected):
    assert A.normalize(text) == expected


def test_spacing_between_digits_that_is_no_thousands_separator_is_no_answer():
    assert A.spaced_digits(A.normalize(r"1\,23")) and A.spaced_digits("2 3")
    assert not A.spaced_digits(A.normalize(r"1\,234")) and not A.spaced_digits(r"\begin{pmatrix} 3 \\ 7 \end{pmatrix}")
    assert m5.parse_prediction(r"\boxed{1\,23}") == []
    assert not m5.is_correct(r"\boxed{1\,23}", {"answer": "24"})


def test_text_answers():
    assert A.text_answer(r"\text{(C)}") == "c" and A.text_answer(r"\text{Monday}") == "monday"
    assert A.text_answer(r"5\text{ cm}") is None and A.text_answer("x") is None and A.text_answer(r"\text{(2)}") is None
    assert A.canonical_text(r"\textbf{ East }.") == "east" and A.canonical_text("(C)") == "c"
    assert A.text_in_prose("So the final answer is Monday.\n") == "Monday"
    assert A.text_in_prose("Tuesday") == "Tuesday" and A.text_in_prose("I do not know what day it is today") is None
    assert m5.is_correct("<answer>Monday</answer>", {"answer": r"\text{Monday}"})
    assert not m5.is_correct(r"\boxed{Dynamo}", {"answer": r"\text{Monday}"})


# ------------------------------------------------------------------------------------------- the pinned runtime


def test_the_suite_runs_on_the_pinned_runtime_and_the_extra_and_container_pin_it():
    assert m5.parser_runtime_problem() is None
    pin = f"{m5.PARSER_RUNTIME}=={m5.PARSER_RUNTIME_PIN}"
    setup_py = (REPO / "setup.py").read_text()
    eval_extra = re.search(r'"eval": \[([^\]]*)\]', setup_py).group(1)
    assert f'"{pin}"' in eval_extra
    cluster = [line.split("#")[0].strip() for line in (REPO / "requirements/cluster.txt").read_text().splitlines()]
    assert pin in cluster
    assert set(m5.scorer_versions()) == {"math-verify", "latex2sympy2_extended", m5.PARSER_RUNTIME, "sympy"}


@pytest.mark.parametrize("installed", ["4.11.0", None])
def test_another_runtime_is_refused_in_one_paragraph(installed, monkeypatch):
    real = m5.installed_version
    monkeypatch.setattr(m5, "installed_version", lambda name: installed if name == m5.PARSER_RUNTIME else real(name))
    with pytest.raises(EvalError) as err:
        run_math500(object(), data=str(REPO / "tests/fixtures/eval/math500_20.jsonl"))
    text = str(err.value)
    assert "\n" not in text and f"pip install {m5.PARSER_RUNTIME}=={m5.PARSER_RUNTIME_PIN}" in text
    assert (f"has {m5.PARSER_RUNTIME} 4.11.0" if installed else "is not installed") in text
    with pytest.raises(m5.ParserRuntimeError, match="pinned to"):
        m5.is_correct(r"\boxed{1}", {"answer": "1"})


def test_the_cli_refuses_another_runtime_with_exit_2(tmp_path):
    """An environment whose installed antlr4-python3-runtime says 4.11.0 (its metadata first on the path):
    `python -m eval MODEL --math500 FILE` prints the paragraph and exits 2, before loading anything."""
    dist = tmp_path / "site" / "antlr4_python3_runtime-4.11.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: antlr4-python3-runtime\nVersion: 4.11.0\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{env['PYTHONPATH']}"
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    cmd = [sys.executable, "-m", "eval", str(REPO / "tests/fixtures/tiny/model"), "--offline", "--output",
           str(tmp_path / "out"), "--math500", str(REPO / "tests/fixtures/eval/math500_20.jsonl")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    paragraph = proc.stderr.strip().splitlines()[-1]
    assert paragraph.startswith("error: ") and "MATH-500 answer checking is pinned to antlr4-python3-runtime==4.13.2" \
        in paragraph
    assert "has antlr4-python3-runtime 4.11.0" in paragraph and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "math500.json").exists()


@pytest.mark.parametrize("mode", ["--validate", "train"])
def test_the_launcher_refuses_another_runtime_before_training(tmp_path, mode):
    """A recipe that runs MATH-500 after training, in an environment whose runtime says 4.11.0: `--validate` and the
    run itself exit 2 with the runtime's paragraph before any update (no checkpoint, no metrics), not hours later
    when the scorer starts. Without MATH-500 the same environment trains."""
    dist = tmp_path / "site" / "antlr4_python3_runtime-4.11.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: antlr4-python3-runtime\nVersion: 4.11.0\n")
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{env['PYTHONPATH']}"
    out = tmp_path / "run"
    cmd = [sys.executable, "launchers/run.py", "recipes/tiny/humanline_dpo.yaml", f"output_dir={out}",
           "eval.math500.enabled=true", "eval.math500.data=tests/fixtures/eval/math500_20.jsonl",
           "train.max_steps=1"] + ([mode] if mode.startswith("--") else [])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    paragraph = proc.stderr.strip().splitlines()[-1]
    assert paragraph.startswith("error: MATH-500 answer checking is pinned to antlr4-python3-runtime==4.13.2")
    assert "Traceback" not in proc.stderr and not (out / "metrics.jsonl").exists()
    if mode == "train":  # the same environment, MATH-500 off: it trains (the check is the runtime's, not the env's)
        ok = subprocess.run(cmd[:3] + [f"output_dir={tmp_path / 'plain'}", "train.max_steps=1"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
        assert ok.returncode == 0, ok.stderr[-3000:]


# ------------------------------------------------------------------------------------------- the agreement script


def test_agreement_summary_counts_false_accepts_and_rejects_by_hand():
    rows = [dict(id=1, form="a", human="correct"), dict(id=2, form="a", human="wrong"),
            dict(id=3, form="b", human="correct"), dict(id=4, form="b", human="ambiguous")]
    summary = agreement.summarize(rows, {"x": {1: True, 2: True, 3: False, 4: True}, "y": {1: True, 2: False,
                                                                                          3: True, 4: False}})
    x, y = summary["checkers"]["x"], summary["checkers"]["y"]
    assert (summary["n_graded"], summary["n_ambiguous"]) == (3, 1)
    assert (x["agree"], x["false_accepts"], x["false_rejects"], x["per_form"]) == (1, [2], [3], {"a": (1, 2),
                                                                                               "b": (0, 1)})
    assert (y["agree"], y["rate"]) == (3, 1.0)
    table = agreement.markdown(summary)
    assert "| x | 1/3 (33.3%) | 1 | 1 |" in table and "| b | 0/1 | 1/1 |" in table


def test_agreement_script_runs_on_a_small_table(tmp_path, capsys):
    small = tmp_path / "pairs.jsonl"
    rows = [r for r in TABLE if r["form"] == "trailing period"]
    small.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert agreement.main(["--table", str(small), "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    pack = out["summary"]["checkers"]["hl_math500 (this pack)"]
    assert pack["agree"] == len(rows) and out["versions"]["here"][m5.PARSER_RUNTIME] == m5.PARSER_RUNTIME_PIN
    assert "| hl_math500 (this pack) |" in capsys.readouterr().out
