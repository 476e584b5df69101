"""Who writes the preference studies' offline data: one or several models ("writers"), each a supervised warm-up
(``recipes/repro/warmup.yaml`` + its overrides, its own seed) that samples completions for every training prompt
(temperature 1, each prompt under its own seed); the reward (`eval.repro.preference.digit_credit`) picks
best vs worst among a prompt's non-empty completions.

* ``weak``: today's source (the preference study's): a shorter warm-up (120 updates) from another seed, 4 samples.
* ``strong``: a longer warm-up (1200 updates, twice the policy's) from another seed, 4 samples.
* ``mixture``: UltraFeedback-shaped: 4 models of different strength (120, 240, 600 and 1200 updates, the weak and
  strong writers among them), one completion each, best vs worst.

`build_source_data` writes ``pairs.jsonl`` (DPO, KTO), ``groups.jsonl`` (GRPO groups of two) and
``meta.json`` (counts, reward means, the pair distance, which writer wrote chosen and rejected) once, cached by the
writers' weights, the prompts and the sampling settings. It runs in a study worker (AVX2 kernels, 1 thread).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hl_core.storage.digests import sha256_file

from .._common import read_jsonl
from .preference import ANSWER_DIGITS, DATA_SEED, PROMPTS, SAMPLES, WEAK_SEED, WEAK_WARMUP_OVERRIDES, digit_credit
from .runs import RunFailed, WorkerPool, run_all, warmup_run, warmups


@dataclass(frozen=True)
class Writer:
    name: str  # the warm-up's cache name
    seed: int  # the warm-up's `train.seed`
    overrides: Tuple[str, ...]  # on top of the grid's warm-up overrides
    samples: int  # completions per prompt


@dataclass(frozen=True)
class Source:
    name: str
    label: str
    writers: Tuple[Writer, ...]


WEAK = Writer("weak-model", WEAK_SEED, WEAK_WARMUP_OVERRIDES, SAMPLES)
STRONG = Writer("strong-model", 2000, ("train.max_steps=1200",), SAMPLES)


def _one(writer: Writer) -> Writer:
    return Writer(writer.name, writer.seed, writer.overrides, 1)


SOURCES: Dict[str, Source] = {
    "weak": Source("weak", "weaker model (120-update warm-up), best vs worst of 4", (WEAK,)),
    "strong": Source("strong", "stronger model (1200-update warm-up), best vs worst of 4", (STRONG,)),
    "mixture": Source("mixture", "4 models (120/240/600/1200 updates), one sample each, best vs worst",
                      (_one(WEAK), Writer("mid-model", 3000, ("train.max_steps=240",), 1),
                       Writer("mid-model", 4000, ("train.max_steps=600",), 1), _one(STRONG))),
}
# the shortened grid's writers: the same shapes, trained briefly (its warm-ups are half-batch and short too)
_QUICK_STRONG = Writer("strong-model", 2000, ("train.max_steps=240",), SAMPLES)
QUICK_SOURCES: Dict[str, Source] = {
    "weak": SOURCES["weak"],
    "strong": Source("strong", "stronger model (240-update quick warm-up), best vs worst of 4", (_QUICK_STRONG,)),
    "mixture": Source("mixture", "4 quick models (60/120/180/240 updates), one sample each",
                      (_one(WEAK), Writer("mid-model", 3000, ("train.max_steps=60",), 1),
                       Writer("mid-model", 4000, ("train.max_steps=180",), 1), _one(_QUICK_STRONG))),
}


def _key(model_dirs: Sequence[Path], samples: Sequence[int], prompts: Path) -> str:
    # one writer with SAMPLES samples keeps the preference study's key (its cached data stays valid); "nonempty":
    # the pair is taken among non-empty samples
    tag = (SAMPLES, DATA_SEED, "nonempty") if list(samples) == [SAMPLES] else (tuple(samples), DATA_SEED, "nonempty")
    digest = hashlib.sha256(prompts.read_bytes() + repr(tag).encode())
    for model_dir in model_dirs:
        for path in sorted(p for p in Path(model_dir).iterdir() if p.suffix in (".safetensors", ".bin")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _sample(model_dir: Path, rows: List[dict], samples: int, seed: int, batch: int) -> List[List[str]]:
    """``samples`` completions (text) per row's prompt; prompt ``i`` drawn under ``prompt_seed(seed, i)``."""
    import torch  # the model libraries: only a worker that writes data needs them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hl_core.data.tokens import encode_prompt, prompt_text
    from hl_core.rollout.generation import prompt_seed, sample_groups

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    texts: List[List[str]] = []
    for first in range(0, len(rows), batch):
        chunk = rows[first:first + batch]
        ids = [encode_prompt(prompt_text([{"role": "user", "content": r["prompt"]}], tokenizer, "raw"), tokenizer)
               for r in chunk]
        sampled = sample_groups(model, [(p, samples, prompt_seed(seed, first + i)) for i, p in enumerate(ids)],
                                max_new_tokens=ANSWER_DIGITS + 1, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, temperature=1.0)
        texts += [tokenizer.batch_decode(completions, skip_special_tokens=True) for completions in sampled]
    return texts


