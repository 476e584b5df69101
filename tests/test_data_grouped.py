"""Tests for the grouped (GRPO) data loader, tokenization, collation and the tiny groups fixture (the unpaired
ones, and the helpers shared with them, are in test_data_unpaired_grouped.py)."""

from __future__ import annotations

import math

import pytest
import torch

from data_rows import (
    ARMORM,
    GROUP,
    GROUPS,
    MESSAGES,
    PLAIN,
    assert_refused,
    check_error,
    completion_text,
    msgs,
    user,
    write_jsonl,
    write_parquet,
)
from hl_core.data import GroupRecord, collate_groups, load_group_records, tokenize_group, tokenize_preference
from hl_core.data.tokens import truncate_completions
from hl_core.errors import DataError

# ----------------------------------------------------------------------------------------- group loading


def test_group_formats(tmp_path):
    pairs_scored = dict(PLAIN, score_chosen=7.5, score_rejected=2)
    p = write_jsonl(tmp_path / "groups.jsonl", [GROUP, "", ARMORM, pairs_scored, PLAIN, MESSAGES,
                                                 dict(GROUP, prompt=user("Hi."))])
    recs = load_group_records(str(p))
    assert [r.source for r in recs] == [f"{p}:{i}" for i in (1, 3, 4, 5, 6, 7)]
    assert recs[0] == GroupRecord(user("Describe the sky."), GROUP["completions"], [0.9, 0.1, 0.5], f"{p}:1")
    # ArmoRM: chosen gets max(all_rm_scores), rejected min(all_rm_scores)
    assert recs[1] == GroupRecord(user("Describe the road."), ["The road is warm.", "The road is cold."],
                                  [0.25, -0.5], f"{p}:3")
    assert recs[2].completions == ["The sky is calm.", "The sky is grim."] and recs[2].scores == [7.5, 2.0]
    assert recs[3].scores == [1.0, 0.0] and recs[4].scores == [1.0, 0.0]
    assert recs[4].completions == ["The road is warm.", "The road is cold."]
    assert recs[5].prompt == user("Hi.")
    assert all(type(s) is float for r in recs for s in r.scores)
    assert len(load_group_records(str(p), limit=2)) == 2


def test_group_parquet_armorm(tmp_path):
    p = write_parquet(tmp_path / "armorm.parquet", [ARMORM, dict(ARMORM, all_rm_scores=[1.0, 3.0, 2.0])])
    recs = load_group_records(str(p))
    assert [r.scores for r in recs] == [[0.25, -0.5], [3.0, 1.0]] and recs[1].source == f"{p}:row 1"
    native = write_parquet(tmp_path / "native.parquet", [GROUP, dict(GROUP, scores=[1, 2, 3])])
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
        "bad_pair": ([dict(ARMORM, rejected=msgs("Other prompt.", "x"))], [f"{p}:1", "same prompt"]),
        "malformed_json": ([GROUP, '{"prompt": '], [f"{p}:2", "not valid JSON", '"completions"']),
        "not_object": (["3"], [f"{p}:1", "not an object"]),
        "empty_file": ([""], [str(p), "no GRPO group rows"]),
    }
    rows, expected = cases[kind]
    write_jsonl(p, rows)
    return p, expected


GROUP_ERRORS = [
    "size_one", "size_zero", "length_mismatch", "score_string", "score_bool", "score_nan", "score_inf", "score_null",
    "empty_completion", "completion_number", "completions_string", "scores_missing", "prompt_missing",
    "neither_form", "both_forms", "half_pair_scores", "pair_score_string", "armorm_nan", "armorm_empty",
    "armorm_not_list", "bad_pair", "malformed_json", "not_object", "empty_file",
]


@pytest.mark.parametrize("kind", GROUP_ERRORS)
def test_group_bad_rows_raise_data_error(tmp_path, kind):
    assert_refused(load_group_records, *_group_error(tmp_path, kind))


def test_group_errors_in_parquet_name_the_row(tmp_path):
    p = write_parquet(tmp_path / "bad.parquet", [GROUP, dict(GROUP, completions=["x"], scores=[1.0])])
    with pytest.raises(DataError) as info:
        load_group_records(str(p))
    check_error(info, f"{p}:row 1", "size 1")


# ----------------------------------------------------------------------------------------- group tokenize/collate


def test_tokenize_group_shared_prompt_and_masks(tok):
    rec = GroupRecord(user("Describe the river."), ["The river is calm.", "It is a dull river.", "Cold."],
                      [1.0, 0.0, 0.5], "t:1")
    out = tokenize_group(rec, tok, max_length=64, max_prompt_length=32)
    assert set(out) == {"input_ids", "completion_mask", "scores"} and out["scores"] == [1.0, 0.0, 0.5]
    n_prompt = out["completion_mask"][0].index(1)
    prompt = out["input_ids"][0][:n_prompt]
    for ids, mask, text in zip(out["input_ids"], out["completion_mask"], rec.completions):
        assert len(ids) == len(mask) and ids[:n_prompt] == prompt
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        assert completion_text(tok, ids, mask) == text + tok.eos_token
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
    a = GroupRecord(user(long_prompt), ["It is dull.", long_completion, "Calm."], [0.0, 1.0, 0.5], "t:1")
    # group B: prompt longer than max_prompt_length, short completions: the group fits, so nothing is cut
    b = GroupRecord(user("Describe the river. " + " ".join(words[:4])), ["It is dull.", "Calm."], [0.0, 1.0], "t:2")
    max_len, max_prompt = 32, 12
    out_a = tokenize_group(a, tok, max_len, max_prompt)
    out_b = tokenize_group(b, tok, max_len, max_prompt)
    full_prompt = [tok.bos_token_id] + tok(tok.apply_chat_template(a.prompt, add_generation_prompt=True,
                                                                   tokenize=False),
                                           add_special_tokens=False)["input_ids"]
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
