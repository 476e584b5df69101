"""AlpacaEval offline: generation (scripted model and a tiny HF model with its chat template), judging
through ``alpaca_eval.main.evaluate`` with a callable judge and with a locally built reward model (a tiny
random-init sequence classifier), win rates checked against hand computations; the length-controlled
win rate through alpaca_eval's GLM when its inputs are given; the GPT-4.1 API judge config."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eval._common import EvalError
from eval.alpaca import run_alpaca_eval
from eval.alpaca.judges import (
    DEFAULT_API_JUDGE,
    RewardModelJudge,
    api_judge_config,
    check_preference,
    reward_preference,
)
from eval.lm import ScriptedLM
from helpers import REPO

DATA = REPO / "tests" / "fixtures" / "eval" / "alpaca_eval_6.json"
TINY = REPO / "tests" / "fixtures" / "tiny" / "model"
ROWS = json.loads(DATA.read_text())
# scripted model replies, one per instruction (same order as the fixture)
REPLIES = ["x" * 500, "short", "y" * 300, "z", ROWS[4]["output"], "q" * 10]


pytestmark = pytest.mark.usefixtures("no_network")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """A tiny causal LM (the evaluated model) and a tiny sequence classifier (the reward model), saved locally."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM, LlamaForSequenceClassification

    root = tmp_path_factory.mktemp("alpaca_models")
    tok = AutoTokenizer.from_pretrained(TINY)
    tok.model_max_length = 1024
    config = AutoConfig.from_pretrained(TINY, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root / "policy")
    tok.save_pretrained(root / "policy")
    rm_config = AutoConfig.from_pretrained(TINY, max_position_embeddings=1024, num_labels=1)
    torch.manual_seed(1)
    LlamaForSequenceClassification(rm_config).save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return root / "policy", root / "rm"


def _scripted():
    def reply(ctx, gen, k):
        hits = [i for i, r in enumerate(ROWS) if r["instruction"] in ctx]
        assert len(hits) == 1
        return REPLIES[hits[0]]

    return ScriptedLM(reply)


def _length_judge(instruction, output_1, output_2):
    """Prefers the longer output; 1.5 on equal length (output_1 = reference, output_2 = model)."""
    if len(output_2) == len(output_1):
        return 1.5
    return 2.0 if len(output_2) > len(output_1) else 1.0


def test_alpaca_eval_import_is_the_installed_package():
    from eval.alpaca.compat import import_alpaca_eval

    ae = import_alpaca_eval()
    path = Path(ae.__file__).resolve()
    # the package sits directly in an environment's site-packages (which may itself be in the checkout: a `.venv`
    # there), not in a folder of the repository that shadows it
    sites = [p for p in path.parents if p.name in ("site-packages", "dist-packages")]
    assert sites and path.parent.parent == sites[0], path


def test_callable_judge_win_rate_by_hand(tmp_path):
    res = run_alpaca_eval(_scripted(), data=str(DATA), judge=_length_judge, output_dir=tmp_path)
    prefs = [_length_judge(r["instruction"], r["output"], rep) for r, rep in zip(ROWS, REPLIES)]
    assert prefs == [2.0, 1.0, 2.0, 1.0, 1.5, 1.0]
    expected = 100 * sum(p - 1 for p in prefs) / len(prefs)  # (2 wins + half a tie) / 6
    assert res["win_rate"] == pytest.approx(expected) == pytest.approx(100 * 2.5 / 6)
    assert (res["n_wins"], res["n_wins_base"], res["n_draws"], res["n_total"]) == (2, 3, 1, 6)
    # only the plain win rate is computed offline; the result says so
    assert res["computed"] == ["win_rate"] and res["headline"] == "win_rate"
    assert res["length_controlled_winrate"] is None
    (reason,) = res["length_controlled_reasons"]
    assert reason.startswith("The length-control GLM's table (tatsu-lab/alpaca_eval/df_gamed.csv) is not available")
    assert reason.endswith("offline runs need a cached copy or lc_data=PATH.")
    assert res["judge"]["kind"] == "callable"
    outputs = json.loads((tmp_path / "alpaca_model_outputs.json").read_text())
    assert [o["output"] for o in outputs] == [r.strip() for r in REPLIES]
    assert {"instruction", "output", "generator", "dataset"} <= set(outputs[0])
    ann = json.loads((tmp_path / "alpaca_annotations.json").read_text())
    assert [a["preference"] for a in ann] == prefs
    saved = json.loads((tmp_path / "alpaca_eval.json").read_text())
    assert saved["win_rate"] == pytest.approx(expected)


