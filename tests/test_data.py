"""Tests for hl_core.data (preference loading/tokenization/collation) and the tiny fixtures."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_rows import write_jsonl
from hl_core.data import (
    PreferenceRecord,
    collate_preference,
    load_preference_records,
    split_eval,
    tokenize_preference,
    truncate_pair,
)
from hl_core.errors import DataError, RecipeError

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
TINY = FIXTURES / "tiny"
MODEL_DIR = TINY / "model"
PREFS = TINY / "prefs"


def _msgs(prompt, completion, system=None):
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


PLAIN = {"prompt": "Describe the sky.", "chosen": "The sky is calm.", "rejected": "The sky is grim."}
MESSAGES = {
    "prompt": "Describe the road.",
    "chosen": _msgs("Describe the road.", "The road is warm."),
    "rejected": _msgs("Describe the road.", "The road is cold."),
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


# ----------------------------------------------------------------------------------------- loading


def test_fixture_files_load_in_both_forms():
    train = load_preference_records(str(PREFS / "train.jsonl"))
    eval_ = load_preference_records(str(PREFS / "eval.jsonl"))
    assert len(train) == 512 and len(eval_) == 64
    first_train = json.loads((PREFS / "train.jsonl").read_text().splitlines()[0])
    first_eval = json.loads((PREFS / "eval.jsonl").read_text().splitlines()[0])
    assert isinstance(first_train["chosen"], list) and isinstance(first_train["prompt"], str)  # messages form
    assert isinstance(first_eval["chosen"], str)  # plain form
    assert train[0].prompt == first_train["chosen"][:-1]
    assert train[0].chosen == first_train["chosen"][-1]["content"]
    assert train[0].rejected == first_train["rejected"][-1]["content"]
    assert train[0].source == f"{PREFS / 'train.jsonl'}:1"
    assert eval_[3] == PreferenceRecord(
        prompt=[{"role": "user", "content": json.loads((PREFS / "eval.jsonl").read_text().splitlines()[3])["prompt"]}],
        chosen=eval_[3].chosen,
        rejected=eval_[3].rejected,
        source=f"{PREFS / 'eval.jsonl'}:4",
    )
    # eval pairs are new (prompt, chosen) combinations
    assert not {(r.prompt[0]["content"], r.chosen) for r in eval_} & {(r.prompt[0]["content"], r.chosen) for r in train}


def test_auto_detect_mixed_rows_and_forced_formats(tmp_path):
    multi = {
        "chosen": _msgs("Hi.", "Hello there.", system="Be kind.")[:2]
        + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"},
           {"role": "assistant", "content": "Yes, gladly."}],
        "rejected": _msgs("Hi.", "x", system="Be kind.")[:2]
        + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"},
           {"role": "assistant", "content": "No."}],
    }
    trl_style = {"prompt": "Name a colour.", "chosen": [{"role": "assistant", "content": "Blue."}],
                 "rejected": [{"role": "assistant", "content": "No."}]}
    p = write_jsonl(tmp_path / "mixed.jsonl", [PLAIN, "", MESSAGES, multi, trl_style])
    recs = load_preference_records(str(p))
    assert [r.source for r in recs] == [f"{p}:1", f"{p}:3", f"{p}:4", f"{p}:5"]  # blank line 2 skipped
    assert recs[0].prompt == [{"role": "user", "content": "Describe the sky."}]
    assert recs[1].prompt == [{"role": "user",
                               "content": "Describe the road."}] and recs[1].chosen == "The road is warm."
    assert [m["role"] for m in recs[2].prompt] == ["system", "user", "assistant", "user"]
    assert recs[2].chosen == "Yes, gladly." and recs[2].rejected == "No."
    assert recs[3].prompt == [{"role": "user", "content": "Name a colour."}] and recs[3].chosen == "Blue."
    assert len(load_preference_records(str(p), limit=2)) == 2

    with pytest.raises(DataError, match=rf"{re.escape(str(p))}:3.*`chosen`.*plain form"):
        load_preference_records(str(p), format="plain")
    with pytest.raises(DataError, match=rf"{re.escape(str(p))}:1.*`chosen`.*messages form"):
        load_preference_records(str(p), format="messages")
    with pytest.raises(RecipeError, match="plain"):
        load_preference_records(str(p), format="plian")


def test_parquet_and_json_list(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    plain_pq = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([PLAIN, dict(PLAIN, chosen="The sky is bright.")]), plain_pq)
    recs = load_preference_records(str(plain_pq))
    assert [r.chosen for r in recs] == ["The sky is calm.", "The sky is bright."]
    assert recs[1].source == f"{plain_pq}:row 1"

    msg_pq = tmp_path / "messages.parquet"
    pq.write_table(pa.Table.from_pylist([MESSAGES, MESSAGES]), msg_pq)  # list<struct<role, content>> columns
    recs = load_preference_records(str(msg_pq), limit=1)
    assert len(recs) == 1 and recs[0].chosen == "The road is warm." and recs[0].prompt[0]["role"] == "user"

    bad_pq = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([PLAIN, dict(PLAIN, rejected=" \n ")]), bad_pq)
    with pytest.raises(DataError, match=rf"{re.escape(str(bad_pq))}:row 1.*`rejected`.*empty"):
        load_preference_records(str(bad_pq))

    js = tmp_path / "rows.json"
    js.write_text(json.dumps([PLAIN, MESSAGES]))
    recs = load_preference_records(str(js))
    assert [r.source for r in recs] == [f"{js}:row 0", f"{js}:row 1"]
    js_lines = tmp_path / "lines.json"  # JSON lines saved as .json
    write_jsonl(js_lines, [PLAIN, MESSAGES])
    assert [r.source for r in load_preference_records(str(js_lines))] == [f"{js_lines}:1", f"{js_lines}:2"]
    not_list = tmp_path / "obj.json"
    not_list.write_text(json.dumps(PLAIN))
    with pytest.raises(DataError, match=rf"{re.escape(str(not_list))}.*not a list"):
        load_preference_records(str(not_list))


def test_hugging_face_name_path(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    src = write_jsonl(tmp_path / "hf.jsonl", [MESSAGES, MESSAGES, MESSAGES])
    recs = load_preference_records(name="json", data_files=str(src), split="train", limit=2)
    assert len(recs) == 2 and recs[0].chosen == "The road is warm." and recs[1].source == "hf:json[train]:row 1"

    def boom(*args, **kwargs):
        raise FileNotFoundError("no such dataset")

    monkeypatch.setattr(datasets, "load_dataset", boom)
    with pytest.raises(DataError, match=r"hf:org/missing/cfg\[test\].*no such dataset.*Fix"):
        load_preference_records(name="org/missing", config="cfg", split="test")


def _error_case(tmp_path, kind):
    """Return (path, expected substrings) after writing a file that must fail with ``kind``."""
    if kind in FILE_ERROR_KINDS:
        return _file_error_case(tmp_path, kind)
    p = tmp_path / "bad.jsonl"
    if kind == "malformed_json":
        write_jsonl(p, [PLAIN, '{"prompt": "x", "chosen": "y",'])
        return p, [f"{p}:2", "not valid JSON", "Fix"]
    if kind == "missing_field":
        row = dict(PLAIN)
        del row["rejected"]
        write_jsonl(p, [PLAIN, PLAIN, row])
        return p, [f"{p}:3", "`rejected`", "Fix"]
    if kind == "missing_prompt":
        row = dict(PLAIN)
        del row["prompt"]
        write_jsonl(p, [row])
        return p, [f"{p}:1", "`prompt`", "Fix"]
    if kind == "wrong_type":
        write_jsonl(p, [PLAIN, dict(PLAIN, chosen=5)])
        return p, [f"{p}:2", "`chosen`", "int", "Fix"]
    if kind == "wrong_type_rejected":
        write_jsonl(p, [dict(PLAIN, rejected=["a"])])
        return p, [f"{p}:1", "`rejected`", "list", "Fix"]
    if kind == "empty_completion":
        write_jsonl(p, [PLAIN, PLAIN, dict(PLAIN, chosen="   ")])
        return p, [f"{p}:3", "`chosen`", "empty", "Fix"]
    if kind == "empty_completion_messages":
        bad = dict(MESSAGES, rejected=_msgs("Describe the road.", ""))
        write_jsonl(p, [bad])
        return p, [f"{p}:1", "`rejected`", "empty", "Fix"]
    if kind == "prefix_mismatch":
        bad = dict(MESSAGES, rejected=_msgs("Describe the river.", "The river is cold."))
        write_jsonl(p, [MESSAGES, bad])
        return p, [f"{p}:2", "`chosen`", "`rejected`", "same", "Fix"]
    if kind == "no_final_assistant":
        bad = dict(MESSAGES, chosen=MESSAGES["chosen"][:1])
        write_jsonl(p, [bad])
        return p, [f"{p}:1", "`chosen`", "assistant", "Fix"]
    if kind == "bad_message":
        bad = dict(MESSAGES, chosen=[{"role": "user", "content": 3}, MESSAGES["chosen"][1]])
        write_jsonl(p, [bad])
        return p, [f"{p}:1", "chosen[0].content", "Fix"]
    if kind == "not_object":
        write_jsonl(p, [PLAIN, "[1, 2]"])
        return p, [f"{p}:2", "not an object", "Fix"]
    raise AssertionError(kind)


FILE_ERROR_KINDS = ("empty_file", "empty_json_list", "unknown_extension", "not_found")


def _file_error_case(tmp_path, kind):
    """``_error_case`` for a file that holds no rows, has an unknown extension, or is missing."""
    p = tmp_path / "bad.jsonl"
    if kind == "empty_file":
        p.write_text("\n\n")
        return p, [str(p), "no preference rows", "Fix"]
    if kind == "empty_json_list":
        p = tmp_path / "bad.json"
        p.write_text("[]")
        return p, [str(p), "no preference rows", "Fix"]
    if kind == "unknown_extension":
        p = tmp_path / "bad.csv"
        p.write_text("prompt,chosen,rejected\n")
        return p, [str(p), "`.csv`", ".jsonl", "Fix"]
    if kind == "not_found":
        p = tmp_path / "missing.jsonl"
        return p, [str(p), "does not exist", "Fix"]
    raise AssertionError(kind)


ERROR_KINDS = [
    "malformed_json", "missing_field", "missing_prompt", "wrong_type", "wrong_type_rejected", "empty_completion",
    "empty_completion_messages", "prefix_mismatch", "no_final_assistant", "bad_message", "not_object",
    "empty_file", "empty_json_list", "unknown_extension", "not_found",
]


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_bad_data_raises_data_error(tmp_path, kind):
    path, expected = _error_case(tmp_path, kind)
    with pytest.raises(DataError) as info:
        load_preference_records(str(path))
    msg = str(info.value)
    assert "\n" not in msg
    for piece in expected:
        assert piece in msg, (piece, msg)


@pytest.mark.parametrize("kwargs", [{}, {"path": "a.jsonl", "name": "org/set"}])
def test_path_and_name_exclusive(kwargs):
    with pytest.raises(DataError, match="exactly one of `path`.*`name`"):
        load_preference_records(**kwargs)


def test_split_eval_deterministic():
    recs = [PreferenceRecord([{"role": "user", "content": str(i)}], "a", "b", f"f:{i}") for i in range(50)]
    train, eval_ = split_eval(recs, 0.2, seed=3)
    assert len(eval_) == 10 and len(train) == 40
    assert split_eval(recs, 0.2, seed=3) == (train, eval_)
    assert split_eval(recs, 0.2, seed=4)[1] != eval_
    assert sorted(r.source for r in train + eval_) == sorted(r.source for r in recs)
    assert [r.source for r in train] == [r.source for r in recs if r not in eval_]  # input order kept
    assert split_eval(recs, 0.0, seed=0) == (recs, [])
    assert len(split_eval(recs[:3], 0.01, seed=0)[1]) == 1
    with pytest.raises(RecipeError):
        split_eval(recs, 1.0, seed=0)


# ----------------------------------------------------------------------------------------- tokenizing


def _record(prompt="Describe the river.", chosen="The river is calm and bright.", rejected="It is a dull river."):
    return PreferenceRecord([{"role": "user", "content": prompt}], chosen, rejected, "t:1")


@pytest.mark.parametrize("chat_template", ["auto", "none"])
def test_completion_mask_boundaries_exact(tok, chat_template):
    rec = _record()
    out = tokenize_preference(rec, tok, max_length=64, max_prompt_length=32, chat_template=chat_template)
    if chat_template == "auto":
        prompt = tok.apply_chat_template(rec.prompt, add_generation_prompt=True, tokenize=False)
        assert prompt == "<|user|>\nDescribe the river.\n<|assistant|>\n"
    else:
        prompt = "Describe the river.\n\n"
    for key, completion in (("chosen", rec.chosen), ("rejected", rec.rejected)):
        ids, mask = out[f"{key}_input_ids"], out[f"{key}_completion_mask"]
        assert len(ids) == len(mask)
        n_prompt = mask.index(1)
        assert set(mask[:n_prompt]) == {0} and set(mask[n_prompt:]) == {1}
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert ids[-1] == tok.eos_token_id
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == completion + tok.eos_token
        assert tok.decode(ids[1:n_prompt]) == prompt
    assert out["chosen_input_ids"][: out["chosen_completion_mask"].index(1)] == out["rejected_input_ids"][
        : out["rejected_completion_mask"].index(1)
    ]


def test_no_double_bos_and_template_fallback(tok):
    rec = _record()
    with_bos = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{{ ' =>' }}"
    out = tokenize_preference(rec, tok, 64, 32, chat_template=with_bos)
    ids = out["chosen_input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids[: out["chosen_completion_mask"].index(1)]) == "<|bos|>Describe the river. =>"

    saved = tok.chat_template
    try:
        tok.chat_template = None  # "auto" without a template falls back to "none"
        assert tokenize_preference(rec, tok, 64, 32) == tokenize_preference(rec, tok, 64, 32, chat_template="none")
    finally:
        tok.chat_template = saved
    with pytest.raises(RecipeError, match="none"):
        tokenize_preference(rec, tok, 64, 32, chat_template="nnone")


def test_adds_bos_is_kept_beside_the_tokenizer_not_on_it(tok):
    """The BOS fact is asked once per tokenizer object and cached outside it (no attribute written onto a Hugging
    Face object); the entry goes with the tokenizer."""
    import copy
    import gc

    from hl_core.data import tokens

    before = dict(vars(tok))
    calls = []

    class Counting:
        bos_token_id = tok.bos_token_id

        def __call__(self, text, add_special_tokens=True):
            calls.append(add_special_tokens)
            return tok(text, add_special_tokens=add_special_tokens)

    assert tokens.adds_bos(tok) == tokens.adds_bos(copy.deepcopy(tok)) and vars(tok) == before
    counting = Counting()
    first = tokens.adds_bos(counting)
    assert tokens.adds_bos(counting) == first and len(calls) == 2 and vars(counting) == {}
    key = id(counting)
    assert key in tokens._ADDS_BOS
    del counting
    gc.collect()
    assert key not in tokens._ADDS_BOS


B = 1  # BOS id used in the hand-computed truncation cases


@pytest.mark.parametrize(
    "prompt,chosen,rejected,max_len,max_prompt,expected",
    [
        # fits: untouched
        ([B, 10, 11], [20, 21], [30], 8, 4, ([B, 10, 11], [20, 21], [30])),
        # prompt longer than max_prompt_length but the pair fits in max_length: untouched (HALOs rule)
        ([B, 10, 11, 12, 13, 14], [20], [30], 8, 3, ([B, 10, 11, 12, 13, 14], [20], [30])),
        # long prompt: keep BOS + the END of the prompt (max_prompt_length tokens in all)
        ([B, 10, 11, 12, 13, 14, 15, 16], [20, 21], [30], 8, 4, ([B, 14, 15, 16], [20, 21], [30])),
        # long prompt without BOS: keep its last max_prompt_length tokens
        ([10, 11, 12, 13, 14, 15, 16], [20, 21], [30], 8, 4, ([13, 14, 15, 16], [20, 21], [30])),
        # long completion (prompt short): cut completion to max_length - len(prompt) - 1 (room for EOS)
        ([B, 10], [20, 21, 22, 23, 24, 25, 26, 27], [30, 31], 8, 4, ([B, 10], [20, 21, 22, 23, 24], [30, 31])),
        # both long: prompt to max_prompt_length first, then both completions to the remaining budget
        ([B, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35, 36], 8, 3,
         ([B, 14, 15], [20, 21, 22, 23], [30, 31, 32, 33])),
        # only the longer completion overflows: the shared prompt is still truncated for both
        ([B, 10, 11, 12, 13], [20], [30, 31, 32, 33], 8, 2, ([B, 13], [20], [30, 31, 32, 33])),
    ],
)
def test_truncate_pair_hand_computed(prompt, chosen, rejected, max_len, max_prompt, expected):
    assert truncate_pair(prompt, chosen, rejected, max_len, max_prompt, bos_token_id=B) == expected
    p, c, r = truncate_pair(prompt, chosen, rejected, max_len, max_prompt, bos_token_id=B)
    assert len(p) + len(c) + 1 <= max_len and len(p) + len(r) + 1 <= max_len


def test_truncate_pair_rejects_bad_lengths():
    with pytest.raises(RecipeError):
        truncate_pair([1], [2], [3], max_length=4, max_prompt_length=4)


def test_tokenize_preference_truncation(tok):
    words = "calm bright kind warm clear sweet gentle fresh lovely happy".split()
    long_prompt = "Describe the river. " + " ".join(words * 2)
    long_completion = "The river is " + " ".join(words * 2) + "."
    rec = _record(prompt=long_prompt, chosen=long_completion, rejected="It is dull.")
    text = tok.apply_chat_template(rec.prompt, add_generation_prompt=True, tokenize=False)
    full_prompt = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    full_chosen = tok(long_completion, add_special_tokens=False)["input_ids"]
    full_rejected = tok("It is dull.", add_special_tokens=False)["input_ids"]
    assert len(full_prompt) > 16 and len(full_chosen) > 20

    out = tokenize_preference(rec, tok, max_length=32, max_prompt_length=12)
    exp_prompt = [tok.bos_token_id] + full_prompt[-11:]
    exp_chosen = full_chosen[: 32 - 12 - 1] + [tok.eos_token_id]
    assert out["chosen_input_ids"] == exp_prompt + exp_chosen and len(out["chosen_input_ids"]) == 32
    assert out["chosen_completion_mask"] == [0] * 12 + [1] * 20
    assert out["rejected_input_ids"] == exp_prompt + full_rejected + [tok.eos_token_id]
    # the prompt keeps its END, so the generation prompt survives
    assert tok.decode(out["chosen_input_ids"][1:12]).endswith("\n<|assistant|>\n")

    # long completion only: prompt intact, completion cut
    rec2 = _record(chosen=long_completion)
    out2 = tokenize_preference(rec2, tok, max_length=20, max_prompt_length=12)
    n_prompt = out2["chosen_completion_mask"].index(1)
    assert len(out2["chosen_input_ids"]) == 20 and out2["chosen_input_ids"][-1] == tok.eos_token_id
    assert out2["chosen_input_ids"][n_prompt:-1] == full_chosen[: 20 - n_prompt - 1]


def test_collate_shapes_padding_and_row_order():
    feats = [
        {"chosen_input_ids": [1, 5, 6, 2], "chosen_completion_mask": [0, 0, 1, 1],
         "rejected_input_ids": [1, 5, 7, 8, 9, 2], "rejected_completion_mask": [0, 0, 1, 1, 1, 1]},
        {"chosen_input_ids": [1, 4, 2], "chosen_completion_mask": [0, 1, 1],
         "rejected_input_ids": [1, 4, 3, 2], "rejected_completion_mask": [0, 1, 1, 1]},
    ]
    out = collate_preference(feats, pad_token_id=0)
    assert set(out) == {"input_ids", "attention_mask", "completion_mask"}
    for v in out.values():
        assert v.shape == (4, 6) and v.dtype == torch.long
    assert out["input_ids"].tolist() == [
        [1, 5, 6, 2, 0, 0],  # chosen 0
        [1, 4, 2, 0, 0, 0],  # chosen 1
        [1, 5, 7, 8, 9, 2],  # rejected 0
        [1, 4, 3, 2, 0, 0],  # rejected 1
    ]
    assert out["attention_mask"].tolist() == [[1] * 4 + [0] * 2, [1] * 3 + [0] * 3, [1] * 6, [1] * 4 + [0] * 2]
    assert out["completion_mask"].tolist() == [
        [0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]
    ]


# ----------------------------------------------------------------------------------------- fixtures


def test_fixture_model_dir_loads_offline(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    assert not (MODEL_DIR / "model.safetensors").exists() and not (MODEL_DIR / "pytorch_model.bin").exists()
    cfg = AutoConfig.from_pretrained(str(MODEL_DIR))
    tk = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    assert cfg.model_type == "llama" and cfg.vocab_size == len(tk)
    assert 300 <= len(tk) <= 500
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.max_position_embeddings) == (4, 2, 256)
    assert cfg.tie_word_embeddings is False
    assert (tk.bos_token, tk.eos_token, tk.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (tk.bos_token_id, tk.eos_token_id, tk.pad_token_id)
    assert tk.chat_template
    assert tk.decode(tk("The garden is lovely.", add_special_tokens=False)["input_ids"]) == "The garden is lovely."

    # every fixture pair is short
    for name in ("train.jsonl", "eval.jsonl"):
        for rec in load_preference_records(str(PREFS / name)):
            out = tokenize_preference(rec, tok, max_length=256, max_prompt_length=128)
            assert max(len(out["chosen_input_ids"]), len(out["rejected_input_ids"])) < 48
    total = sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file())
    assert total < 1_000_000


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_tiny", FIXTURES / "build_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_build_tiny_is_deterministic(tmp_path):
    """One build in a subprocess (other hash seed) and one in-process must be byte-identical."""
    env = dict(os.environ, PYTHONHASHSEED="12345", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, str(FIXTURES / "build_tiny.py"), str(tmp_path / "a")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    _load_builder().build(tmp_path / "b")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out.decode()
    a, b = tmp_path / "a", tmp_path / "b"
    assert _files(a) == _files(b) == _files(TINY)
    match, mismatch, errors = filecmp.cmpfiles(a, b, _files(a), shallow=False)
    assert not mismatch and not errors, mismatch + errors
    # the committed preference data is what the script writes (library-version independent)
    for name in ("prefs/train.jsonl", "prefs/eval.jsonl"):
        assert (a / name).read_bytes() == (TINY / name).read_bytes(), f"re-run tests/fixtures/build_tiny.py ({name})"
