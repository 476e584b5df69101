"""Tests for the unpaired (KTO) data loader, tokenization and collation, and the row helpers the grouped tests
(test_data_grouped.py) share."""

from __future__ import annotations

import json

import pytest
import torch

from data_rows import (
    KTO,
    MESSAGES,
    PLAIN,
    PREFS,
    assert_refused,
    check_error,
    completion_text,
    msgs,
    user,
    write_jsonl,
    write_parquet,
)
from hl_core.data import (
    UnpairedRecord,
    collate_unpaired,
    load_preference_records,
    load_unpaired_records,
    tokenize_preference,
    tokenize_unpaired,
)
from hl_core.errors import DataError, RecipeError

# ----------------------------------------------------------------------------------------- unpaired loading


def test_unpaired_native_forms(tmp_path):
    rows = [
        KTO,
        "",
        dict(KTO, completion="The sky is grim.", label=False),
        dict(KTO, label=1),
        dict(KTO, label=0),
        {"prompt": user("Name a colour."), "completion": [{"role": "assistant", "content": "Blue."}], "label": True},
        {"completion": msgs("Hi.", "Hello."), "label": False},  # the conversation carries the prompt
    ]
    p = write_jsonl(tmp_path / "kto.jsonl", rows)
    recs = load_unpaired_records(str(p))
    assert [r.source for r in recs] == [f"{p}:{i}" for i in (1, 3, 4, 5, 6, 7)]
    assert [r.desirable for r in recs] == [True, False, True, False, True, False]
    assert recs[0] == UnpairedRecord(user("Describe the sky."), "The sky is calm.", True, f"{p}:1")
    assert recs[4].prompt == user("Name a colour.") and recs[4].completion == "Blue."
    assert recs[5].prompt == user("Hi.") and recs[5].completion == "Hello."
    assert all(type(r.desirable) is bool for r in recs)
    assert len(load_unpaired_records(str(p), limit=2)) == 2
    assert len(load_unpaired_records(str(p), format="plain", limit=4)) == 4
    with pytest.raises(DataError) as info:
        load_unpaired_records(str(p), format="messages")
    check_error(info, f"{p}:1", "`completion`", "format `messages`")


def test_pairs_become_two_unpaired_records(tmp_path):
    p = write_jsonl(tmp_path / "pairs.jsonl", [PLAIN, MESSAGES, KTO])
    recs = load_unpaired_records(str(p))
    assert [(r.completion, r.desirable, r.source) for r in recs] == [
        ("The sky is calm.", True, f"{p}:1"),
        ("The sky is grim.", False, f"{p}:1"),
        ("The road is warm.", True, f"{p}:2"),
        ("The road is cold.", False, f"{p}:2"),
        ("The sky is calm.", True, f"{p}:3"),
    ]
    assert recs[2].prompt == recs[3].prompt == user("Describe the road.")
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
    pq_bool = write_parquet(tmp_path / "kto.parquet", [KTO, dict(KTO, label=False)])
    recs = load_unpaired_records(str(pq_bool))
    assert [r.desirable for r in recs] == [True, False] and recs[1].source == f"{pq_bool}:row 1"
    pq_int = write_parquet(tmp_path / "kto_int.parquet", [dict(KTO, label=0), dict(KTO, label=1)])
    assert [r.desirable for r in load_unpaired_records(str(pq_int))] == [False, True]
    pq_pairs = write_parquet(tmp_path / "pairs.parquet", [MESSAGES, MESSAGES])  # list<struct> columns
    recs = load_unpaired_records(str(pq_pairs), limit=1)
    assert [(r.completion, r.desirable) for r in recs] == [("The road is warm.", True), ("The road is cold.", False)]
    js = tmp_path / "rows.json"
    js.write_text(json.dumps([KTO, PLAIN]))
    assert [r.source for r in load_unpaired_records(str(js))] == [f"{js}:row 0", f"{js}:row 1", f"{js}:row 1"]

    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    src = write_jsonl(tmp_path / "hf.jsonl", [KTO, dict(KTO, label=False), KTO])
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
        "completion_not_assistant": ([dict(KTO, completion=user("x"))], [f"{p}:1", "`completion`", "assistant"]),
        "completion_number": ([dict(KTO, completion=3)], [f"{p}:1", "`completion`", "int"]),
        "both_forms": ([dict(PLAIN, label=True)], [f"{p}:1", "ambiguous"]),
        "bad_pair": ([KTO, {"prompt": "x", "chosen": "y"}], [f"{p}:2", "`rejected`"]),
        "malformed_json": ([KTO, '{"prompt": "x",'], [f"{p}:2", "not valid JSON", '"label": true']),
        "not_object": ([KTO, "[1]"], [f"{p}:2", "not an object"]),
        "empty_file": (["", ""], [str(p), "no KTO rows"]),
    }
    rows, expected = cases[kind]
    write_jsonl(p, rows)
    return p, expected