def test_callable_judge_by_spec_string(tmp_path):
    judge_file = tmp_path / "my_judge.py"
    judge_file.write_text("def judge(instruction, output_1, output_2):\n    return 2.0\n")
    res = run_alpaca_eval(_scripted(), data=str(DATA), judge=f"py:{judge_file}:judge")
    assert res["win_rate"] == pytest.approx(100.0)


def test_reward_model_judge_matches_hand_computation(tiny_dirs, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    policy, rm = tiny_dirs
    res = run_alpaca_eval(
        str(policy), data=str(DATA), judge=f"rm:{rm}", backend="hf", batch_size=4, max_new_tokens=8,
        output_dir=tmp_path, rm_batch_size=4,
    )
    assert res["judge"]["kind"] == "reward_model" and res["generation"]["chat_template"] is True
    outputs = json.loads((tmp_path / "alpaca_model_outputs.json").read_text())
    assert len(outputs) == 6

    # by hand: one unpadded forward per (instruction, output), chat template, reward = logits[0, 0]
    tok = AutoTokenizer.from_pretrained(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()

    def reward(instruction, output):
        text = tok.apply_chat_template(
            [{"role": "user", "content": instruction}, {"role": "assistant", "content": output}], tokenize=False
        )
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, 0])

    prefs = []
    for row, out in zip(ROWS, outputs):
        r_ref, r_model = reward(row["instruction"], row["output"]), reward(row["instruction"], out["output"])
        prefs.append(2.0 if r_model > r_ref else 1.0 if r_model < r_ref else 1.5)
    ann = json.loads((tmp_path / "alpaca_annotations.json").read_text())
    assert [a["preference"] for a in ann] == prefs
    assert res["win_rate"] == pytest.approx(100 * sum(p - 1 for p in prefs) / 6)
    for a, row, out in zip(ann, ROWS, outputs):
        assert a["reward_1"] == pytest.approx(reward(row["instruction"], row["output"]), abs=1e-5)
        assert a["reward_2"] == pytest.approx(reward(row["instruction"], out["output"]), abs=1e-5)


def test_reward_model_judge_soft_mode(tiny_dirs):
    _, rm = tiny_dirs
    judge = RewardModelJudge(str(rm), mode="soft", batch_size=2)
    rows = [{"instruction": r["instruction"], "output_1": r["output"], "output_2": rep} for r, rep
            in zip(ROWS, REPLIES)]
    prefs = judge.judge_rows(rows)
    r1, r2 = judge.last_rewards["reference"], judge.last_rewards["model"]
    assert prefs == pytest.approx([1 + 1 / (1 + math.exp(-(b - a))) for a, b in zip(r1, r2)])
    # batching does not change the rewards
    judge1 = RewardModelJudge(str(rm), mode="soft", batch_size=1)
    judge1.judge_rows(rows)
    assert judge1.last_rewards["model"] == pytest.approx(r2, abs=1e-5)


def _fake_lc_table(path: Path, n: int) -> Path:
    """A stand-in for alpaca_eval's df_gamed.csv (instruction difficulty + two length-gamed baselines)."""
    import pandas as pd

    recs = []
    for model, sign in (("gamed_long", 1.0), ("gamed_short", -1.0)):
        for i in range(n):
            d = sign * (1.0 + 0.1 * i)
            recs.append(dict(model=model, index=i, instruction_difficulty=0.1 * i - 0.2,
                             preference=0.5 + 0.3 * math.tanh(-d), std_delta_len=d, not_gamed_baseline=False))
    pd.DataFrame(recs).to_csv(path, index=False)
    return path


