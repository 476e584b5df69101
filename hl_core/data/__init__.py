"""Data loading for the humanline recipes: preference pairs (DPO), labelled completions (KTO) and scored
completion groups (GRPO), with their tokenization/collation."""

from hl_core.data.grouped import (
    GroupRecord,
    collate_groups,
    load_group_records,
    parse_group_row,
    tokenize_group,
)
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
from hl_core.data.unpaired import (
    UnpairedRecord,
    collate_unpaired,
    load_unpaired_records,
    parse_unpaired_row,
    tokenize_unpaired,
)

__all__ = [
    "GroupRecord",
    "PreferenceRecord",
    "UnpairedRecord",
    "collate_groups",
    "collate_preference",
    "collate_unpaired",
    "load_group_records",
    "load_preference_records",
    "load_unpaired_records",
    "parse_group_row",
    "parse_preference_row",
    "parse_unpaired_row",
    "prompt_text",
    "split_eval",
    "tokenize_group",
    "tokenize_preference",
    "tokenize_unpaired",
    "truncate_pair",
]
