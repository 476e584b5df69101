"""Hostile data files (issue 19, items 6 and 7; issue 17, item 3): line separators inside JSON strings, empty
prompts, null fields, bytes that are not UTF-8, scores beyond float32, and rows that `data.max_length` cuts
(counted in the data summary and the run's summary; pairs cut to chosen == rejected are dropped, counted)."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, TINY_HUMANLINE, run_recipe
from hl_core.config import load_recipe
from hl_core.data import load_group_records, load_preference_records, load_unpaired_records
from hl_core.data.prompts import load_prompt_records
from hl_core.data.sft import load_sft_records
from hl_core.errors import DataError
from launchers.run import main

pytestmark = pytest.mark.usefixtures("repo_cwd")  # the recipes name their files relative to the repository

TINY_GRPO = REPO / "recipes" / "tiny" / "offline_grpo.yaml"


def _jsonl(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and "Fix" in message
    return message


# ------------------------------------------------------------------------------------------ reading


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])
def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path, char):
    """`str.splitlines` splits at these; JSON allows them raw inside strings. Lines end at "\\n" only (a
    "\\r" before it is fine), so the row loads and later lines keep their numbers."""
    pair = {"prompt": f"one{char}two", "chosen": f"a{char}b", "rejected": "c"}
    raw = json.dumps(pair, ensure_ascii=False)
    assert char in raw
    path = tmp_path / "sep.jsonl"
    path.write_text(raw + "\r\n" + raw + "\n", encoding="utf-8")
    records = load_preference_records(path)
    assert len(records) == 2 and records[0].prompt[0]["content"] == f"one{char}two" and records[1].chosen == f"a{char}b"
    path.write_text(raw + "\n" + raw + "\n" + '{"prompt": "p", "chosen": "a"}\n', encoding="utf-8")
    assert f"{path}:3" in _error(load_preference_records, path)


def test_data_file_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
    path.write_bytes((good + "\n" + good.replace('"b"', '"caf\xe9"') + "\n").encode("latin-1"))
    message = _error(load_preference_records, path)
    assert f"{path}:2" in message and "UTF-8" in message and "0xe9" in message and "position" not in message


# ------------------------------------------------------------------------------------------ rows


PLAIN = {"prompt": "p", "chosen": "a", "rejected": "b"}


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t", [{"role": "user", "content": "  "}]])
@pytest.mark.parametrize("loader, row", [
    (load_preference_records, PLAIN),
    (load_preference_records, {"prompt": None, "chosen": [{"role": "assistant", "content": "a"}],
                               "rejected": [{"role": "assistant", "content": "b"}]}),
    (load_unpaired_records, {"prompt": None, "completion": "a", "label": True}),
    (load_group_records, {"prompt": None, "completions": ["a", "b"], "scores": [1, 0]}),
    (load_prompt_records, {"prompt": None, "answer": "3"}),
    (load_sft_records, {"prompt": None, "completion": "a"}),
], ids=["pair", "messages-pair", "kto", "grpo", "rollout-prompts", "sft"])
def test_empty_prompts_are_refused_like_empty_completions(tmp_path, loader, row, prompt):
    path = _jsonl(tmp_path, [dict(row, prompt="A real prompt."), dict(row, prompt=prompt)])
    message = _error(loader, path)
    assert f"{path}:2" in message and "prompt" in message and "empty" in message


def test_messages_prompt_that_is_only_whitespace(tmp_path):
    conv = lambda answer: [{"role": "user", "content": " "}, {"role": "assistant", "content": answer}]  # noqa: E731
    path = _jsonl(tmp_path, [{"chosen": conv("a"), "rejected": conv("b")}])
    assert "empty" in _error(load_preference_records, path)
    path = _jsonl(tmp_path, [{"completion": conv("a"), "label": False}])
    assert "empty" in _error(load_unpaired_records, path)


@pytest.mark.parametrize("loader, row, field", [
    (load_preference_records, dict(PLAIN, chosen=None), "chosen"),
    (load_preference_records, dict(PLAIN, prompt=None), "prompt"),
    (load_unpaired_records, {"prompt": "p", "completion": None, "label": True}, "completion"),
    (load_group_records, {"prompt": "p", "completions": ["a", "b"], "scores": None}, "scores"),
    (load_group_records, {"prompt": None, "completions": ["a", "b"], "scores": [1, 0]}, "prompt"),
])
def test_null_field_is_called_null(tmp_path, loader, row, field):
    """Before: "row has no `chosen` field (fields present: chosen, prompt, rejected)"."""
    message = _error(loader, _jsonl(tmp_path, [row]))
    assert f"field `{field}` is null" in message
    listed = message.split("fields with values:")[1].split(")")[0] if "fields with values:" in message else ""
    assert field not in listed.split(", ")


@pytest.mark.parametrize("row, field", [
    ({"prompt": "p", "completions": ["a", "b"], "scores": [1e39, 0.0]}, "scores[0]"),
    ({"prompt": "p", "completions": ["a", "b"], "scores": [0.0, -3.5e38]}, "scores[1]"),
    (dict(PLAIN, score_chosen=1.0, score_rejected=1e39), "score_rejected"),
    (dict(PLAIN, all_rm_scores=[1.0, 1e300]), "all_rm_scores[1]"),
])
def test_scores_beyond_float32_are_refused(tmp_path, row, field):
    path = _jsonl(tmp_path, [{"prompt": "q", "completions": ["x", "y"], "scores": [3.0e38, -3.0e38]}, row])
    message = _error(load_group_records, path)
    assert f"{path}:2" in message and f"`{field}`" in message and "float32" in message


# ------------------------------------------------------------------------------------------ truncation

LONG = "the same long words again " * 12


def _cut_pairs(tmp_path):
    rows = [
        {"prompt": "Describe the field.", "chosen": "It is lovely.", "rejected": "It is grim."},  # fits
        {"prompt": "Describe the sky.", "chosen": LONG + "good", "rejected": LONG + "bad"},  # cut to the same prefix
        {"prompt": "Describe the sea.", "chosen": "Calm " + LONG, "rejected": "Rough " + LONG},  # cut, still differ
    ]
    return _jsonl(tmp_path, rows, "cut.jsonl")


def test_truncation_is_counted_and_identical_pairs_dropped(tmp_path, capsys):
    from hl_core.config import data_plan
    from hl_core.data.build import build_datasets, data_summary_fields
    from hl_core.models.loading import load_tokenizer

    path = _cut_pairs(tmp_path)
    recipe = load_recipe(TINY_HUMANLINE, [f"data.train.path={path}", f"data.eval.path={path}", "data.max_length=40",
                                          "data.max_prompt_length=16"])
    train, evaluation = build_datasets(recipe.data, data_plan(recipe), load_tokenizer(recipe.model), show_progress=True)
    out = capsys.readouterr().out
    assert (train.stats.examples, train.stats.truncated, train.stats.identical_dropped) == (2, 2, 1)
    assert train.stats.truncated_tokens > 0 and len(train) == 2
    assert all(f["chosen_input_ids"] != f["rejected_input_ids"] for f in train.features)
    assert "data: 2 train pairs (2 truncated" in out and "1 dropped: identical after truncation" in out
    fields = data_summary_fields(train, evaluation)
    assert fields["data/train_truncated"] == 2 and fields["data/train_identical_dropped"] == 1
    assert fields["data/eval_examples"] == 2
    # --validate reports the same, before any weights are loaded
    assert main([str(TINY_HUMANLINE), f"data.train.path={path}", f"data.eval.path={path}", "data.max_length=40",
                 "data.max_prompt_length=16", "--validate"]) == 0
    assert "tokenized: 2 train pairs (2 truncated" in capsys.readouterr().out


def test_all_pairs_identical_after_truncation_is_an_error(tmp_path):
    from hl_core.config import data_plan
    from hl_core.data.build import build_datasets
    from hl_core.models.loading import load_tokenizer

    path = _jsonl(tmp_path, [{"prompt": "Describe the sky.", "chosen": LONG + "good", "rejected": LONG + "bad"}])
    recipe = load_recipe(TINY_HUMANLINE, [f"data.train.path={path}", "data.eval=null", "eval.every=null",
                                          "data.max_length=40", "data.max_prompt_length=16"])
    message = _error(build_datasets, recipe.data, data_plan(recipe), load_tokenizer(recipe.model), show_progress=False)
    assert "data.max_length" in message and "identical" in message


def test_grpo_group_cut_to_identical_completions_is_dropped(tmp_path):
    from hl_core.config import data_plan
    from hl_core.data.build import build_datasets
    from hl_core.models.loading import load_tokenizer

    path = _jsonl(tmp_path, [
        {"prompt": "Describe the sky.", "completions": [LONG + "a", LONG + "b", LONG + "c"], "scores": [1, 0, 0.5]},
        {"prompt": "Describe the sea.", "completions": ["Calm.", "Rough."], "scores": [1, 0]},
    ])
    recipe = load_recipe(TINY_GRPO, [f"data.train.path={path}", "data.eval=null", "eval.every=null",
                                     "data.max_length=40", "data.max_prompt_length=16"])
    train, _ = build_datasets(recipe.data, data_plan(recipe), load_tokenizer(recipe.model), show_progress=False)
    assert (train.stats.examples, train.stats.truncated, train.stats.identical_dropped) == (1, 1, 1)


def test_run_summary_counts_truncation(tmp_path):
    path = _cut_pairs(tmp_path)
    out = tmp_path / "out"
    proc = run_recipe(TINY_HUMANLINE, [f"output_dir={out}", f"data.train.path={path}", "data.eval=null",
                                       "eval.every=null", "data.max_length=40", "data.max_prompt_length=16",
                                       "train.max_steps=1", "train.micro_batch_size=2", "checkpoint.save_every=null",
                                       "checkpoint.save_final=false"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data/train_truncated"] == 2 and summary["data/train_identical_dropped"] == 1
    assert summary["data/train_examples"] == 2 and summary["data/train_truncated_tokens"] > 0
    assert "1 dropped: identical after truncation" in proc.stdout
