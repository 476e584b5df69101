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
    collate: Optional[str]
    example: str  # what one example (and so `train.micro_batch_size`) counts

    def functions(self):
        import importlib

        mod = importlib.import_module(f"hl_core.data.{self.module}")
        collate = getattr(mod, self.collate) if self.collate else None
        return getattr(mod, self.load), getattr(mod, self.tokenize), collate


DATA_KINDS = {
    "paired": DataKind("preference", "load_preference_records", "tokenize_preference", "collate_preference", "pair"),
    "unpaired": DataKind("unpaired", "load_unpaired_records", "tokenize_unpaired", "collate_unpaired", "completion"),
    "grouped": DataKind("grouped", "load_group_records", "tokenize_group", "collate_groups", "prompt group"),
    "sft": DataKind("sft", "load_sft_records", "tokenize_sft", "collate_sft", "demonstration"),
    # rollouts: the data set holds prompts; the policy writes the completions (hl_core.rollout)
    "prompts": DataKind("prompts", "load_prompt_records", "tokenize_prompt", None, "prompt"),
}


def data_kind_of_objective(recipe) -> str:
    """What the objective trains on: ``paired``, ``unpaired`` or ``grouped`` examples."""
    from ..objectives import OBJECTIVES

    return OBJECTIVES[recipe.objective.name].data_kind


def data_kind(recipe) -> str:
    """What the data set holds: prompts when rollouts write the completions, else the objective's examples."""
    return "prompts" if recipe.rollout.every is not None else data_kind_of_objective(recipe)


def example_collate(recipe, tokenizer):
    """The collate function of the objective's examples (used for generated examples too)."""
    _, _, collate = DATA_KINDS[data_kind_of_objective(recipe)].functions()
    return functools.partial(collate, pad_token_id=tokenizer.pad_token_id)


def _load(source, recipe, kind: str):
    load, _, _ = DATA_KINDS[kind].functions()
    extra = {"system_prompt": recipe.rollout.system_prompt} if kind == "prompts" else {}
    return load(
        path=source.path, name=source.name, split=source.split, config=source.config,
        format=recipe.data.format, limit=source.limit, **extra,
    )


def load_split_records(recipe) -> Tuple[list, Optional[list]]:
    """Records of the train split and of the eval split (``data.eval`` or ``data.eval_fraction``),
    in the form the recipe's objective consumes."""
    from .preference import split_eval

    data_cfg, kind = recipe.data, data_kind(recipe)
    train = _load(data_cfg.train, recipe, kind)
    evaluation = None
    if data_cfg.eval is not None:
        evaluation = _load(data_cfg.eval, recipe, kind)
    elif data_cfg.eval_fraction > 0:
        train, evaluation = split_eval(train, data_cfg.eval_fraction, recipe.train.seed)
    return train, evaluation


def build_datasets(recipe, tokenizer, show_progress: bool = True):
    """Tokenize the recipe's data for its objective; returns ``(train, eval_or_None)`` datasets."""
    _, tokenize_fn, _ = DATA_KINDS[data_kind(recipe)].functions()
    collate = example_collate(recipe, tokenizer)
    train_records, eval_records = load_split_records(recipe)
    data_cfg = recipe.data
    tokenize = functools.partial(
        tokenize_fn, tokenizer=tokenizer, max_length=data_cfg.max_length,
        max_prompt_length=data_cfg.max_prompt_length, chat_template=data_cfg.chat_template,
    )

    def run(records, desc):
        if records is None:
            return None
        iterator = records
        if show_progress and len(records) > 256:
            from tqdm.auto import tqdm

            iterator = tqdm(records, desc=f"tokenizing {desc}", unit="ex", leave=False)
        return TokenizedDataset([tokenize(record) for record in iterator], collate)

    return run(train_records, "train"), run(eval_records, "eval")
