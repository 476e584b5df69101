"""Data rows and checks shared by the data-loader tests (tests/test_data_unpaired_grouped.py,
tests/test_data_grouped.py): rows in each accepted form, writers, and the one-line refusal check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hl_core.errors import DataError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "tiny"
MODEL_DIR = TINY / "model"
GROUPS = TINY / "groups"
PREFS = TINY / "prefs"


def write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def write_parquet(path: Path, rows) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def msgs(prompt, completion):
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def user(text):
    return [{"role": "user", "content": text}]


PLAIN = {"prompt": "Describe the sky.", "chosen": "The sky is calm.", "rejected": "The sky is grim."}
MESSAGES = {
    "prompt": "Describe the road.",
    "chosen": msgs("Describe the road.", "The road is warm."),
    "rejected": msgs("Describe the road.", "The road is cold."),
}
KTO = {"prompt": "Describe the sky.", "completion": "The sky is calm.", "label": True}
GROUP = {"prompt": "Describe the sky.", "completions": ["The sky is calm.", "The sky is grim.", "It is kind."],
         "scores": [0.9, 0.1, 0.5]}
ARMORM = {
    "prompt_id": "abc",
    "prompt": "Describe the road.",
    "all_generated_responses": ["The road is warm.", "a", "The road is cold.", "b", "c"],
    "all_rm_scores": [0.25, 0.125, -0.5, 0.0, 0.1],
    "chosen": msgs("Describe the road.", "The road is warm."),
    "rejected": msgs("Describe the road.", "The road is cold."),
}


def check_error(exc_info, *pieces):
    msg = str(exc_info.value)
    assert "\n" not in msg
    for piece in pieces + ("Fix",):
        assert piece in msg, (piece, msg)


def assert_refused(load, path, expected):
    """``load(path)`` raises one ``DataError`` line naming every expected piece and the fix."""
    with pytest.raises(DataError) as info:
        load(str(path))
    check_error(info, *expected)


def completion_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])
