"""From the recipe's ``data:`` group to tokenized train/eval datasets and their collate function."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple


class TokenizedDataset:
    """A list of tokenized examples plus the collate function that batches them."""

    def __init__(self, features: List[dict], collate: Callable):
        self.features = features
        self.collate = collate

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict:
        return self.features[index]


@dataclass(frozen=True)
class DataKind:
    """How one kind of example is loaded, tokenized and batched (``module`` under ``hl_core.data``)."""

    module: str
    load: str
    tokenize: str
    collate: str
    example: str  # what one example (and so `train.micro_batch_size`) counts

    def functions(self):
        import importlib

        mod = importlib.import_module(f"hl_core.data.{self.module}")
        return getattr(mod, self.load), getattr(mod, self.tokenize), getattr(mod, self.collate)


DATA_KINDS = {
    "paired": DataKind("preference", "load_preference_records", "tokenize_preference", "collate_preference", "pair"),
    "unpaired": DataKind("unpaired", "load_unpaired_records", "tokenize_unpaired", "collate_unpaired", "completion"),
    "grouped": DataKind("grouped", "load_group_records", "tokenize_group", "collate_groups", "prompt group"),
}


def data_kind(recipe) -> str:
    from ..objectives import OBJECTIVES

    return OBJECTIVES[recipe.objective.name].data_kind


def _load(source, data_cfg, kind: str):
    load, _, _ = DATA_KINDS[kind].functions()
    return load(
        path=source.path, name=source.name, split=source.split, config=source.config,
        format=data_cfg.format, limit=source.limit,
    )


def load_split_records(recipe) -> Tuple[list, Optional[list]]:
    """Records of the train split and of the eval split (``data.eval`` or ``data.eval_fraction``),
    in the form the recipe's objective consumes."""
    from .preference import split_eval

    data_cfg, kind = recipe.data, data_kind(recipe)
    train = _load(data_cfg.train, data_cfg, kind)
    evaluation = None
    if data_cfg.eval is not None:
        evaluation = _load(data_cfg.eval, data_cfg, kind)
    elif data_cfg.eval_fraction > 0:
        train, evaluation = split_eval(train, data_cfg.eval_fraction, recipe.train.seed)
    return train, evaluation


def build_datasets(recipe, tokenizer, show_progress: bool = True):
    """Tokenize the recipe's data for its objective; returns ``(train, eval_or_None)`` datasets."""
    _, tokenize_fn, collate_fn = DATA_KINDS[data_kind(recipe)].functions()
    train_records, eval_records = load_split_records(recipe)
    data_cfg = recipe.data
    tokenize = functools.partial(
        tokenize_fn, tokenizer=tokenizer, max_length=data_cfg.max_length,
        max_prompt_length=data_cfg.max_prompt_length, chat_template=data_cfg.chat_template,
    )
    collate = functools.partial(collate_fn, pad_token_id=tokenizer.pad_token_id)

    def run(records, desc):
        if records is None:
            return None
        iterator = records
        if show_progress and len(records) > 256:
            from tqdm.auto import tqdm

            iterator = tqdm(records, desc=f"tokenizing {desc}", unit="ex", leave=False)
        return TokenizedDataset([tokenize(record) for record in iterator], collate)

    return run(train_records, "train"), run(eval_records, "eval")