UNPAIRED_ERRORS = [
    "no_labels", "label_two", "label_string", "label_float", "label_missing", "completion_missing", "prompt_missing",
    "empty_completion", "completion_not_assistant", "completion_number", "both_forms", "bad_pair", "malformed_json",
    "not_object", "empty_file",
]


@pytest.mark.parametrize("kind", UNPAIRED_ERRORS)
def test_unpaired_bad_rows_raise_data_error(tmp_path, kind):
    assert_refused(load_unpaired_records, *_unpaired_error(tmp_path, kind))


def test_unpaired_missing_file_and_args(tmp_path):
    with pytest.raises(DataError) as info:
        load_unpaired_records(str(tmp_path / "nope.jsonl"))
    check_error(info, "nope.jsonl", "does not exist")
    with pytest.raises(DataError, match="exactly one of `path`"):
        load_unpaired_records()
    with pytest.raises(RecipeError):
        load_unpaired_records(str(tmp_path / "x.jsonl"), limit=0)


# ----------------------------------------------------------------------------------------- unpaired tokenize/collate


def test_tokenize_unpaired_matches_pair_rule(tok):
    rec = UnpairedRecord(user("Describe the river."), "The river is calm and bright.", False, "t:1")
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
        r = UnpairedRecord(user(prompt), "The river is calm and bright and kind and warm.", True, "t:1")
        pair = tokenize_preference(PreferenceRecord(r.prompt, r.completion, "x", "t:1"), tok, max_len, max_prompt)
        got = tokenize_unpaired(r, tok, max_len, max_prompt)
        assert got["prompt_ids"] + got["completion_ids"] == pair["chosen_input_ids"]
        assert len(got["prompt_ids"]) + len(got["completion_ids"]) <= max_len


def _kto_features(tok, max_length=64, max_prompt_length=32):
    recs = [
        UnpairedRecord(user("Describe the sky."), "The sky is calm.", True, "t:1"),
        UnpairedRecord(user("Tell me about the road."), "It is a grim, cold road.", False, "t:2"),
        UnpairedRecord(user("What is the song like?"), "I find the song very sweet.", True, "t:3"),
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
        ids, att, cm = (out[key][i].tolist() for key in ("input_ids", "attention_mask", "completion_mask"))
        n = sum(att)
        assert att == [1] * n + [0] * (T - n) and ids[n:] == [tok.pad_token_id] * (T - n)
        assert ids[:n] == f["prompt_ids"] + f["completion_ids"]
        assert completion_text(tok, ids, cm) == rec.completion + tok.eos_token
        # KL row i = prompt_i + completion_{(i+1) mod B}
        nxt = recs[(i + 1) % B]
        kl_ids, kl_att, kl_cm = (out[k][i].tolist() for k
                                 in ("kl_input_ids", "kl_attention_mask", "kl_completion_mask"))
        m = sum(kl_att)
        assert kl_ids[:m] == f["prompt_ids"] + feats[(i + 1) % B]["completion_ids"]
        assert completion_text(tok, kl_ids, kl_cm) == nxt.completion + tok.eos_token
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
    recs = [UnpairedRecord(user("Describe the sky. " + " ".join(["so very"] * 6)), "Calm.", True, "t:1"),
            UnpairedRecord(user("Hi."), long, False, "t:2")]
    feats = [tokenize_unpaired(r, tok, max_length=32, max_prompt_length=16) for r in recs]
    assert len(feats[0]["prompt_ids"]) > 16  # long prompt kept: its own sequence fits
    out = collate_unpaired(feats, tok.pad_token_id)
    assert out["kl_attention_mask"].sum(1).max().item() <= 32 and out["attention_mask"].sum(1).max().item() <= 32
    row = out["kl_input_ids"][0].tolist()
    cm = out["kl_completion_mask"][0].tolist()
    comp = [t for t, m in zip(row, cm) if m]
    assert comp[-1] == tok.eos_token_id and comp[:-1] == feats[1]["completion_ids"][: len(comp) - 1]
    assert len(comp) < len(feats[1]["completion_ids"])
