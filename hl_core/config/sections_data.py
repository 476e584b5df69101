"""The recipe's ``data`` group: the training source or mixture, the held-out source, row format and truncation."""

from __future__ import annotations

from typing import Annotated, List, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from .sections import _Section


class DataSource(_Section):
    """One data source: a local file (`path`) or a Hugging Face dataset (`name`)."""

    path: Optional[str] = Field(None, description="Local `.jsonl`, `.json` or `.parquet` file.")
    name: Optional[str] = Field(None, description="Hugging Face dataset name (used when `path` is not set).")
    split: str = Field("train", description="Split to read from a Hugging Face dataset.")
    config: Optional[str] = Field(None, description="Hugging Face dataset configuration name.")
    limit: Optional[int] = Field(None, ge=1, description="Use only the first `limit` rows.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.name is None):
            raise ValueError("set exactly one of `path` (a local file) or `name` (a Hugging Face dataset)")
        return self

    @property
    def label(self) -> str:
        """How the data line names it: the path, or the dataset name (with its configuration and split)."""
        return self.path or f"{self.name}{':' + self.config if self.config else ''}[{self.split}]"


class MixtureSource(DataSource):
    """One source of a `data.train` mixture (`[{path: a.jsonl, weight: 0.7}, {name: org/set, weight: 0.3}]`). The
    mixture's stream is cut into blocks of 10,000 positions; each block gives every source its share (largest-remainder
    rounding of its normalised weight) in an order drawn from `train.seed` and the block (evenly spread without
    `data.shuffle`), and a source's k-th draw is the k-th example of its own endless order (a fresh permutation per
    pass, seeded per source), so a source repeats only after all its examples were drawn. Every position is a
    function of the seed: a resume continues exactly. Each source is loaded, tokenized and reported (rows,
    truncation; the data line and `summary.json`) on its own; `data.eval_fraction` holds out that fraction of each;
    `train.epochs` counts passes over the sources' total size. Example: `recipes/tiny/mixture_dpo.yaml`."""

    weight: float = Field(
        gt=0, description="Share of the training stream drawn from this source: its weight over the sum of the "
        "weights (each share at least 1/10000).",
    )


# the smallest share of the stream a mixture source may have: one draw per 10,000-position block (loop.sources)
MIN_MIXTURE_SHARE = 1e-4


def _train_form(value) -> str:
    return "mixture" if isinstance(value, list) else "source"


TrainData = Annotated[
    Union[Annotated[DataSource, Tag("source")], Annotated[List[MixtureSource], Tag("mixture")]],
    Discriminator(_train_form),
]


class DataConfig(_Section):
    """Training and held-out data, row format, chat template and truncation."""

    train: TrainData = Field(
        description="Training data: one source (`{path: a.jsonl}` or `{name: org/set}`), or a mixture: a list of "
        "sources with weights (`data.train[i]`).",
    )
    eval: Optional[DataSource] = Field(None, description="Held-out data source for `eval.every`.")
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this fraction of `train` for evaluation when `eval` is unset."
    )
    format: Literal["auto", "plain", "messages"] = Field(
        "auto",
        description="Row format: `plain` (prompt/chosen/rejected strings), `messages` (chosen/rejected as "
        "chat message lists, UltraFeedback style) or `auto` (detected per row).",
    )
    max_length: int = Field(1024, ge=8, description="Maximum prompt + completion tokens per sequence.")
    max_prompt_length: int = Field(512, ge=1, description="Prompt tokens kept (the most recent) when truncating.")
    chat_template: str = Field(
        "auto", description="`auto` (the tokenizer's chat template), `none` (contents joined by blank lines), "
        "`raw` (contents concatenated as they are), or a Jinja template string."
    )
    shuffle: bool = Field(True, description="Shuffle training data each epoch (seeded by `train.seed`).")
    packing: bool = Field(
        False, description="Padding-free forwards: each micro-batch's sequences (pairs, KTO and KL rows, GRPO group "
        "members, SFT rows, generated completions) are packed into as few `data.max_length`-token rows as fit, "
        "positions restarting per sequence and attention never crossing one (transformers' packed-sequence mask; "
        "flash-attention's variable-length path on a GPU). Same losses as padded batches. DeepSpeed engine only.",
    )

    @field_validator("train")
    @classmethod
    def _mixture(cls, train):
        if isinstance(train, list):
            if not train:
                raise ValueError("a mixture needs at least one source (`[{path: a.jsonl, weight: 1.0}, ...]`)")
            total = sum(source.weight for source in train)
            for i, source in enumerate(train):
                if source.weight / total < MIN_MIXTURE_SHARE:
                    raise ValueError(
                        f"`data.train[{i}].weight` ({source.weight:g}) is under 1/10000 of the weights' sum "
                        f"({total:g}): that source would be drawn less than once per 10,000 examples. Fix: raise "
                        "its weight, or drop the source"
                    )
        return train

    @property
    def train_sources(self) -> List[DataSource]:
        """The training sources: the one source, or the mixture's."""
        return list(self.train) if isinstance(self.train, list) else [self.train]

    @property
    def mixture(self) -> bool:
        return isinstance(self.train, list)

    @model_validator(mode="after")
    def _lengths(self):
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"`max_prompt_length` ({self.max_prompt_length}) must be smaller than `max_length` "
                f"({self.max_length}) so the completion keeps at least one token"
            )
        return self
