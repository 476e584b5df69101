"""Data loading for the humanline recipes: preference pairs (DPO) and their tokenization/collation."""

from hl_core.data.preference import (
    PreferenceRecord,
    collate_preference,
    load_preference_records,
    parse_preference_row,
    prompt_text,
    split_eval,
    tokenize_preference,
    truncate_pair,
)

__all__ = [
    "PreferenceRecord",
    "collate_preference",
    "load_preference_records",
    "parse_preference_row",
    "prompt_text",
    "split_eval",
    "tokenize_preference",
    "truncate_pair",
]
