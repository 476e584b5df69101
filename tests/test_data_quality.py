"""The data-quality proxy (mean per-token log-prob of the completions under the reference) against a hand
computation on a tiny random-init Llama and 5 records; quartiles, bottom-quartile flags, the paper's bad
range; the post-training hook (``eval.run_from_recipe.run_post_training_eval``) on a dict recipe."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eval._common import EvalError
from eval.data_quality import PAPER_BAD_QUARTILE, build_report, run_data_quality, verdict
from eval.run_from_recipe import EVAL_KEYS, defaults, eval_settings, keys_markdown, run_post_training_eval
from helpers import REPO

TINY = REPO / "tests" / "fixtures" / "tiny" / "model"

RECORDS = [
    {"prompt": "Describe the river.", "chosen": "The river is calm and clear.", "rejected": "The river is cold."},
    {"prompt": "Tell me about the garden.", "chosen": "It is a lovely, bright garden.",
     "rejected": "The garden feels very grim and dark."},
    {"chosen": [{"role": "user", "content": "What is the song like?"},
                {"role": "assistant", "content": "The song is sweet."}],
     "rejected": [{"role": "user", "content": "What is the song like?"},
                  {"role": "assistant", "content": "I find the song so harsh and stale."}]},
    {"prompt": "Describe the sky.", "chosen": "The sky feels so happy and gentle.", "rejected": "Dull."},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe the city."}],
     "chosen": "A warm city.", "rejected": "The city is bleak, sour and rude."},
]


pytestmark = pytest.mark.usefixtures("no_network")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(TINY)).eval()
    return model, AutoTokenizer.from_pretrained(TINY)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _hand_logps(model, tok, prompt_msgs, completion):
    """sum / count of log p(token | prefix) over the completion tokens + EOS, one unpadded sequence."""
    text = tok.apply_chat_template(prompt_msgs, add_generation_prompt=True, tokenize=False)
    prompt = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]  # the tiny tokenizer adds BOS
    comp = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([prompt + comp])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    total = sum(float(logp[t - 1, ids[0, t]]) for t in range(len(prompt), ids.shape[1]))
    return total, len(comp)


def _messages(row, key):
    if isinstance(row[key], list):
        return row[key][:-1], row[key][-1]["content"]
    prompt = row["prompt"]
    return ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt), row[key]


def test_proxy_equals_hand_computation(tiny, tmp_path):
    model, tok = tiny
    data = _write(tmp_path / "five.jsonl", RECORDS)
    rep = run_data_quality(str(data), model, tok, max_length=256, max_prompt_length=128, batch_size=3,
                           output_dir=tmp_path / "out", print_fn=None)
    hand_records, hand_sum, hand_tok = [], 0.0, 0
    per_field = {"chosen": [], "rejected": []}
    for row in RECORDS:
        s_rec, n_rec = 0.0, 0
        for key in ("chosen", "rejected"):
            prompt, completion = _messages(row, key)
            s, n = _hand_logps(model, tok, prompt, completion)
            per_field[key].append(s / n)
            s_rec, n_rec = s_rec + s, n_rec + n
        hand_records.append(s_rec / n_rec)
        hand_sum, hand_tok = hand_sum + s_rec, hand_tok + n_rec
    lines = [json.loads(row) for row in (tmp_path / "out" / "data_quality_records.jsonl").read_text().splitlines()]
    assert [row["mean_logp"] for row in lines] == pytest.approx(hand_records, abs=1e-5)
    assert [row["completions"]["chosen"]["mean_logp"] for row in lines] == pytest.approx(per_field["chosen"], abs=1e-5)
    assert rep["mean_logp"] == pytest.approx(np.mean(hand_records), abs=1e-5)
    assert rep["mean_logp_token_weighted"] == pytest.approx(hand_sum / hand_tok, abs=1e-5)
    assert rep["data"]["n_tokens"] == hand_tok and rep["data"]["n_records"] == 5 and rep["data"]["kind"] == "preference"
    q1, med, q3 = np.percentile(hand_records, [25, 50, 75])
    assert rep["quartiles"]["q1"] == pytest.approx(q1, abs=1e-5)
    assert rep["quartiles"]["median"] == pytest.approx(med, abs=1e-5)
    assert rep["quartiles"]["q3"] == pytest.approx(q3, abs=1e-5)
    flagged = [i for i, v in enumerate(hand_records) if v <= q1 + 1e-9]
    assert [row["index"] for row in lines if row["bottom_quartile"]] == flagged
    assert rep["bottom_quartile"]["n_flagged"] == len(flagged) == 2  # 5 values: Q1 is the 2nd smallest
    assert sum(rep["histogram"]["counts"]) == 5
    # a random-init model finds everything unlikely: far below the paper's bad quartile
    assert rep["below_paper_bad_quartile"] and not rep["in_paper_bad_quartile"]
    saved = json.loads((tmp_path / "out" / "data_quality.json").read_text())
    assert saved["mean_logp"] == pytest.approx(rep["mean_logp"]) and saved["paper_bad_quartile"] == [-1.03, -0.36]


def test_batching_does_not_change_values(tiny, tmp_path):
    model, tok = tiny
    data = _write(tmp_path / "five.jsonl", RECORDS)
    a = run_data_quality(str(data), model, tok, max_length=256, max_prompt_length=128, batch_size=1, print_fn=None)
    b = run_data_quality(str(data), model, tok, max_length=256, max_prompt_length=128, batch_size=10, print_fn=None)
    assert a["mean_logp"] == pytest.approx(b["mean_logp"], abs=1e-5)
    assert a["quartiles"] == pytest.approx(b["quartiles"], abs=1e-5)


def test_unpaired_and_group_rows(tiny, tmp_path):
    model, tok = tiny
    kto = _write(tmp_path / "kto.jsonl", [{"prompt": "Describe the road.", "completion": "A calm road.", "label": True},
                                          {"prompt": "Describe the road.", "completion": "A grim road.",
                                           "label": False}])
    rep = run_data_quality(str(kto), model, tok, max_length=128, max_prompt_length=64, print_fn=None)
    assert rep["data"]["kind"] == "unpaired" and set(rep["by_completion"]) == {"desirable", "undesirable"}
    s, n = _hand_logps(model, tok, [{"role": "user", "content": "Describe the road."}], "A calm road.")
    assert rep["by_completion"]["desirable"] == pytest.approx(s / n, abs=1e-5)
    groups = REPO / "tests" / "fixtures" / "tiny" / "groups" / "eval.jsonl"
    rep = run_data_quality(str(groups), model, tok, limit=3, max_length=128, max_prompt_length=64, print_fn=None)
    assert rep["data"]["kind"] == "groups" and rep["data"]["n_records"] == 3 and rep["data"]["n_completions"] == 12


def test_verdict_against_the_paper_range():
    lo, hi = PAPER_BAD_QUARTILE
    assert (lo, hi) == (-1.03, -0.36)
    assert verdict(-0.5).startswith("inside") and verdict(-2.0).startswith("below")
    assert verdict(-0.2).startswith("above")
    items = [{"labels": ["chosen"], "completions": ["x"], "source": f"f:{i}"} for i in range(4)]
    scores = [{"sum_logp": [v * 2], "n_tokens": [2], "mean_logp": [v], "record_mean_logp": v} for v
              in (-0.4, -0.5, -0.6, -0.9)]
    rep, records = build_report("preference", items, scores, model_label="m", data_label="d")
    assert rep["in_paper_bad_quartile"] and rep["mean_logp"] == pytest.approx(-0.6)
    assert [r["bottom_quartile"] for r in records] == [False, False, False, True]


def test_missing_file_is_a_user_error(tiny):
    model, tok = tiny
    with pytest.raises(Exception, match="does not exist"):
        run_data_quality("nope/missing.jsonl", model, tok, print_fn=None)


# --------------------------------------------------------------------------------------------- recipe hook


def _recipe(tmp_path, **eval_block):
    return {
        "name": "tiny_dq",
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": str(TINY), "random_init": True, "attn_implementation": "eager"},
        "data": {"train": {"path": str(REPO / "tests/fixtures/tiny/prefs/train.jsonl"), "limit": 6},
                 "max_length": 64, "max_prompt_length": 32},
        "train": {"max_steps": 1, "seed": 0},
        "eval": {"every": None, **eval_block},
    }


def test_post_training_hook_data_quality(tmp_path):
    from hl_core.config import ModelConfig
    from hl_core.models.loading import build_causal_lm, load_tokenizer

    recipe = _recipe(tmp_path, data_quality={"enabled": True})
    res = run_post_training_eval(recipe, model_dir=tmp_path / "run" / "final", output_dir=tmp_path / "run")
    out = tmp_path / "run" / "eval" / "data_quality.json"
    assert out.is_file() and res["eval_dir"] == str(tmp_path / "run" / "eval")
    saved = json.loads(out.read_text())
    assert saved["data"]["n_records"] == 6 and "random init, seed 0" in saved["model"]
    # the reference is the recipe's initial model (random init with train.seed), scored with data.* settings
    mcfg = ModelConfig(**recipe["model"])
    direct = run_data_quality(recipe["data"]["train"]["path"], build_causal_lm(mcfg, "fp32", 0), load_tokenizer(mcfg),
                              limit=6, max_length=64, max_prompt_length=32, print_fn=None)
    assert saved["mean_logp"] == pytest.approx(direct["mean_logp"], abs=1e-6)


def test_post_training_hook_switches_and_errors(tmp_path):
    # nothing enabled / after_training off: nothing runs
    assert run_post_training_eval(_recipe(tmp_path), tmp_path / "x", tmp_path / "run") == {
        "eval_dir": str(tmp_path / "run" / "eval")}
    off = _recipe(tmp_path, after_training=False, data_quality={"enabled": True})
    assert set(run_post_training_eval(off, tmp_path / "x", tmp_path / "run")) == {"eval_dir"}
    # a failing block (no final/ model) is reported after the others ran
    both = _recipe(tmp_path, output_subdir="ev", math500={"enabled": True, "data": "x.jsonl"},
                   data_quality={"enabled": True})
    with pytest.raises(EvalError, match="math500"):
        run_post_training_eval(both, tmp_path / "run" / "final", tmp_path / "run")
    assert (tmp_path / "run" / "ev" / "data_quality.json").is_file()
    res = run_post_training_eval(both, tmp_path / "run" / "final", tmp_path / "run", raise_on_error=False)
    assert "error" in res["math500"] and "mean_logp" in res["data_quality"]


def test_eval_keys_are_documented():
    d = defaults()
    assert d["math500"]["temperature"] == 0.6 and d["math500"]["top_p"] == 0.95
    assert d["math500"]["max_new_tokens"] == 2048 and d["alpaca_eval"]["judge"].startswith("api:")
    s = eval_settings({"eval": {"math500": {"n_samples": 4}}})
    assert s["math500"]["n_samples"] == 4 and s["math500"]["temperature"] == 0.6
    md = keys_markdown()
    for block in ("math500", "alpaca_eval", "data_quality"):
        for key in EVAL_KEYS[block]:
            assert f"`eval.{block}.{key}`" in md
