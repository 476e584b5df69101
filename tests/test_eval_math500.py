"""MATH500 through real lm-eval and real math-verify, offline: planted scripted "models" (an lm-eval LM
subclass registered as ``hl_scripted``) and a tiny random-init Llama on the ``hf`` backend, on the
20-problem fixture ``tests/fixtures/eval/math500_20.jsonl`` (MATH-500 schema)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from eval._common import EvalError
from eval.lm import SCRIPTED_NAME, ScriptedLM
from eval.math500 import TASK_DIR, run_math500
from eval.math500.tasks import utils as m5
from helpers import REPO, _env

DATA = REPO / "tests" / "fixtures" / "eval" / "math500_20.jsonl"
TINY = REPO / "tests" / "fixtures" / "tiny" / "model"
ROWS = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


pytestmark = pytest.mark.usefixtures("no_network")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_causal")
    config = AutoConfig.from_pretrained(TINY, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(TINY)
    tok.model_max_length = 1024
    tok.save_pretrained(out)
    return out


def _problem_of(context: str):
    hits = [r for r in ROWS if r["problem"] in context]
    assert len(hits) == 1, f"expected exactly one problem in the prompt, got {len(hits)}"
    return hits[0]


def _correct_reply(row, k=0):
    """Correct answers in the formats models produce: <answer> tags, \\boxed{}, $...$ in prose."""
    styles = [
        "<think>Let me work it out.</think><answer>{a}</answer>",
        "We compute carefully, so the final answer is $\\boxed{{{a}}}$.",
        "<think>...</think> <answer>The answer is ${a}$.</answer>",
    ]
    return styles[(ROWS.index(row) + k) % len(styles)].format(a=row["answer"])


def test_fixture_is_math500_schema():
    assert len(ROWS) == 20
    for r in ROWS:
        assert set(r) == {"problem", "solution", "answer", "subject", "level", "unique_id"}
        assert "\\boxed" in r["solution"]
        # the fixture's own solutions verify against its answers (real math-verify)
        assert m5.is_correct(r["solution"], r), r["answer"]


def test_task_yaml_is_an_lm_eval_task():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    assert "hl_math500" in tm.all_tasks


def test_planted_correct_model_scores_one(tmp_path):
    lm = ScriptedLM(lambda ctx, gen, k: _correct_reply(_problem_of(ctx), k))
    res = run_math500(lm, data=str(DATA), n_samples=3, output_dir=tmp_path)
    assert res["pass@1"] == 1.0 and res["pass@1_std"] == 0.0 and res["pass@n"] == 1.0
    assert res["pass@1_per_sample"] == [1.0, 1.0, 1.0]
    assert res["n_problems"] == 20 and res["n_samples"] == 3
    assert res["backend"] == f"custom:{ScriptedLM.__name__}"
    saved = json.loads((tmp_path / "math500.json").read_text())
    assert saved["pass@1"] == 1.0 and saved["pass@1_std"] == 0.0
    # the versions the verdicts depend on (issue 56): the pinned parser runtime, math-verify, sympy
    assert saved["scorer_versions"]["antlr4-python3-runtime"] == m5.PARSER_RUNTIME_PIN
    assert {"math-verify", "sympy", "latex2sympy2_extended"} <= set(saved["scorer_versions"])
    samples = [json.loads(line) for line in (tmp_path / "math500_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 20 and all(s["correct"] == [1, 1, 1] for s in samples)
    assert {s["unique_id"] for s in samples} == {r["unique_id"] for r in ROWS}


def test_planted_wrong_model_scores_zero(tmp_path):
    lm = ScriptedLM(lambda ctx, gen, k: "<think>guess</think><answer>1000</answer>")
    res = run_math500(lm, data=str(DATA), n_samples=2, output_dir=tmp_path)
    assert res["pass@1"] == 0.0 and res["pass@1_std"] == 0.0 and res["pass@n"] == 0.0


def test_pass_at_1_mean_and_std_across_samples_by_hand():
    """Sample k of problem i is right iff (i < 10) or k == 0: per-sample pass@1 = [1, .5, .5, .5]."""
    def reply(ctx, gen, k):
        row = _problem_of(ctx)
        ok = ROWS.index(row) < 10 or k == 0
        return _correct_reply(row, k) if ok else "\\boxed{1000}"

    lm = ScriptedLM(reply)
    res = run_math500(lm, data=str(DATA), n_samples=4)
    per_sample = [1.0, 0.5, 0.5, 0.5]
    mean = sum(per_sample) / 4
    std = math.sqrt(sum((p - mean) ** 2 for p in per_sample) / 4)
    assert res["pass@1_per_sample"] == per_sample
    assert res["pass@1"] == pytest.approx(mean)
    assert res["pass@1_std"] == pytest.approx(std)
    assert res["pass@n"] == 1.0


def test_paper_sampling_settings_and_prompt_reach_the_model():
    lm = ScriptedLM(lambda ctx, gen, k: _correct_reply(_problem_of(ctx), k))
    res = run_math500(lm, data=str(DATA), n_samples=2, limit=5)
    assert len(lm.calls) == 5 * 2  # n samples per problem
    context, gen = lm.calls[0]
    assert gen["temperature"] == 0.6 and gen["top_p"] == 0.95 and gen["max_gen_toks"] == 2048
    assert gen["do_sample"] is True
    assert m5.SYSTEM_PROMPT_R1 in context and context.startswith("<|system|>")
    assert res["sampling"]["temperature"] == 0.6 and res["chat_template"] is True
    # greedy + the boxed prompt
    lm2 = ScriptedLM(lambda ctx, gen, k: "\\boxed{0}")
    run_math500(lm2, data=str(DATA), temperature=0.0, prompt="boxed", max_new_tokens=64, limit=2)
    ctx2, gen2 = lm2.calls[0]
    assert gen2["do_sample"] is False and gen2["max_gen_toks"] == 64
    assert m5.BOXED_INSTRUCTION in ctx2 and m5.SYSTEM_PROMPT_R1 not in ctx2


def test_hf_backend_tiny_model_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    res = run_math500(
        str(tiny_model_dir), data=str(DATA), backend="hf", n_samples=2, max_new_tokens=8, batch_size=8,
        output_dir=tmp_path,
    )
    assert res["backend"] == "hf" and res["chat_template"] is True
    assert res["n_problems"] == 20 and res["n_samples"] == 2
    assert 0.0 <= res["pass@1"] <= 1.0 and res["pass@1_std"] >= 0.0
    assert len(res["pass@1_per_sample"]) == 2
    saved = json.loads((tmp_path / "math500.json").read_text())
    assert {"pass@1", "pass@1_std", "pass@n", "sampling", "data"} <= set(saved)


def test_offline_rejects_hub_dataset(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EvalError, match="offline"):
        run_math500(ScriptedLM(), data=None)


def test_bad_local_rows_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?"}) + "\n")
    with pytest.raises(EvalError, match="problem"):
        run_math500(ScriptedLM(), data=str(bad))


def test_scripted_lm_is_registered_in_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model(SCRIPTED_NAME) is ScriptedLM


def test_cli_offline_subprocess(tiny_model_dir, tmp_path):
    """``python -m eval MODEL --offline --math500 FILE --data-quality FILE`` with the hub switched off."""
    out = tmp_path / "out"
    env = _env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "eval", str(tiny_model_dir), "--offline", "--output", str(out),
        "--math500", str(DATA), "--samples", "2", "--max-new-tokens", "4", "--batch-size", "8", "--limit", "6",
        "--data-quality", str(REPO / "tests/fixtures/tiny/prefs/eval.jsonl"), "--dq-limit", "5",
        "--dq-max-length", "64", "--dq-max-prompt-length", "32",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = json.loads((out / "math500.json").read_text())
    assert m["n_problems"] == 6 and m["n_samples"] == 2 and "pass@1_std" in m
    d = json.loads((out / "data_quality.json").read_text())
    assert d["data"]["n_records"] == 5
    # a model directory target with nothing to do is a user error (exit 2)
    proc = subprocess.run([sys.executable, "-m", "eval", str(tiny_model_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nothing to evaluate" in proc.stderr


def test_every_eval_flag_reaches_its_settings_key():
    """`python -m eval` flags: each one lands on its block's key; none is parsed and then ignored."""
    from eval.__main__ import CLI_BLOCK_FLAGS, CLI_KEYS, apply_cli, build_parser

    parser = build_parser()
    handled = {"target", "output", "overrides", "offline", *CLI_BLOCK_FLAGS.values()}
    mapped = {attribute for pairs in CLI_KEYS.values() for attribute, _ in pairs}
    assert {action.dest for action in parser._actions if action.dest != "help"} == handled | mapped

    argv = ["model_dir", "--offline", "--backend", "hf", "--batch-size", "4", "--seed", "7", "--dtype", "float32",
            "--no-chat-template", "--math500", "m.jsonl", "--samples", "3", "--temperature", "0.5", "--top-p", "0.9",
            "--max-new-tokens", "64", "--prompt", "boxed", "--limit", "10", "--alpaca", "--judge", "rm:x",
            "--alpaca-max-new-tokens", "32", "--alpaca-temperature", "0.2", "--alpaca-top-p", "0.8",
            "--alpaca-limit", "5", "--rm-mode", "soft", "--data-quality", "d.jsonl", "--dq-limit", "9",
            "--dq-kind", "groups"]
    settings = {"math500": {"data": "default"}, "alpaca_eval": {"data": "default", "temperature": 0.7},
                "data_quality": {}}
    blocks = apply_cli(settings, parser.parse_args(argv))
    assert blocks == ["math500", "alpaca_eval", "data_quality"] and settings["offline"] is True
    shared = {"backend": "hf", "batch_size": 4, "seed": 7, "dtype": "float32", "chat_template": False}
    assert settings["math500"] == {"data": "m.jsonl", **shared, "n_samples": 3, "temperature": 0.5, "top_p": 0.9,
                                   "max_new_tokens": 64, "prompt": "boxed", "limit": 10}
    assert settings["alpaca_eval"] == {"data": "default", **shared, "judge": "rm:x", "max_new_tokens": 32,
                                       "temperature": 0.2, "top_p": 0.8, "limit": 5, "rm_mode": "soft"}
    assert settings["data_quality"] == {"data": "d.jsonl", "limit": 9, "kind": "groups"}

    untouched = {"math500": {"temperature": 0.6}, "alpaca_eval": {}, "data_quality": {}}
    assert apply_cli(untouched, parser.parse_args(["model_dir"])) == []
    assert untouched == {"math500": {"temperature": 0.6}, "alpaca_eval": {}, "data_quality": {}}
