"""Tests for the unpaired (KTO) and grouped (GRPO) data loaders, tokenization, collation and fixture."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from hl_core.data import (
    GroupRecord,
    UnpairedRecord,
    collate_groups,
    collate_unpaired,
    load_group_records,
    load_preference_records,
    load_unpaired_records,
    tokenize_group,
    tokenize_preference,
    tokenize_unpaired,
)
from hl_core.data.tokens import truncate_completions
from hl_core.errors import DataError, RecipeError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "tiny"
MODEL_DIR = TINY / "model"
GROUPS = TINY / "groups"
PREFS = TINY / "prefs"


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def _write_parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _msgs(prompt, completion):
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def _user(text):
    return [{"role": "user", "content": text}]


PLAIN = {"prompt": "Describe the sky.", "chosen": "The sky is calm.", "rejected": "The sky is grim."}
MESSAGES = {
    "prompt": "Describe the road.",
    "chosen": _msgs("Describe the road.", "The road is warm."),
    "rejected": _msgs("Describe the road.", "The road is cold."),
}
KTO = {"prompt": "Describe the sky.", "completion": "The sky is calm.", "label": True}
GROUP = {"prompt": "Describe the sky.", "completions": ["The sky is calm.", "The sky is grim.", "It is kind."],
         "scores": [0.9, 0.1, 0.5]}
ARMORM = {
    "prompt_id": "abc",
    "prompt": "Describe the road.",
    "all_generated_responses": ["The road is warm.", "a", "The road is cold.", "b", "c"],
    "all_rm_scores": [0.25, 0.125, -0.5, 0.0, 0.1],
    "chosen": _msgs("Describe the road.", "The road is warm."),
    "rejected": _msgs("Describe the road.", "The road is cold."),
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def _check_error(exc_info, *pieces):
    msg = str(exc_info.value)
    assert "\n" not in msg
    for piece in pieces + ("Fix",):
        assert piece in msg, (piece, msg)


# ----------------------------------------------------------------------------------------- unpaired loading


def test_unpaired_native_forms(tmp_path):
    rows = [
        KTO,
        "",
        dict(KTO, completion="The sky is grim.", label=False),
        dict(KTO, label=1),
        dict(KTO, label=0),
        {"prompt": _user("Name a colour."), "completion": [{"role": "assistant", "content": "Blue."}], "label": True},
        {"completion": _msgs("Hi.", "Hello."), "label": False},  # the conversation carries the prompt
    ]
    p = _write_jsonl(tmp_path / "kto.jsonl", rows)
    recs = load_unpaired_records(str(p))
    assert [r.source for r in recs] == [f"{p}:{i}" for i in (1, 3, 4, 5, 6, 7)]
    assert [r.desirable for r in recs] == [True, False, True, False, True, False]
    assert recs[0] == UnpairedRecord(_user("Describe the sky."), "The sky is calm.", True, f"{p}:1")
    assert recs[4].prompt == _user("Name a colour.") and recs[4].completion == "Blue."
    assert recs[5].prompt == _user("Hi.") and recs[5].completion == "Hello."
    assert all(type(r.desirable) is bool for r in recs)
    assert len(load_unpaired_records(str(p), limit=2)) == 2
    assert len(load_unpaired_records(str(p), format="plain", limit=4)) == 4
    with pytest.raises(DataError) as info:
        load_unpaired_records(str(p), format="messages")
    _check_error(info, f"{p}:1", "`completion`", "format `messages`")


def test_pairs_become_two_unpaired_records(tmp_path):
    p = _write_jsonl(tmp_path / "pairs.jsonl", [PLAIN, MESSAGES, KTO])
    recs = load_unpaired_records(str(p))
    assert [(r.completion, r.desirable, r.source) for r in recs] == [
        ("The sky is calm.", True, f"{p}:1"),
        ("The sky is grim.", False, f"{p}:1"),
        ("The road is warm.", True, f"{p}:2"),
        ("The road is cold.", False, f"{p}:2"),
        ("The sky is calm.", True, f"{p}:3"),
    ]
    assert recs[2].prompt == recs[3].prompt == _user("Describe the road.")
    # limit counts source rows
    assert [r.completion for r in load_unpaired_records(str(p), limit=1)] == ["The sky is calm.", "The sky is grim."]
    # the whole tiny preference set: 2 records per pair, chosen first
    pairs = load_preference_records(str(PREFS / "eval.jsonl"))
    recs = load_unpaired_records(str(PREFS / "eval.jsonl"))
    assert len(recs) == 2 * len(pairs)
    assert [r.completion for r in recs[::2]] == [q.chosen for q in pairs]
    assert [r.completion for r in recs[1::2]] == [q.rejected for q in pairs]
    assert all(r.desirable for r in recs[::2]) and not any(r.desirable for r in recs[1::2])


def test_unpaired_parquet_json_and_hf(tmp_path, monkeypatch):
    pq_bool = _write_parquet(tmp_path / "kto.parquet", [KTO, dict(KTO, label=False)])
    recs = load_unpaired_records(str(pq_bool))
    assert [r.desirable for r in recs] == [True, False] and recs[1].source == f"{pq_bool}:row 1"
    pq_int = _write_parquet(tmp_path / "kto_int.parquet", [dict(KTO, label=0), dict(KTO, label=1)])
    assert [r.desirable for r in load_unpaired_records(str(pq_int))] == [False, True]
    pq_pairs = _write_parquet(tmp_path / "pairs.parquet", [MESSAGES, MESSAGES])  # list<struct> columns
    recs = load_unpaired_records(str(pq_pairs), limit=1)
    assert [(r.completion, r.desirable) for r in recs] == [("The road is warm.", True), ("The road is cold.", False)]
    js = tmp_path / "rows.json"
    js.write_text(json.dumps([KTO, PLAIN]))
    assert [r.source for r in load_unpaired_records(str(js))] == [f"{js}:row 0", f"{js}:row 1", f"{js}:row 1"]

    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    src = _write_jsonl(tmp_path / "hf.jsonl", [KTO, dict(KTO, label=False), KTO])
    recs = load_unpaired_records(name="json", data_files=str(src), split="train", limit=2)
    assert [r.desirable for r in recs] == [True, False] and recs[1].source == "hf:json[train]:row 1"


def _unpaired_error(tmp_path, kind):
    p = tmp_path / "bad.jsonl"
    cases = {
        # KTO on data with no labels
        "no_labels": ([KTO, {"prompt": "Describe the sky.", "response": "The sky."}],
                      [f"{p}:2", "KTO needs labelled completions", "preference pairs", "prompt, response"]),
        "label_two": ([KTO, dict(KTO, label=2)], [f"{p}:2", "`label`", "int", "true/false"]),
        "label_string": ([dict(KTO, label="yes")], [f"{p}:1", "`label`", "str"]),
        "label_float": ([dict(KTO, label=1.0)], [f"{p}:1", "`label`", "float"]),
        "label_missing": ([{"prompt": "x", "completion": "y"}], [f"{p}:1", "`label`", "missing"]),
        "completion_missing": ([{"prompt": "x", "label": True}], [f"{p}:1", "`completion`"]),
        "prompt_missing": ([{"completion": "y", "label": True}], [f"{p}:1", "`prompt`"]),
        "empty_completion": ([KTO, KTO, dict(KTO, completion="  ")], [f"{p}:3", "`completion`", "empty"]),
        "completion_not_assistant": ([dict(KTO, completion=_user("x"))], [f"{p}:1", "`completion`", "assistant"]),
        "completion_number": ([dict(KTO, completion=3)], [f"{p}:1", "`completion`", "int"]),
        "both_forms": ([dict(PLAIN, label=True)], [f"{p}:1", "ambiguous"]),
        "bad_pair": ([KTO, {"prompt": "x", "chosen": "y"}], [f"{p}:2", "`rejected`"]),
        "malformed_json": ([KTO, '{"prompt": "x",'], [f"{p}:2", "not valid JSON", '"label": true']),
        "not_object": ([KTO, "[1]"], [f"{p}:2", "not an object"]),
        "empty_file": (["", ""], [str(p), "no KTO rows"]),
    }
    rows, expected = cases[kind]
    _write_jsonl(p, rows)
    return p, expected


UNPAIRED_ERRORS = [
    "no_labels", "label_two", "label_string", "label_float", "label_missing", "completion_missing", "prompt_missing",
    "empty_completion", "completion_not_assistant", "completion_number", "both_forms", "bad_pair", "malformed_json",
    "not_object", "empty_file",
]


@pytest.mark.parametrize("kind", UNPAIRED_ERRORS)
def test_unpaired_bad_rows_raise_data_error(tmp_path, kind):
    path, expected = _unpaired_error(tmp_path, kind)
    with pytest.raises(DataError) as info:
        load_unpaired_records(str(path))
    _check_error(info, *expected)


def test_unpaired_missing_file_and_args(tmp_path):
    with pytest.raises(DataError) as info:
        load_unpaired_records(str(tmp_path / "nope.jsonl"))
    _check_error(info, "nope.jsonl", "does not exist")
    with pytest.raises(DataError, match="exactly one of `path`"):
        load_unpaired_records()
    with pytest.raises(RecipeError):
        load_unpaired_records(str(tmp_path / "x.jsonl"), limit=0)


# ----------------------------------------------------------------------------------------- group loading


def test_group_formats(tmp_path):
    pairs_scored = dict(PLAIN, score_chosen=7.5, score_rejected=2)
    p = _write_jsonl(tmp_path / "groups.jsonl", [GROUP, "", ARMORM, pairs_scored, PLAIN, MESSAGES,
                                                 dict(GROUP, prompt=_user("Hi."))])
    recs = load_group_records(str(p))
    assert [r.source for r in recs] == [f"{p}:{i}" for i in (1, 3, 4, 5, 6, 7)]
    assert recs[0] == GroupRecord(_user("Describe the sky."), GROUP["completions"], [0.9, 0.1, 0.5], f"{p}:1")
    # ArmoRM: chosen gets max(all_rm_scores), rejected min(all_rm_scores)
    assert recs[1] == GroupRecord(_user("Describe the road."), ["The road is warm.", "The road is cold."],
                                  [0.25, -0.5], f"{p}:3")
    assert recs[2].completions == ["The sky is calm.", "The sky is grim."] and recs[2].scores == [7.5, 2.0]
    assert recs[3].scores == [1.0, 0.0] and recs[4].scores == [1.0, 0.0]
    assert recs[4].completions == ["The road is warm.", "The road is cold."]
    assert recs[5].prompt == _user("Hi.")
    assert all(type(s) is float for r in recs for s in r.scores)
    assert len(load_group_records(str(p), limit=2)) == 2


def test_group_parquet_armorm(tmp_path):
    p = _write_parquet(tmp_path / "armorm.parquet", [ARMORM, dict(ARMORM, all_rm_scores=[1.0, 3.0, 2.0])])
    recs = load_group_records(str(p))
    assert [r.scores for r in recs] == [[0.25, -0.5], [3.0, 1.0]] and recs[1].source == f"{p}:row 1"
    native = _write_parquet(tmp_path / "native.parquet", [GROUP, dict(GROUP, scores=[1, 2, 3])])
    assert load_group_records(str(native))[1].scores == [1.0, 2.0, 3.0]


def _group_error(tmp_path, kind):
    p = tmp_path / "bad.jsonl"
    cases = {
        "size_one": ([GROUP, dict(GROUP, completions=["x"], scores=[1.0])],
                     [f"{p}:2", "GRPO groups of size 1", "advantage", "0 for every token", "2 or more"]),
        "size_zero": ([dict(GROUP, completions=[], scores=[])], [f"{p}:1", "size 0"]),
        "length_mismatch": ([GROUP, GROUP, dict(GROUP, scores=[1.0, 2.0])], [f"{p}:3", "3 entries", "has 2"]),
        "score_string": ([dict(GROUP, scores=[1.0, "high", 0.0])], [f"{p}:1", "scores[1]", "str", "number"]),
        "score_bool": ([dict(GROUP, scores=[True, False, True])], [f"{p}:1", "scores[0]", "bool"]),
        "score_nan": ([dict(GROUP, scores=[1.0, float("nan"), 0.0])], [f"{p}:1", "scores[1]", "finite"]),
        "score_inf": ([dict(GROUP, scores=[1.0, 0.0, float("inf")])], [f"{p}:1", "scores[2]", "finite"]),
        "score_null": ([dict(GROUP, scores=[1.0, None, 0.0])], [f"{p}:1", "scores[1]", "null"]),
        "empty_completion": ([dict(GROUP, completions=["a", "", "b"])], [f"{p}:1", "completions[1]", "empty"]),
        "completion_number": ([dict(GROUP, completions=["a", 2, "b"])], [f"{p}:1", "completions[1]", "int"]),
        "completions_string": ([dict(GROUP, completions="abc")], [f"{p}:1", "`completions`", "str", "list"]),
        "scores_missing": ([{"prompt": "x", "completions": ["a", "b"]}], [f"{p}:1", "`scores`"]),
        "prompt_missing": ([{"completions": ["a", "b"], "scores": [1, 0]}], [f"{p}:1", "`prompt`"]),
        "neither_form": ([{"prompt": "x", "response": "y"}], [f"{p}:1", "neither a GRPO group nor a preference pair"]),
        "both_forms": ([dict(GROUP, chosen="a", rejected="b")], [f"{p}:1", "ambiguous"]),
        "half_pair_scores": ([dict(PLAIN, score_chosen=1.0)], [f"{p}:1", "`score_rejected`"]),
        "pair_score_string": ([dict(PLAIN, score_chosen="9", score_rejected=1)], [f"{p}:1", "score_chosen", "str"]),
        "armorm_nan": ([dict(ARMORM, all_rm_scores=[0.1, float("nan")])], [f"{p}:1", "all_rm_scores[1]", "finite"]),
        "armorm_empty": ([dict(ARMORM, all_rm_scores=[])], [f"{p}:1", "`all_rm_scores`", "empty"]),
        "armorm_not_list": ([dict(ARMORM, all_rm_scores=0.5)], [f"{p}:1", "`all_rm_scores`", "float"]),
        "bad_pair": ([dict(ARMORM, rejected=_msgs("Other prompt.", "x"))], [f"{p}:1", "same prompt"]),
        "malformed_json": ([GROUP, '{"prompt": '], [f"{p}:2", "not valid JSON", '"completions"']),
        "not_object": (["3"], [f"{p}:1", "not an object"]),
        "empty_file": ([""], [str(p), "no GRPO group rows"]),
    }
    rows, expected = cases[kind]
    _write_jsonl(p, rows)
    return p, expected


GROUP_ERRORS = [
    "size_one", "size_zero", "length_mismatch", "score_string", "score_bool", "score_nan", "score_inf", "score_null",
    "empty_completion", "completion_number", "completions_string", "scores_missing", "prompt_missing",
    "neither_form", "both_forms", "half_pair_scores", "pair_score_string", "armorm_nan", "armorm_empty",
    "armorm_not_list", "bad_pair", "malformed_json", "not_object", "empty_file",
]


@pytest.mark.parametrize("kind", GROUP_ERRORS)
def test_group_bad_rows_raise_data_error(tmp_path, kind):
    path, expected = _group_error(tmp_path, kind)
    with pytest.raises(DataError) as info:
        load_group_records(str(path))
    _check_error(info, *expected)


def test_group_errors_in_parquet_name_the_row(tmp_path):
    p = _write_parquet(tmp_path / "bad.parquet", [GROUP, dict(GROUP, completions=["x"], scores=[1.0])])
    with pytest.raises(DataError) as info:
        load_group_records(str(p))
    _check_error(info, f"{p}:row 1", "size 1")


# ----------------------------------------------------------------------------------------- unpaired tokenize/collate


def _completion_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_tokenize_unpaired_matches_pair_rule(tok):
    rec = UnpairedRecord(_user("Describe the river."), "The river is calm and bright.", False, "t:1")
    out = tokenize_unpaired(rec, tok, max_length=64, max_prompt_length=32)
    assert set(out) == {"prompt_ids", "completion_ids", "desirable", "max_length"}
    assert out["desirable"] is False and out["max_length"] == 64
    assert out["prompt_ids"][0] == tok.bos_token_id and out["completion_ids"][-1] == tok.eos_token_id
    assert tok.decode(out["completion_ids"]) == rec.completion + tok.eos_token
    assert tok.decode(out["prompt_ids"][1:]) == "<|user|>\nDescribe the river.\n<|assistant|>\n"
    # same ids as the chosen side of a pair, with and without truncation
    from hl_core.data import PreferenceRecord

    long_prompt = "Describe the river. " + " ".join(["calm bright kind warm"] * 6)
    for prompt, max_len, max_prompt in (("Describe the river.", 64, 32), (long_prompt, 20, 12)):
        r = UnpairedRecord(_user(prompt), "The river is calm and bright and kind and warm.", True, "t:1")
        pair = tokenize_preference(PreferenceRecord(r.prompt, r.completion, "x", "t:1"), tok, max_len, max_prompt)
        got = tokenize_unpaired(r, tok, max_len, max_prompt)
        assert got["prompt_ids"] + got["completion_ids"] == pair["chosen_input_ids"]
        assert len(got["prompt_ids"]) + len(got["completion_ids"]) <= max_len


def _kto_features(tok, max_length=64, max_prompt_length=32):
    recs = [
        UnpairedRecord(_user("Describe the sky."), "The sky is calm.", True, "t:1"),
        UnpairedRecord(_user("Tell me about the road."), "It is a grim, cold road.", False, "t:2"),
        UnpairedRecord(_user("What is the song like?"), "I find the song very sweet.", True, "t:3"),
    ]
    return recs, [tokenize_unpaired(r, tok, max_length, max_prompt_length) for r in recs]


def test_collate_unpaired_rows_masks_and_kl_shift(tok):
    recs, feats = _kto_features(tok)
    out = collate_unpaired(feats, pad_token_id=tok.pad_token_id)
    keys = {"input_ids", "attention_mask", "completion_mask", "desirable",
            "kl_input_ids", "kl_attention_mask", "kl_completion_mask", "kl_same_prompt"}
    assert set(out) == keys
    B = len(recs)
    T = max(len(f["prompt_ids"]) + len(f["completion_ids"]) for f in feats)
    for k in ("input_ids", "attention_mask", "completion_mask"):
        assert out[k].shape == (B, T) and out[k].dtype == torch.long
        assert out[f"kl_{k}"].dtype == torch.long and out[f"kl_{k}"].shape[0] == B
    assert out["desirable"].dtype == torch.bool and out["desirable"].tolist() == [True, False, True]
    for i, (rec, f) in enumerate(zip(recs, feats)):
        ids, att, cm = out["input_ids"][i].tolist(), out["attention_mask"][i].tolist(), out["completion_mask"][i].tolist()
        n = sum(att)
        assert att == [1] * n + [0] * (T - n) and ids[n:] == [tok.pad_token_id] * (T - n)
        assert ids[:n] == f["prompt_ids"] + f["completion_ids"]
        assert _completion_text(tok, ids, cm) == rec.completion + tok.eos_token
        # KL row i = prompt_i + completion_{(i+1) mod B}
        nxt = recs[(i + 1) % B]
        kl_ids, kl_att, kl_cm = (out[k][i].tolist() for k in ("kl_input_ids", "kl_attention_mask", "kl_completion_mask"))
        m = sum(kl_att)
        assert kl_ids[:m] == f["prompt_ids"] + feats[(i + 1) % B]["completion_ids"]
        assert _completion_text(tok, kl_ids, kl_cm) == nxt.completion + tok.eos_token
        prompt_part = [t for t, c, a in zip(kl_ids, kl_cm, kl_att) if a and not c]
        assert tok.decode(prompt_part[1:]) == f"<|user|>\n{rec.prompt[0]['content']}\n<|assistant|>\n"
    assert out["kl_same_prompt"].tolist() == [False] * B
    # B == 1 and nothing else to borrow from: the only KL pair is the matched pair, and it is flagged
    one = collate_unpaired(feats[:1], pad_token_id=tok.pad_token_id)
    assert torch.equal(one["kl_input_ids"], one["input_ids"])
    assert torch.equal(one["kl_completion_mask"], one["completion_mask"])
    assert one["kl_same_prompt"].tolist() == [True]
    # with donors (the update's other examples) the lone prompt borrows another prompt's completion
    lent = collate_unpaired(feats[:1], pad_token_id=tok.pad_token_id, donors=feats[1:])
    assert lent["kl_input_ids"][0].tolist()[: int(lent["kl_attention_mask"][0].sum())] == (
        feats[0]["prompt_ids"] + feats[1]["completion_ids"])
    assert lent["kl_same_prompt"].tolist() == [False]
    with pytest.raises(RecipeError, match="pad"):
        collate_unpaired(feats, pad_token_id=None)


def test_collate_unpaired_kl_rows_keep_the_length_cap():
    # hand-made features (ids: 1 = BOS, 2 = EOS): example 0 has a long prompt and a short completion,
    # example 1 a short prompt and a long completion, so the KL row (prompt_0, completion_1) overflows.
    f0 = {"prompt_ids": [1, 10, 11, 12, 13, 14], "completion_ids": [20, 2], "desirable": True, "max_length": 10}
    f1 = {"prompt_ids": [1, 15], "completion_ids": [30, 31, 32, 33, 34, 35, 36, 2], "desirable": False,
          "max_length": 10}
    out = collate_unpaired([f0, f1], pad_token_id=0)
    assert out["kl_input_ids"].tolist() == [
        [1, 10, 11, 12, 13, 14, 30, 31, 32, 2],  # completion_1 cut to the budget, EOS kept
        [1, 15, 20, 2, 0, 0, 0, 0, 0, 0],
    ]
    assert out["kl_completion_mask"].tolist() == [[0] * 6 + [1] * 4, [0, 0, 1, 1] + [0] * 6]
    assert out["kl_attention_mask"].sum(1).tolist() == [10, 4]
    # an explicit max_length overrides the stored one; no stored and no explicit cap: no cut
    assert collate_unpaired([f0, f1], 0, max_length=8)["kl_input_ids"][0].tolist() == [1, 10, 11, 12, 13, 14, 30, 2]
    bare = [{k: v for k, v in f.items() if k != "max_length"} for f in (f0, f1)]
    assert collate_unpaired(bare, 0)["kl_attention_mask"][0].sum().item() == 6 + 8


def test_kl_cap_with_real_tokenizer(tok):
    long = "The sky is " + " ".join(["calm bright kind warm clear"] * 4) + "."
    recs = [UnpairedRecord(_user("Describe the sky. " + " ".join(["so very"] * 6)), "Calm.", True, "t:1"),
            UnpairedRecord(_user("Hi."), long, False, "t:2")]
    feats = [tokenize_unpaired(r, tok, max_length=32, max_prompt_length=16) for r in recs]
    assert len(feats[0]["prompt_ids"]) > 16  # long prompt kept: its own sequence fits
    out = collate_unpaired(feats, tok.pad_token_id)
    assert out["kl_attention_mask"].sum(1).max().item() <= 32 and out["attention_mask"].sum(1).max().item() <= 32
    row = out["kl_input_ids"][0].tolist()
    cm = out["kl_completion_mask"][0].tolist()
    comp = [t for t, m in zip(row, cm) if m]
    assert comp[-1] == tok.eos_token_id and comp[:-1] == feats[1]["completion_ids"][: len(comp) - 1]
    assert len(comp) < len(feats[1]["completion_ids"])


# ----------------------------------------------------------------------------------------- group tokenize/collate


def test_tokenize_group_shared_prompt_and_masks(tok):
    rec = GroupRecord(_user("Describe the river."), ["The river is calm.", "It is a dull river.", "Cold."],
                      [1.0, 0.0, 0.5], "t:1")
    out = tokenize_group(rec, tok, max_length=64, max_prompt_length=32)
    assert set(out) == {"input_ids", "completion_mask", "scores"} and out["scores"] == [1.0, 0.0, 0.5]
    n_prompt = out["completion_mask"][0].index(1)
    prompt = out["input_ids"][0][:n_prompt]
    for ids, mask, text in zip(out["input_ids"], out["completion_mask"], rec.completions):
        assert len(ids) == len(mask) and ids[:n_prompt] == prompt
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        assert _completion_text(tok, ids, mask) == text + tok.eos_token
    assert tok.decode(prompt) == "<|bos|><|user|>\nDescribe the river.\n<|assistant|>\n"
    # a group of two tokenizes exactly like the pair
    from hl_core.data import PreferenceRecord

    two = GroupRecord(rec.prompt, rec.completions[:2], [1.0, 0.0], "t:1")
    pair = tokenize_preference(PreferenceRecord(rec.prompt, *rec.completions[:2], "t:1"), tok, 64, 32, "none")
    got = tokenize_group(two, tok, 64, 32, "none")
    assert got["input_ids"] == [pair["chosen_input_ids"], pair["rejected_input_ids"]]
    assert got["completion_mask"] == [pair["chosen_completion_mask"], pair["rejected_completion_mask"]]


def test_group_truncation_per_group_shared_prompt(tok):
    words = "calm bright kind warm clear sweet gentle fresh lovely happy".split()
    long_prompt = "Describe the river. " + " ".join(words * 2)
    long_completion = "The river is " + " ".join(words * 2) + "."
    # group A: one long completion forces the shared prompt down to max_prompt_length for ALL completions
    a = GroupRecord(_user(long_prompt), ["It is dull.", long_completion, "Calm."], [0.0, 1.0, 0.5], "t:1")
    # group B: prompt longer than max_prompt_length, short completions: the group fits, so nothing is cut
    b = GroupRecord(_user("Describe the river. " + " ".join(words[:4])), ["It is dull.", "Calm."], [0.0, 1.0], "t:2")
    max_len, max_prompt = 32, 12
    out_a = tokenize_group(a, tok, max_len, max_prompt)
    out_b = tokenize_group(b, tok, max_len, max_prompt)
    full_prompt = [tok.bos_token_id] + tok(tok.apply_chat_template(a.prompt, add_generation_prompt=True,
                                                                   tokenize=False), add_special_tokens=False)["input_ids"]
    full = [tok(c, add_special_tokens=False)["input_ids"] for c in a.completions]
    assert len(full_prompt) > max_prompt and len(full_prompt) + 1 + len(full[1]) > max_len
    exp_prompt = [tok.bos_token_id] + full_prompt[-(max_prompt - 1):]
    budget = max_len - max_prompt - 1
    assert out_a["input_ids"] == [exp_prompt + c[:budget] + [tok.eos_token_id] for c in full]
    assert all(m[:max_prompt] == [0] * max_prompt and set(m[max_prompt:]) == {1} for m in out_a["completion_mask"])
    assert max(len(s) for s in out_a["input_ids"]) == max_len
    assert tok.decode(out_a["input_ids"][0][1:max_prompt]).endswith("\n<|assistant|>\n")
    prompt_b = [tok.bos_token_id] + tok(tok.apply_chat_template(b.prompt, add_generation_prompt=True,
                                                                tokenize=False), add_special_tokens=False)["input_ids"]
    full_b = [tok(c, add_special_tokens=False)["input_ids"] for c in b.completions]
    assert len(prompt_b) > max_prompt and len(prompt_b) + 1 + max(map(len, full_b)) <= max_len
    assert out_b["input_ids"] == [prompt_b + c + [tok.eos_token_id] for c in full_b]
    # the generic rule on hand-computed ids
    assert truncate_completions([1, 10, 11, 12, 13], [[20], [30, 31, 32, 33], [40, 41]], 8, 2, bos_token_id=1) == (
        [1, 13], [[20], [30, 31, 32, 33], [40, 41]])
    assert truncate_completions([10, 11, 12], [[20] * 9, [30]], 8, 2) == ([11, 12], [[20] * 5, [30]])


def test_collate_groups_shapes_ids_scores():
    feats = [
        {"input_ids": [[1, 5, 6, 2], [1, 5, 7, 8, 2]], "completion_mask": [[0, 0, 1, 1], [0, 0, 1, 1, 1]],
         "scores": [1.0, 0.0]},
        {"input_ids": [[1, 4, 2], [1, 4, 3, 2], [1, 4, 9, 9, 9, 2]],
         "completion_mask": [[0, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1, 1, 1]], "scores": [0.5, 2, -1.25]},
    ]
    out = collate_groups(feats, pad_token_id=0)
    assert set(out) == {"input_ids", "attention_mask", "completion_mask", "scores", "group_ids"}
    for k in ("input_ids", "attention_mask", "completion_mask"):
        assert out[k].shape == (5, 6) and out[k].dtype == torch.long
    assert out["input_ids"].tolist() == [
        [1, 5, 6, 2, 0, 0], [1, 5, 7, 8, 2, 0], [1, 4, 2, 0, 0, 0], [1, 4, 3, 2, 0, 0], [1, 4, 9, 9, 9, 2]
    ]
    assert out["attention_mask"].sum(1).tolist() == [4, 5, 3, 4, 6]
    assert out["completion_mask"][4].tolist() == [0, 1, 1, 1, 1, 1] and out["completion_mask"][1].tolist() == [
        0, 0, 1, 1, 1, 0]
    assert out["scores"].dtype == torch.float32 and out["scores"].tolist() == [1.0, 0.0, 0.5, 2.0, -1.25]
    assert out["group_ids"].dtype == torch.long and out["group_ids"].tolist() == [0, 0, 1, 1, 1]
    # group ids restart at 0 in every batch
    assert collate_groups(feats[1:], 0)["group_ids"].tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        collate_groups([], 0)


# ----------------------------------------------------------------------------------------- fixture


def test_groups_fixture_loads_and_tokenizes(tok):
    train = load_group_records(str(GROUPS / "train.jsonl"))
    eval_ = load_group_records(str(GROUPS / "eval.jsonl"))
    assert len(train) == 128 and len(eval_) == 32
    assert train[0].source == f"{GROUPS / 'train.jsonl'}:1"
    for rec in train + eval_:
        assert len(rec.completions) == 4 and len(set(rec.completions)) == 4
        high = sorted(s for s in rec.scores if s >= 0.5)
        low = sorted(s for s in rec.scores if s < 0.5)
        assert len(high) == 2 and len(low) == 2 and all(0.0 <= s <= 1.0 and math.isfinite(s) for s in rec.scores)
    assert len({tuple(r.scores) for r in train}) > 100  # noisy, not constant
    assert len({r.completions[0] == max(zip(r.completions, r.scores), key=lambda x: x[1])[0] for r in train}) == 2
    train_pairs = {(r.prompt[0]["content"], c) for r in train for c in r.completions}
    assert not {(r.prompt[0]["content"], c) for r in eval_ for c in r.completions} & train_pairs
    for rec in train[:16] + eval_[:8]:
        out = tokenize_group(rec, tok, max_length=256, max_prompt_length=128)
        assert max(len(s) for s in out["input_ids"]) < 48
    batch = collate_groups([tokenize_group(r, tok, 256, 128) for r in train[:2]], tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 8 and batch["group_ids"].tolist() == [0] * 4 + [1] * 4
