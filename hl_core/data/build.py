"""From the recipe's ``data:`` group to tokenized train/eval datasets and their collate function."""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..config.decisions import DataPlan
from ..errors import DataError
from .preference import split_eval
from .tokens import ChatTemplateError, counting_truncation


@dataclass
class DataStats:
    """What tokenizing one split did: examples kept, examples cut by ``data.max_length`` /
    ``data.max_prompt_length`` and the tokens cut, and examples dropped because all their completions were
    identical after tokenizing (a pair with chosen == rejected carries no signal)."""

    examples: int = 0
    truncated: int = 0
    truncated_tokens: int = 0
    identical_dropped: int = 0


@dataclass(frozen=True)
class SourcePart:
    """One source of a ``data.train`` mixture inside the combined dataset: its examples are the indices
    ``[start, start + stats.examples)``."""

    label: str
    weight: float
    start: int
    stats: DataStats


class TokenizedDataset:
    """A list of tokenized examples plus the collate function that batches them (``stats``: how they were made;
    ``parts``: a mixture's sources, consecutive in ``features``, or None for one source)."""

    def __init__(self, features: List[dict], collate: Callable, stats: Optional[DataStats] = None,
                 parts: Optional[List[SourcePart]] = None):
        self.features = features
        self.collate = collate
        self.stats = stats or DataStats(examples=len(features))
        self.parts = parts

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
    identical: Optional[str] = None  # feature -> True when all its completions are the same tokens

    def functions(self):
        mod = importlib.import_module(f"hl_core.data.{self.module}")
        collate = getattr(mod, self.collate) if self.collate else None
        return getattr(mod, self.load), getattr(mod, self.tokenize), collate

    def identical_check(self) -> Optional[Callable[[dict], bool]]:
        return getattr(importlib.import_module(f"hl_core.data.{self.module}"),
                       self.identical) if self.identical else None


DATA_KINDS = {
    "paired": DataKind("preference", "load_preference_records", "tokenize_preference", "collate_preference", "pair",
                       "identical_pair"),
    "unpaired": DataKind("unpaired", "load_unpaired_records", "tokenize_unpaired", "collate_unpaired", "completion"),
    "grouped": DataKind("grouped", "load_group_records", "tokenize_group", "collate_groups", "prompt group",
                        "identical_group"),
    "sft": DataKind("sft", "load_sft_records", "tokenize_sft", "collate_sft", "demonstration"),
    # rollouts: the data set holds prompts; the policy writes the completions (hl_core.rollout)
    "prompts": DataKind("prompts", "load_prompt_records", "tokenize_prompt", None, "prompt"),
}


def example_collate(plan: DataPlan, tokenizer):
    """The collate function of the objective's examples (used for generated examples too)."""
    _, _, collate = DATA_KINDS[plan.example_kind].functions()
    return functools.partial(collate, pad_token_id=tokenizer.pad_token_id)


def takes_donors(collate: Callable) -> bool:
    """Whether a collate function borrows from the rest of the data (a ``donors`` parameter: KTO's, for its
    mismatched KL rows)."""
    return "donors" in inspect.signature(collate).parameters


def collate_micro_batches(collate: Callable, micro_features: List[List[dict]], more: Sequence[dict] = ()) -> List[dict]:
    """Collate each micro-batch of one update. A collate function that `takes_donors` also gets the
    rest of the data: the other micro-batches (the next one first, circularly), then ``more`` (e.g. other
    ranks' examples of the same update)."""
    if not takes_donors(collate):
        return [collate(features) for features in micro_features]
    n = len(micro_features)
    return [
        collate(micro_features[m], donors=[f for k in range(1, n) for f in micro_features[(m + k) % n]] + list(more))
        for m in range(n)
    ]


def eval_batch(collate: Callable, data, real: Sequence[int], round_rows: Sequence[int]) -> dict:
    """One rank's eval micro-batch: rows ``real``, or one dummy row (``weights`` 0: it counts in no loss,
    metric or KTO z0) when the rank has none left. The round's other rows lend KTO's KL completions."""
    rows = list(real) or [0]
    taken = set(rows)
    others = [data[i] for i in round_rows if i not in taken] if takes_donors(collate) else []
    batch = collate_micro_batches(collate, [[data[i] for i in rows]], others)[0]
    if not real:
        batch["weights"] = torch.zeros(1, dtype=torch.float32)
    return batch