@pytest.mark.filterwarnings("ignore::FutureWarning")  # scikit-learn deprecations inside alpaca_eval's GLM
def test_length_controlled_win_rate_when_inputs_available(tmp_path):
    table = _fake_lc_table(tmp_path / "df_gamed.csv", len(ROWS))
    res = run_alpaca_eval(_scripted(), data=str(DATA), judge=_length_judge, lc_data=str(table))
    assert res["computed"] == ["win_rate", "length_controlled_winrate"]
    assert res["headline"] == "length_controlled_winrate"
    assert 0.0 <= res["length_controlled_winrate"] <= 100.0 and res["lc_standard_error"] is not None
    assert res["win_rate"] == pytest.approx(100 * 2.5 / 6)
    # a subset of the instructions the GLM table covers: LC is not computed, and the note says why
    res = run_alpaca_eval(_scripted(), data=str(DATA), judge=_length_judge, lc_data=str(table), limit=5)
    assert res["computed"] == ["win_rate"] and res["length_controlled_winrate"] is None
    assert res["length_controlled_reasons"] == [res["length_controlled_note"]]
    note = res["length_controlled_note"]
    assert "first 5 of the 6 instructions" in note and "`limit=5`" in note
    res = run_alpaca_eval(_scripted(), data=str(DATA), judge=_length_judge, lc_data=str(table),
                          length_controlled="off")
    assert res["computed"] == ["win_rate"] and "off" in res["length_controlled_note"]


def test_gpt41_api_judge_config(tmp_path):
    from alpaca_eval.annotators import PairwiseAnnotator

    path = api_judge_config("gpt-4.1", tmp_path)
    import yaml

    cfg = yaml.safe_load(Path(path).read_text())[DEFAULT_API_JUDGE]
    assert cfg["completions_kwargs"]["model_name"] == "gpt-4.1"
    assert Path(cfg["prompt_template"]).is_file()
    annotator = PairwiseAnnotator(annotators_config=path, caching_path=None)  # builds offline, no API call
    (single,) = annotator.annotators.values()
    assert "{instruction}" in single.prompt_template and "{output_1}" in single.prompt_template
    assert api_judge_config("weighted_alpaca_eval_gpt4_turbo", tmp_path) == "weighted_alpaca_eval_gpt4_turbo"
    with pytest.raises(EvalError, match="evaluator configs"):
        api_judge_config("no_such_judge", tmp_path)


def test_api_judge_config_with_a_relative_output_dir_and_its_credentials(tmp_path, monkeypatch):
    """Issue 25, item 3: every shipped recipe's `output_dir` is relative, and alpaca_eval reads a relative config
    path against its own configs directory; the written config is named by its absolute path. The API key it needs
    is looked for before anything is generated (the refusal itself: tests/test_hostile_cases.py)."""
    from alpaca_eval.annotators import PairwiseAnnotator

    from eval.alpaca.judges import missing_credentials

    monkeypatch.chdir(tmp_path)
    path = api_judge_config("gpt-4.1", "runs/x/eval")
    assert Path(path).is_absolute() and Path(path) == tmp_path / "runs/x/eval" / DEFAULT_API_JUDGE / "configs.yaml"
    PairwiseAnnotator(annotators_config=path, caching_path=None)  # found, from any working directory
    for name in ("OPENAI_API_KEY", "OPENAI_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_CLIENT_CONFIG_PATH", str(tmp_path / "no_such_client_config.yaml"))
    assert missing_credentials(path) == ["`OPENAI_API_KEY` or `OPENAI_API_KEYS` (for `openai_completions`)"]
    assert missing_credentials("weighted_alpaca_eval_gpt4_turbo") == missing_credentials(path)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert missing_credentials(path) == []
    monkeypatch.delenv("OPENAI_API_KEY")
    (tmp_path / "client.yaml").write_text("default:\n  - api_key: sk-test\n")
    monkeypatch.setenv("OPENAI_CLIENT_CONFIG_PATH", str(tmp_path / "client.yaml"))
    assert missing_credentials(path) == []


