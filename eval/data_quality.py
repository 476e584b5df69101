"""The paper's data-quality proxy: mean per-token log-prob of an offline data set's completions under the
reference (initial) model.

For each completion ``c`` of a record (DPO pairs: chosen and rejected; KTO: the completion; GRPO groups:
every completion), tokenized exactly as training does it (chat template, truncation, EOS appended)::

    mean_logp(c) = (1 / |c|) * sum_t log p_ref(c_t | prompt, c_<t)        (EOS included, prompt excluded)

A record's value is the token-weighted mean over its completions (sum of their log-probs / their total
token count). The report gives the distribution of record values (histogram, quartiles), flags the
records in the bottom quartile (value <= Q1), and compares the data set's mean with the paper's bad
quartile, ``[-1.03, -0.36]``: data whose completions the reference finds that unlikely trained worse.

CLI::

    python -m eval.data_quality DATA --model MODEL_DIR [--kind auto|preference|unpaired|groups]
        [--limit N] [--max-length 1024] [--max-prompt-length 512] [--batch-size 8] [--output DIR]

``DATA``: a local .jsonl/.json/.parquet file or a Hugging Face dataset name (``--split``, ``--config``).
Writes ``data_quality.json`` (the report) and ``data_quality_records.jsonl`` (one line a record).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ._common import (
    EvalError,
    check_finite_weights,
    check_model_dir,
    looks_local,
    set_offline,
    write_json,
    write_jsonl,
)

PAPER_BAD_QUARTILE = (-1.03, -0.36)
KINDS = ("auto", "preference", "unpaired", "groups")
PROXY = "mean per-token log-prob of the completions (EOS included, prompt excluded) under the reference model"


# --------------------------------------------------------------------------------------------- records


def first_row(path: str) -> Dict[str, Any]:
    from hl_core.data.rows import iter_file_rows

    from ._common import require_file

    require_file(path, "data file")
    for _, row in iter_file_rows(path, 1, "data", '{"prompt": "...", "chosen": "...", "rejected": "..."}'):
        return row
    raise EvalError(f"{path}: contains no rows. Fix: point the data-quality source at a non-empty file.")


def detect_kind(row: Dict[str, Any]) -> str:
    if not isinstance(row, dict):
        raise EvalError("data rows must be JSON objects; cannot detect the data kind.")
    if row.get("completions") is not None:
        return "groups"
    if row.get("chosen") is not None and row.get("rejected") is not None:
        return "preference"
    if row.get("completion") is not None:
        return "unpaired"
    raise EvalError(
        f"cannot tell the data kind from a row with fields {sorted(row)}: expected `chosen`/`rejected` "
        f"(preference), `completion`/`label` (unpaired KTO) or `completions`/`scores` (GRPO groups). "
        f"Fix: pass --kind."
    )


def load_items(
    data: str,
    kind: str = "auto",
    split: str = "train",
    config: Optional[str] = None,
    limit: Optional[int] = None,
    data_format: str = "auto",
) -> Tuple[str, List[Dict[str, Any]]]:
    """``(kind, items)``: each item ``{"prompt": messages, "completions": [str], "labels": [str], "source"}``."""
    from hl_core.data import load_group_records, load_preference_records, load_unpaired_records

    if kind not in KINDS:
        raise EvalError(f"data kind `{kind}` is not known; use one of {', '.join(KINDS)}.")
    local = looks_local(data)
    src = dict(path=data) if local else dict(name=data, split=split, config=config)
    if kind == "auto":
        kind = detect_kind(first_row(data)) if local else "preference"
    items: List[Dict[str, Any]] = []
    if kind == "preference":
        for r in load_preference_records(**src, format=data_format, limit=limit):
            items.append(dict(prompt=r.prompt, completions=[r.chosen, r.rejected], labels=["chosen", "rejected"],
                              source=r.source))
    elif kind == "unpaired":
        for r in load_unpaired_records(**src, format=data_format, limit=limit):
            label = "desirable" if r.desirable else "undesirable"
            items.append(dict(prompt=r.prompt, completions=[r.completion], labels=[label], source=r.source))
    else:
        for r in load_group_records(**src, format=data_format, limit=limit):
            items.append(dict(prompt=r.prompt, completions=list(r.completions),
                              labels=[f"completion_{i}" for i in range(len(r.completions))], source=r.source))
    return kind, items


# --------------------------------------------------------------------------------------------- scoring


def completion_logps(
    model,
    tokenizer,
    items: Sequence[Dict[str, Any]],
    max_length: int = 1024,
    max_prompt_length: int = 512,
    chat_template: str = "auto",
    batch_size: int = 8,
    chunk_size: int = 128,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[Dict[str, Any]]:
    """Per item: ``{"sum_logp": [per completion], "n_tokens": [...], "mean_logp": [...], "record_mean_logp"}``."""
    import torch

    from hl_core.data.tokens import ChatTemplateError, pad_right, tokenize_prompt_and_completions
    from hl_core.logprobs import sequence_token_logps

    seqs: List[Tuple[int, int, List[int], List[int]]] = []  # (item, completion, ids, completion mask)
    for i, item in enumerate(items):
        try:
            prompt_ids, comps = tokenize_prompt_and_completions(
                item["prompt"], item["completions"], tokenizer, max_length, max_prompt_length, chat_template
            )
        except ChatTemplateError as exc:
            raise exc.at(item.get("source") or f"row {i}") from None
        for j, comp in enumerate(comps):
            seqs.append((i, j, prompt_ids + comp, [0] * len(prompt_ids) + [1] * len(comp)))
    order = sorted(range(len(seqs)), key=lambda k: len(seqs[k][2]))  # length-sorted batches: less padding
    sums: Dict[Tuple[int, int], float] = {}
    counts: Dict[Tuple[int, int], int] = {}
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in range(0, len(order), batch_size):
                idx = order[b : b + batch_size]
                batch = pad_right([seqs[k][2] for k in idx], [seqs[k][3] for k in idx], tokenizer.pad_token_id)
                lp = sequence_token_logps(
                    model, batch["input_ids"].to(device), batch["attention_mask"].to(device), chunk_size=chunk_size
                )
                mask = batch["completion_mask"].to(lp.device, lp.dtype)
                s = (lp * mask).sum(-1).double().cpu().tolist()
                n = batch["completion_mask"].sum(-1).tolist()
                for k, sv, nv in zip(idx, s, n):
                    sums[(seqs[k][0], seqs[k][1])] = float(sv)
                    counts[(seqs[k][0], seqs[k][1])] = int(nv)
                if progress is not None:
                    progress(min(b + batch_size, len(order)), len(order))
    finally:
        model.train(was_training)
    out = []
    for i, item in enumerate(items):
        ncomp = len(item["completions"])
        s = [sums[(i, j)] for j in range(ncomp)]
        n = [counts[(i, j)] for j in range(ncomp)]
        out.append(
            {
                "sum_logp": s,
                "n_tokens": n,
                "mean_logp": [sv / max(nv, 1) for sv, nv in zip(s, n)],
                "record_mean_logp": sum(s) / max(sum(n), 1),
            }
        )
    return out


# --------------------------------------------------------------------------------------------- report


def quantiles(values: Sequence[float]) -> Dict[str, float]:
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    q = np.percentile(v, [0, 25, 50, 75, 100])  # linear interpolation (numpy's default)
    return {"min": q[0], "q1": q[1], "median": q[2], "q3": q[3], "max": q[4], "mean": float(v.mean()),
            "std": float(v.std())}


def histogram(values: Sequence[float], bins: int = 10) -> Dict[str, List[float]]:
    import numpy as np

    counts, edges = np.histogram(np.asarray(values, dtype=np.float64), bins=bins)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def verdict(mean_logp: float, bad: Tuple[float, float] = PAPER_BAD_QUARTILE) -> str:
    lo, hi = bad
    if mean_logp < lo:
        return (f"below the paper's bad quartile [{lo}, {hi}]: the reference finds these completions very unlikely; "
                f"expect offline training on them to do worse (consider regenerating with the reference model)")
    if mean_logp <= hi:
        return (f"inside the paper's bad quartile [{lo}, {hi}]: data in this range trained worse in the paper "
                f"(humanline syncing/clipping is meant to help most here)")
    return f"above the paper's bad quartile [{lo}, {hi}]: the completions are likely under the reference"


def build_report(
    kind: str,
    items: Sequence[Dict[str, Any]],
    scores: Sequence[Dict[str, Any]],
    *,
    model_label: str,
    data_label: str,
    bins: int = 10,
    bad: Tuple[float, float] = PAPER_BAD_QUARTILE,
    max_listed: int = 50,
) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    values = [s["record_mean_logp"] for s in scores]
    q = quantiles(values)
    total_sum = sum(sum(s["sum_logp"]) for s in scores)
    total_tok = sum(sum(s["n_tokens"]) for s in scores)
    token_weighted = total_sum / max(total_tok, 1)
    by_label: Dict[str, List[float]] = {}
    for item, s in zip(items, scores):
        for label, m in zip(item["labels"], s["mean_logp"]):
            key = label if kind != "groups" else "completion"
            by_label.setdefault(key, []).append(m)
    flagged = [i for i, v in enumerate(values) if v <= q["q1"]]
    records = []
    for i, (item, s) in enumerate(zip(items, scores)):
        records.append(
            {
                "index": i,
                "source": item["source"],
                "mean_logp": s["record_mean_logp"],
                "completions": {lab: {"mean_logp": m, "n_tokens": n}
                                for lab, m, n in zip(item["labels"], s["mean_logp"], s["n_tokens"])},
                "bottom_quartile": s["record_mean_logp"] <= q["q1"],
            }
        )
    worst = sorted(flagged, key=lambda i: values[i])[:max_listed]
    dataset_mean = q["mean"]
    report = {
        "task": "data_quality",
        "proxy": PROXY,
        "record_value": "token-weighted mean over the record's completions",
        "model": model_label,
        "data": {"source": data_label, "kind": kind, "n_records": len(items),
                 "n_completions": sum(len(it["completions"]) for it in items), "n_tokens": total_tok},
        "mean_logp": dataset_mean,
        "mean_logp_token_weighted": token_weighted,
        "quartiles": {k: q[k] for k in ("min", "q1", "median", "q3", "max")},
        "std": q["std"],
        "by_completion": {k: sum(v) / len(v) for k, v in by_label.items()},
        "histogram": histogram(values, bins),
        "bottom_quartile": {
            "threshold_q1": q["q1"],
            "n_flagged": len(flagged),
            "worst": [{"index": i, "source": items[i]["source"], "mean_logp": values[i]} for i in worst],
        },
        "paper_bad_quartile": list(bad),
        "in_paper_bad_quartile": bad[0] <= dataset_mean <= bad[1],
        "below_paper_bad_quartile": dataset_mean < bad[0],
        "verdict": verdict(dataset_mean, bad),
    }
    return report, records


def format_report(report: Dict[str, Any], width: int = 40) -> str:
    q = report["quartiles"]
    lines = [
        f"data quality proxy ({report['proxy']})",
        f"  data: {report['data']['source']} ({report['data']['kind']}, {report['data']['n_records']} records, "
        f"{report['data']['n_completions']} completions, {report['data']['n_tokens']} tokens)",
        f"  model: {report['model']}",
        f"  mean per-record {report['mean_logp']:.4f}   token-weighted {report['mean_logp_token_weighted']:.4f}   "
        f"std {report['std']:.4f}",
        f"  quartiles: min {q['min']:.4f} | Q1 {q['q1']:.4f} | median {q['median']:.4f} | Q3 {q['q3']:.4f} | "
        f"max {q['max']:.4f}",
    ]
    if report["by_completion"]:
        lines.append("  by completion: " + ", ".join(f"{k} {v:.4f}" for k, v in report["by_completion"].items()))
    lines.append("  distribution of record mean log-probs:")
    h = report["histogram"]
    top = max(h["counts"]) or 1
    for lo, hi, c in zip(h["edges"][:-1], h["edges"][1:], h["counts"]):
        mark = " <- bottom quartile" if lo < q["q1"] else ""
        bar = "#" * max(1 if c else 0, round(width * c / top))
        lines.append(f"    [{lo:9.4f}, {hi:9.4f}) {bar:<{width}} {c}{mark}")
    bq = report["bottom_quartile"]
    lines.append(f"  bottom quartile (<= Q1 = {bq['threshold_q1']:.4f}): {bq['n_flagged']} records flagged; worst:")
    for w in bq["worst"][:5]:
        lines.append(f"    {w['mean_logp']:.4f}  {w['source']}")
    lines.append(f"  verdict: data set mean {report['mean_logp']:.4f} is {report['verdict']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- entry points


def load_model(model: str, dtype: str = "fp32", device: Optional[str] = None, trust_remote_code: bool = False):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise EvalError(f"dtype `{dtype}` is not known; use one of {', '.join(dtypes)}.")
    check_model_dir(model, "reference model")
    try:
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtypes[dtype], trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise EvalError(f"could not load the reference model `{model}` ({exc}). Fix: pass a local model directory.")
    check_finite_weights(lm, model, "reference model")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return lm.to(device), tok


def run_data_quality(
    data: str,
    model: Union[str, Any],
    tokenizer=None,
    *,
    kind: str = "auto",
    split: str = "train",
    config: Optional[str] = None,
    limit: Optional[int] = None,
    data_format: str = "auto",
    max_length: int = 1024,
    max_prompt_length: int = 512,
    chat_template: str = "auto",
    batch_size: int = 8,
    dtype: str = "fp32",
    device: Optional[str] = None,
    bins: int = 10,
    model_label: Optional[str] = None,
    output_dir: Optional[Union[str, Path]] = None,
    print_fn: Optional[Callable[[str], None]] = print,
) -> Dict[str, Any]:
    """Score ``data`` under ``model`` (a model directory / hub name, or a loaded causal LM with ``tokenizer``),
    print the summary and write ``data_quality.json`` + ``data_quality_records.jsonl`` under ``output_dir``."""
    t0 = time.time()
    kind, items = load_items(data, kind, split, config, limit, data_format)
    if isinstance(model, str):
        label = model_label or model
        model, tokenizer = load_model(model, dtype, device)
    else:
        if tokenizer is None:
            raise EvalError("run_data_quality with a loaded model also needs its tokenizer.")
        label = model_label or type(model).__name__
    scores = completion_logps(model, tokenizer, items, max_length, max_prompt_length, chat_template, batch_size)
    report, records = build_report(kind, items, scores, model_label=label, data_label=str(data), bins=bins)
    report["settings"] = dict(max_length=max_length, max_prompt_length=max_prompt_length, chat_template=chat_template,
                              limit=limit, split=None if looks_local(data) else split)
    report["wall_s"] = round(time.time() - t0, 3)
    if print_fn is not None:
        print_fn(format_report(report))
    if output_dir is not None:
        out = Path(output_dir)
        write_jsonl(out / "data_quality_records.jsonl", records)
        report["files"] = {"records": "data_quality_records.jsonl"}
        write_json(out / "data_quality.json", report)
    return report


def add_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    d = prefix.replace("-", "_")
    p.add_argument(f"--{prefix}kind", dest=f"{d}kind", default="auto", choices=KINDS,
                   help="data kind (default: from the first row)")
    p.add_argument(f"--{prefix}split", dest=f"{d}split", default="train", help="split of a hub data set")
    p.add_argument(f"--{prefix}config", dest=f"{d}config", default=None, help="config of a hub data set")
    p.add_argument(f"--{prefix}limit", dest=f"{d}limit", type=int, default=None, help="score only the first N rows")
    p.add_argument(f"--{prefix}max-length", dest=f"{d}max_length", type=int, default=1024)
    p.add_argument(f"--{prefix}max-prompt-length", dest=f"{d}max_prompt_length", type=int, default=512)
    p.add_argument(f"--{prefix}chat-template", dest=f"{d}chat_template", default="auto", help="auto | none")
    p.add_argument(f"--{prefix}batch-size", dest=f"{d}batch_size", type=int, default=8)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.data_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="local .jsonl/.json/.parquet file or Hugging Face dataset name")
    p.add_argument("--model", required=True, help="reference model: a local HF model directory (or hub name)")
    add_arguments(p)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--output", default=None, help="directory for data_quality.json (default: print only)")
    p.add_argument("--offline", action="store_true", help="never touch the Hugging Face hub")
    a = p.parse_args(argv)
    set_offline(a.offline)
    run_data_quality(
        a.data, a.model, kind=a.kind, split=a.split, config=a.config, limit=a.limit, max_length=a.max_length,
        max_prompt_length=a.max_prompt_length, chat_template=a.chat_template, batch_size=a.batch_size,
        dtype=a.dtype, output_dir=a.output,
    )
    return 0


if __name__ == "__main__":
    from hl_core.errors import exit_on_user_error

    exit_on_user_error(main)