def eval_batches(collate: Callable, data, batch_size: int, dp_rank: int, dp_size: int,
                 max_batches: Optional[int] = None):
    """One rank's eval micro-batches over the split, each with its number of real rows: every rank runs the
    same number of rounds (ZeRO-3 gathers are collective), a rank with no rows left a dummy of weight 0."""
    n = len(data)
    per_round = batch_size * dp_size
    rounds = -(-n // per_round)
    if max_batches is not None:
        rounds = min(rounds, max_batches)
    for r in range(rounds):
        start = r * per_round + dp_rank * batch_size
        real = [i for i in range(start, start + batch_size) if i < n]
        yield eval_batch(collate, data, real, range(r * per_round, min(n, (r + 1) * per_round))), len(real)


def _load(source, data_cfg, plan: DataPlan, kind: str):
    load, _, _ = DATA_KINDS[kind].functions()
    extra = {"system_prompt": plan.system_prompt} if kind == "prompts" else {}
    return load(
        path=source.path, name=source.name, split=source.split, config=source.config,
        format=data_cfg.format, limit=source.limit, **extra,
    )


def load_split_records(data_cfg, plan: DataPlan) -> Tuple[List[list], Optional[list]]:
    """Records of each training source (one list per source of ``data.train``: one, or a mixture's) and of the
    eval split (``data.eval``, or ``data.eval_fraction`` held out of each training source), in the form the plan
    asks for. ``data_cfg``: the recipe's ``data`` section."""
    parts = [_load(source, data_cfg, plan, plan.train_kind) for source in data_cfg.train_sources]
    evaluation = None
    if data_cfg.eval is not None:
        evaluation = _load(data_cfg.eval, data_cfg, plan, plan.eval_kind)
    elif data_cfg.eval_fraction > 0:
        splits = [split_eval(part, data_cfg.eval_fraction, plan.seed) for part in parts]
        parts, evaluation = [train for train, _ in splits], [row for _, held in splits for row in held]
    return parts, evaluation


def build_datasets(data_cfg, plan: DataPlan, tokenizer, show_progress: bool = True, records=None,
                   bars: Optional[bool] = None):
    """Tokenize the data (``data_cfg``: the recipe's ``data`` section) as ``plan`` asks; returns
    ``(train, eval_or_None)`` datasets.

    Examples whose completions are all the same tokens (e.g. a pair that ``data.max_length`` cut to
    chosen == rejected) are dropped and counted in ``dataset.stats``; ``show_progress`` also prints the
    data summary (`describe_data`) and, unless ``bars`` is false, a tokenizing bar for a long split.
    ``records``: ``load_split_records(...)`` when already loaded. A mixture's sources are tokenized and counted one
    by one, then joined in order (``dataset.parts``)."""
    collate = example_collate(plan, tokenizer)
    train_parts, eval_records = records if records is not None else load_split_records(data_cfg, plan)

    def run(records, desc, kind_name):
        if records is None:
            return None
        kind = DATA_KINDS[kind_name]
        _, tokenize_fn, _ = kind.functions()
        identical = kind.identical_check()
        tokenize = functools.partial(
            tokenize_fn, tokenizer=tokenizer, max_length=data_cfg.max_length,
            max_prompt_length=data_cfg.max_prompt_length, chat_template=data_cfg.chat_template,
        )
        iterator = records
        if show_progress and bars is not False and len(records) > 256:
            from tqdm.auto import tqdm  # imported here: only a long split shows a bar

            iterator = tqdm(records, desc=f"tokenizing {desc}", unit="ex", leave=False)
        with counting_truncation() as cut:
            features = [tokenize_row(tokenize, record) for record in iterator]
        kept = [f for f in features if identical is None or not identical(f)]
        stats = DataStats(len(kept), cut.rows, cut.tokens, len(features) - len(kept))
        if not kept:
            raise DataError(
                f"data ({desc}): all {len(features)} {kind.example}s have identical completions after tokenizing "
                f"(truncation to `data.max_length` = {data_cfg.max_length} cut {cut.tokens} tokens from {cut.rows} of "
                f"them), so none carries a training signal. Fix: raise `data.max_length` (and/or lower "
                "`data.max_prompt_length`), or check the data."
            )
        return TokenizedDataset(kept, collate, stats)

    if data_cfg.mixture:
        sources = data_cfg.train_sources
        parts = [run(part, f"train, `data.train[{i}]` {source.label}", plan.train_kind)
                 for i, (part, source) in enumerate(zip(train_parts, sources))]
        train = join_sources(parts, [source.label for source in sources], [source.weight for source in sources])
    else:
        train = run(train_parts[0], "train", plan.train_kind)
    evaluation = run(eval_records, "eval", plan.eval_kind)
    if show_progress:
        print("data: " + describe_data(data_cfg, plan, train, evaluation), flush=True)
    return train, evaluation


def tokenize_row(tokenize: Callable, record):
    """``tokenize(record)``; a chat template's failure names the row."""
    try:
        return tokenize(record)
    except ChatTemplateError as exc:
        raise exc.at(record.source) from None


def join_sources(parts: List[TokenizedDataset], labels: List[str], weights: List[float]) -> TokenizedDataset:
    """A mixture's tokenized sources as one dataset, in order, each remembered as a ``SourcePart``."""
    features, sources, start = [], [], 0
    for part, label, weight in zip(parts, labels, weights):
        features += part.features
        sources.append(SourcePart(label, weight, start, part.stats))
        start += len(part)
    total = DataStats(*(sum(getattr(p.stats, f) for p in parts) for f in ("examples", "truncated", "truncated_tokens",
                                                                          "identical_dropped")))
    return TokenizedDataset(features, parts[0].collate, total, sources)


def _cut(s: DataStats) -> str:
    """What truncation and the identical-completion check did to a split or source ('' when nothing)."""
    if s.truncated:
        dropped = f"; {s.identical_dropped} dropped: identical after truncation" if s.identical_dropped else ""
        return f"{s.truncated} truncated, {s.truncated_tokens} tokens cut{dropped}"
    return f"{s.identical_dropped} dropped: identical completions" if s.identical_dropped else ""


def describe_data(data_cfg, plan: DataPlan, train: TokenizedDataset, evaluation: Optional[TokenizedDataset]) -> str:
    """One line: examples per split (and per source of a mixture, with its weight), what truncation cut, and the
    identical examples dropped."""
    parts = []
    for name, data, kind in (("train", train, plan.train_kind), ("eval", evaluation, plan.eval_kind)):
        if data is None:
            continue
        noun, s = DATA_KINDS[kind].example, data.stats
        text = f"{s.examples} {name} {noun}s"
        if data.parts:
            total = sum(part.weight for part in data.parts)
            text += f" from {len(data.parts)} sources [" + "; ".join(
                f"{p.label}: {p.stats.examples} at weight {p.weight / total:.3g}"
                + (f", {_cut(p.stats)}" if _cut(p.stats) else "") for p in data.parts) + "]"
        elif _cut(s):
            text += f" ({_cut(s)})"
        parts.append(text)
    limits = f"`data.max_length` {data_cfg.max_length}, `data.max_prompt_length` {data_cfg.max_prompt_length}"
    budget = plan.token_budget
    if budget is not None:  # the checks refuse a budget that an example could exceed: nothing is cut or dropped for it
        limits += (f"; micro-batches of <= {budget} tokens (`train.max_tokens_per_micro_batch`; no example cut or "
                   "dropped)")
    return f"{', '.join(parts)}; {limits}"


def data_summary_fields(train: TokenizedDataset, evaluation: Optional[TokenizedDataset]) -> dict:
    """Flat ``data/...`` entries of the run's ``summary.json``."""
    out = {}
    for name, data in (("train", train), ("eval", evaluation)):
        if data is not None:
            s = data.stats
            out.update({f"data/{name}_examples": s.examples, f"data/{name}_truncated": s.truncated,
                        f"data/{name}_truncated_tokens": s.truncated_tokens,
                        f"data/{name}_identical_dropped": s.identical_dropped})
            if data.parts:  # a mixture: each source's counts
                out[f"data/{name}_sources"] = [
                    {"source": p.label, "weight": p.weight, "examples": p.stats.examples,
                     "truncated": p.stats.truncated, "truncated_tokens": p.stats.truncated_tokens,
                     "identical_dropped": p.stats.identical_dropped}
                    for p in data.parts]
    return out