def test_preference_helpers_and_errors(tmp_path):
    assert reward_preference(0.0, 1.0) == 2.0 and reward_preference(1.0, 0.0) == 1.0 and reward_preference(1, 1) == 1.5
    assert check_preference(1.25, "x") == 1.25
    with pytest.raises(EvalError, match=r"\[1, 2\]"):
        check_preference(3, "x")
    with pytest.raises(EvalError, match="offline"):
        run_alpaca_eval(_scripted(), data=None, judge=_length_judge)
    no_ref = tmp_path / "no_ref.json"
    no_ref.write_text(json.dumps([{"instruction": "hi"}]))
    with pytest.raises(EvalError, match="reference"):
        run_alpaca_eval(_scripted(), data=str(no_ref), judge=_length_judge)
    with pytest.raises(EvalError, match="judge"):
        run_alpaca_eval(_scripted(), data=str(DATA), judge="gpt4")


def test_a_generation_budget_longer_than_the_context_is_refused_before_generating(tiny_dirs, tmp_path):
    """The default 2048 new tokens on a model whose context holds 1024: lm-eval would assert in its first batch
    (after loading everything); the eval names the key and the model's context before generating."""
    policy, _ = tiny_dirs
    with pytest.raises(EvalError) as err:
        run_alpaca_eval(str(policy), data=str(DATA), judge=_length_judge, backend="hf", output_dir=tmp_path)
    text = str(err.value)
    assert "`eval.alpaca_eval.max_new_tokens`" in text and "holds 1024 tokens" in text and "is 2048" in text
    assert not (tmp_path / "alpaca_model_outputs.json").exists()
    # a budget that fits runs to the end
    res = run_alpaca_eval(str(policy), data=str(DATA), judge=_length_judge, backend="hf", max_new_tokens=4, limit=2)
    assert res["n_total"] == 2 and res["win_rate"] is not None


# ------------------------------------------------------------------------ why the length-controlled rate is missing


def _annotations(rows=ROWS, replies=REPLIES, generators=None):
    """An annotation table as alpaca_eval's evaluate passes it to the metric (reference = output_1)."""
    import pandas as pd

    generators = generators or ["model"] * len(rows)
    return pd.DataFrame([dict(instruction=r["instruction"], output_1=r["output"], output_2=rep, generator_1="ref",
                              generator_2=g, preference=_length_judge(r["instruction"], r["output"], rep),
                              annotator="length_judge") for r, rep, g in zip(rows, replies, generators)])


def _full_set(limit=None):
    from eval.alpaca import InstructionSet

    return InstructionSet(tuple(r["instruction"] for r in ROWS), "`alpaca_eval_6.json`", limit)


def _reasons(df, tmp_path, instructions=None, n_table=len(ROWS), names=None):
    from eval.alpaca import make_metric_fn

    table = _fake_lc_table(tmp_path / "df_gamed.csv", n_table)
    if names is not None:
        import pandas as pd

        frame = pd.read_csv(table)
        frame["instruction"] = [names[i] for i in frame["index"]]
        frame.to_csv(table, index=False)
    fn = make_metric_fn("auto", str(table), instructions)
    metrics = fn(df)
    for sentence in fn.info["reasons"]:  # each reason is a sentence naming its cause, never a raw exception
        assert sentence[0].isupper() or sentence[0].isdigit(), sentence
        assert sentence.endswith(".") and "Error" not in sentence, sentence
    assert (metrics["length_controlled_winrate"] is None) == bool(fn.info["reasons"])
    return fn.info["reasons"]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lc_guard_passes_the_full_set_in_order_and_the_glm_runs(tmp_path):
    assert _reasons(_annotations(), tmp_path, _full_set()) == []


def test_lc_guard_names_several_models_in_one_table(tmp_path):
    df = _annotations(generators=["model_a", "model_b"] * 3)
    (reason,) = _reasons(df, tmp_path, _full_set())
    assert "outputs of 2 models (`model_a`, `model_b`)" in reason and "one model against one baseline" in reason
    # the same rows, twice, for two models: the GLM's assertion would be the only message otherwise
    import pandas as pd

    both = pd.concat([_annotations(generators=["model_a"] * 6), _annotations(generators=["model_b"] * 6)])
    reasons = _reasons(both, tmp_path, _full_set())
    assert any("2 models" in r for r in reasons) and any("annotated more than once" in r for r in reasons)


