"""From the recipe's ``data:`` group to tokenized train/eval datasets and their collate function."""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Tuple

from ..errors import RecipeError


class TokenizedDataset:
    """A list of tokenized examples plus the collate function that batches them."""

    def __init__(self, features: List[dict], collate: Callable):
        self.features = features
        self.collate = collate

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict:
        return self.features[index]


def _load(source, data_cfg):
    from .preference import load_preference_records

    return load_preference_records(
        path=source.path, name=source.name, split=source.split, config=source.config,
        format=data_cfg.format, limit=source.limit,
    )


def load_split_records(recipe) -> Tuple[list, Optional[list]]:
    """Records of the train split and of the eval split (``data.eval`` or ``data.eval_fraction``)."""
    from .preference import split_eval

    data_cfg = recipe.data
    train = _load(data_cfg.train, data_cfg)
    evaluation = None
    if data_cfg.eval is not None:
        evaluation = _load(data_cfg.eval, data_cfg)
    elif data_cfg.eval_fraction > 0:
        train, evaluation = split_eval(train, data_cfg.eval_fraction, recipe.train.seed)
    return train, evaluation


def build_datasets(recipe, tokenizer, data_kind: str, show_progress: bool = True):
    """Tokenize the recipe's data for an objective consuming ``data_kind`` examples."""
    from .preference import collate_preference, tokenize_preference

    if data_kind != "paired":
        raise RecipeError(
            f"`objective.name: {recipe.objective.name}` needs {data_kind} data, which this version of the pack "
            "cannot build yet. Fix: use `objective.name=dpo` with a preference data set."
        )
    train_records, eval_records = load_split_records(recipe)
    data_cfg = recipe.data
    tokenize = functools.partial(
        tokenize_preference, tokenizer=tokenizer, max_length=data_cfg.max_length,
        max_prompt_length=data_cfg.max_prompt_length, chat_template=data_cfg.chat_template,
    )
    collate = functools.partial(collate_preference, pad_token_id=tokenizer.pad_token_id)

    def run(records, desc):
        if records is None:
            return None
        iterator = records
        if show_progress and len(records) > 256:
            from tqdm.auto import tqdm

            iterator = tqdm(records, desc=f"tokenizing {desc}", unit="ex", leave=False)
        return TokenizedDataset([tokenize(record) for record in iterator], collate)

    return run(train_records, "train"), run(eval_records, "eval")