def build_source_data(model_dirs: Sequence[str], samples: Sequence[int], out: str, prompts_path: str = str(PROMPTS),
                      limit: Optional[int] = None, batch: int = 256) -> Dict[str, str]:
    """Write (or find cached) the pairs of writers ``model_dirs`` (``samples[j]`` completions per prompt from writer
    ``j``, under seeds ``DATA_SEED + j``) under ``out/offline-<key>``; returns the paths of ``pairs``, ``groups``
    and ``meta``. A prompt whose non-empty completions all score the same, or with fewer than two, is left out
    and counted; the pair is best vs worst by reward (ties to the earliest completion)."""
    from hl_core.rollout.rewards import best_and_worst  # with the model libraries (see _sample)

    prompts = Path(prompts_path)
    directory = Path(out) / f"offline-{_key([Path(m) for m in model_dirs], samples, prompts)}"
    paths = {"pairs": directory / "pairs.jsonl", "groups": directory / "groups.jsonl", "meta": directory / "meta.json"}
    if paths["meta"].exists():
        print(f"offline data: cached at {directory}")
        return {k: str(v) for k, v in paths.items()}
    rows = read_jsonl(prompts)[:limit]
    per_writer = [_sample(Path(m), rows, n, DATA_SEED + j, batch) for j, (m, n) in enumerate(zip(model_dirs, samples))]
    writer_of = [j for j, n in enumerate(samples) for _ in range(n)]
    pairs, groups, chosen_from, rejected_from = [], [], [], []
    scores_by_writer: List[List[float]] = [[] for _ in model_dirs]
    ties = empty = unpaired = 0
    for i, row in enumerate(rows):
        texts = [t for writer in per_writer for t in writer[i]]
        scores = digit_credit(None, texts, [row["answer"]] * len(texts))
        for j, score in zip(writer_of, scores):
            scores_by_writer[j].append(score)
        # an empty completion (the model stopped at once) is no answer to prefer or reject: the data loaders
        # refuse empty completions, so pairs are taken among the non-empty samples (all counted in meta)
        usable = [k for k, text in enumerate(texts) if text.strip()]
        empty += len(texts) - len(usable)
        if len(usable) < 2:
            unpaired += 1
            continue
        best, worst, keep = best_and_worst([scores[k] for k in usable], 0.0)
        best, worst = usable[best], usable[worst]
        if not keep or texts[best] == texts[worst]:
            ties += 1
            continue
        pairs.append({"prompt": row["prompt"], "chosen": texts[best], "rejected": texts[worst]})
        groups.append({"prompt": row["prompt"], "completions": [texts[best], texts[worst]],
                       "scores": [scores[best], scores[worst]]})
        chosen_from.append(writer_of[best])
        rejected_from.append(writer_of[worst])
    directory.mkdir(parents=True, exist_ok=True)
    for name, items in (("pairs", pairs), ("groups", groups)):
        paths[name].write_text("".join(json.dumps(item) + "\n" for item in items))
    all_scores = [s for writer in scores_by_writer for s in writer]
    chosen = [g["scores"][0] for g in groups]
    rejected = [g["scores"][1] for g in groups]
    meta = {"model": " + ".join(str(m) for m in model_dirs), "prompts": len(rows), "pairs": len(pairs),
            "left_out_all_tied": ties, "empty_samples_not_paired": empty,
            "left_out_fewer_than_two_nonempty": unpaired, "samples_per_prompt": sum(samples),
            "sample_reward_mean": statistics.fmean(all_scores), "chosen_reward_mean": statistics.fmean(chosen),
            "rejected_reward_mean": statistics.fmean(rejected),
            "pair_distance_mean": statistics.fmean(c - r for c, r in zip(chosen, rejected)),
            "writers": [{"model": str(m), "samples": n, "sample_reward_mean": statistics.fmean(scores_by_writer[j]),
                         "chosen": chosen_from.count(j), "rejected": rejected_from.count(j)}
                        for j, (m, n) in enumerate(zip(model_dirs, samples))],
            "sha256": {name: sha256_file(paths[name]) for name in ("pairs", "groups")}}
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    print(f"offline data: {len(pairs)} pairs from {len(rows)} prompts ({ties} all tied and {unpaired} with fewer than "
          f"two non-empty samples, left out; {empty} empty samples not paired); mean sample reward "
          f"{meta['sample_reward_mean']:.3f}, chosen {meta['chosen_reward_mean']:.3f}, rejected "
          f"{meta['rejected_reward_mean']:.3f} -> {directory}")
    return {k: str(v) for k, v in paths.items()}