def test_lc_guard_names_the_missing_outputs_by_instruction(tmp_path):
    keep = [0, 1, 3, 4, 5]  # instruction #3 has no output
    df = _annotations([ROWS[i] for i in keep], [REPLIES[i] for i in keep])
    (reason,) = _reasons(df, tmp_path, _full_set())
    assert reason.startswith("1 instruction(s) have no model output") and f"#3 `{ROWS[2]['instruction'][:20]}" in reason
    # the same count, but another instruction in its place: "which", not "how many"
    other = dict(ROWS[2], instruction="An instruction that is not in the set.")
    reasons = _reasons(_annotations(ROWS[:2] + [other] + ROWS[3:]), tmp_path, _full_set())
    assert len(reasons) == 2 and "#3" in reasons[0] and "not in `alpaca_eval_6.json`" in reasons[1]
    # an output or a preference that is null in the table
    df = _annotations()
    df.loc[4, "preference"] = float("nan")
    (reason,) = _reasons(df, tmp_path, _full_set())
    assert reason.startswith("1 annotation row(s) have no preference from the judge: #5")


def test_lc_guard_checks_the_order_not_only_the_count(tmp_path):
    df = _annotations().iloc[[0, 1, 3, 2, 4, 5]].reset_index(drop=True)
    (reason,) = _reasons(df, tmp_path, _full_set())
    assert "another order" in reason and "row #4 is its instruction #3" in reason


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_lc_guard_names_a_subset_and_a_table_of_another_set(tmp_path):
    (reason,) = _reasons(_annotations(ROWS[:4], REPLIES[:4]), tmp_path, _full_set(limit=4))
    assert reason.startswith("This run evaluates the first 4 of the 6 instructions") and "`limit=4`" in reason
    (reason,) = _reasons(_annotations(), tmp_path, _full_set(), n_table=805)
    assert "covers 805 instructions (by position)" in reason and "has 6" in reason
    names = [r["instruction"] for r in ROWS]
    (reason,) = _reasons(_annotations(), tmp_path, _full_set(), names=names[:5] + ["Something else?"])
    assert "differ from them from position #6 on" in reason
    assert _reasons(_annotations(), tmp_path, _full_set(), names=names) == []  # a table naming this very set


def test_a_missing_model_output_leaves_the_win_rate_and_says_why_in_alpaca_eval_json_and_the_log(tmp_path, caplog):
    outputs = tmp_path / "outputs.json"
    given = [{"instruction": r["instruction"], "output": rep} for r, rep in zip(ROWS, REPLIES)]
    outputs.write_text(json.dumps(given[:2] + given[3:]))  # instruction #3 has no output
    table = _fake_lc_table(tmp_path / "df_gamed.csv", len(ROWS))
    with caplog.at_level("WARNING", logger="eval.alpaca"):
        res = run_alpaca_eval(None, data=str(DATA), model_outputs=str(outputs), judge=_length_judge,
                              lc_data=str(table), output_dir=tmp_path / "out")
    prefs = [_length_judge(r["instruction"], r["output"], rep) for r, rep in zip(ROWS, REPLIES)]
    kept = prefs[:2] + prefs[3:]
    assert res["n_total"] == 5 and res["win_rate"] == pytest.approx(100 * sum(p - 1 for p in kept) / 5)
    assert res["generation"]["missing_outputs"] == [{"position": 3, "instruction": ROWS[2]["instruction"]}]
    saved = json.loads((tmp_path / "out" / "alpaca_eval.json").read_text())
    (reason,) = saved["length_controlled_reasons"]
    assert saved["length_controlled_winrate"] is None and saved["computed"] == ["win_rate"]
    assert reason.startswith("1 instruction(s) have no model output") and "#3" in reason
    assert any(reason in record.getMessage() for record in caplog.records)
    # no output at all is refused, naming the fix
    outputs.write_text(json.dumps([{"instruction": "other", "output": "x"}]))
    with pytest.raises(EvalError, match="no model output"):
        run_alpaca_eval(None, data=str(DATA), model_outputs=str(outputs), judge=_length_judge)