def train_writers(sources: Sequence[Source], cache: Path, warmup_overrides: Sequence[str], pool: WorkerPool) -> None:
    """Every writer of ``sources`` not yet cached, trained at once in ``pool`` (longest first), so that the writers
    of several sources run side by side instead of one source after another."""
    todo = {}
    for writer in (w for source in sources for w in source.writers):
        run = warmup_run(cache, [*warmup_overrides, *writer.overrides], writer.seed, writer.name)
        if run is not None:
            run.estimate_s = float(sum(int(o.split("=")[1]) for o in writer.overrides
                                       if o.startswith("train.max_steps=")))
            todo[run.output_dir] = run
    if todo:
        print(f"data writers: supervised training of {len(todo)} model(s) -> {cache}")
        run_all(list(todo.values()), pool, "data writers")


def source_data(source: Source, cache: Path, warmup_overrides: Sequence[str], pool: WorkerPool,
                limit: Optional[int]) -> Dict[str, Path]:
    """The source's writers (cached warm-ups, the missing ones trained in ``pool``) and its data, written in a
    ``pool`` worker; returns the paths of ``pairs``, ``groups`` and ``meta``."""
    models = []
    for writer in source.writers:
        built = warmups(cache, [*warmup_overrides, *writer.overrides], [writer.seed], pool, name=writer.name)
        models.append(str(built[writer.seed]))
    log = cache / "logs" / f"offline-data-{source.name}.log"
    answer = pool.ask({"call": "eval.repro.sources:build_source_data", "log": str(log),
                       "kwargs": {"model_dirs": models, "samples": [w.samples for w in source.writers],
                                  "out": str(cache), "limit": limit}})
    if answer["code"] != 0:
        raise RunFailed(f"writing the {source.name} offline data failed (exit {answer['code']}); log: {log}")
    print(Path(log).read_text().strip().splitlines()[-1])
    return {k: Path(v) for k, v in answer["result"].items()}
