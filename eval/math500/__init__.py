"""MATH-500 pass@1 through lm-eval, scored with math-verify.

`run_math500` loads the ``hl_math500`` task YAML shipped next to this file
(``eval/math500/tasks/hl_math500.yaml``), points it at the data (the hub's ``HuggingFaceH4/MATH-500`` by
default, or a local JSONL/JSON/Parquet file in the same schema), sets the sampling (the paper's
temperature 0.6, top_p 0.95, up to 2048 new tokens, n samples per problem) and runs it with
``lm_eval.simple_evaluate`` on an ``hf`` / ``vllm`` backend or any lm-eval ``LM`` object.

Result (``math500.json``)::

    {"task": "math500", "pass@1": 0.55, "pass@1_std": 0.02, "pass@1_per_sample": [...], "pass@n": 0.7,
     "n_problems": 500, "n_samples": 4, "sampling": {...}, "prompt": "r1", "chat_template": true,
     "backend": "hf", "model": "...", "data": {...}, "scorer": "hl_math500 answer rule + math-verify 0.9.0",
     "scorer_versions": {"math-verify": "0.9.0", "latex2sympy2_extended": "1.11.0",
                         "antlr4-python3-runtime": "4.13.2", "sympy": "1.14.0"}, ...}

``pass@1_std`` is the population std (ddof 0) across the n samples of each sample's pass@1 (0 for n = 1).
Per-problem completions and verdicts go to ``math500_samples.jsonl``. Answers are checked by the rule of
``tasks/answer.py`` (the last boxed answer or answer tag, in normal form) and math-verify, with the LaTeX parser
runtime pinned (``tasks/utils.py``: another one is refused, `check_scorer_runtime`).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from .._common import (
    EvalError,
    is_offline,
    looks_local,
    read_rows,
    version_of,
    write_json,
    write_jsonl,
)

log = logging.getLogger(__name__)

TASK_DIR = Path(__file__).resolve().parent / "tasks"
TASK_YAML = TASK_DIR / "hl_math500.yaml"
TASK_NAME = "hl_math500"
HUB_DATASET = "HuggingFaceH4/MATH-500"
PROMPTS = ("r1", "boxed", "minerva")

DEFAULTS = dict(
    n_samples=1,
    temperature=0.6,
    top_p=0.95,
    max_new_tokens=2048,
    prompt="r1",
    chat_template="auto",
    backend="auto",
    batch_size=1,
    limit=None,
    seed=0,
)


def task_config(
    data: Optional[str] = None,
    split: str = "test",
    n_samples: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 2048,
    prompt: str = "r1",
) -> Dict[str, Any]:
    """The ``hl_math500`` task config (a dict lm-eval's TaskManager accepts) for these settings."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if prompt not in PROMPTS:
        raise EvalError(f"MATH500 prompt `{prompt}` is not known; use one of {', '.join(PROMPTS)}.")
    if int(n_samples) < 1:
        raise EvalError(f"MATH500 needs n_samples >= 1, got {n_samples}.")
    if int(max_new_tokens) < 1:
        raise EvalError(f"MATH500 needs max_new_tokens >= 1, got {max_new_tokens}.")
    cfg = load_yaml(TASK_YAML, resolve_func=True)
    utils = inspect.getmodule(cfg["process_results"])

    data = data or HUB_DATASET
    if looks_local(data):
        path = os.path.abspath(data)
        _check_local_rows(path)
        ext = os.path.splitext(path)[1].lower()
        cfg["dataset_path"] = "parquet" if ext in (".parquet", ".pq") else "json"
        cfg["dataset_kwargs"] = {"data_files": {"test": path}}
        cfg["test_split"] = "test"
    else:
        if is_offline():
            raise EvalError(
                f"MATH500 data `{data}` is a Hugging Face dataset name but hub access is off (offline mode). Fix: "
                f"pass a local JSONL in the MATH-500 schema (problem, solution, answer, ...) with --data."
            )
        cfg["dataset_path"] = data
        cfg["test_split"] = split

    n = int(n_samples)
    cfg["repeats"] = n
    cfg["filter_list"] = [{"name": "samples", "filter": [{"function": "take_first_k", "k": n}]}]
    gen: Dict[str, Any] = {"until": [], "max_gen_toks": int(max_new_tokens)}
    if float(temperature) > 0:
        gen.update(do_sample=True, temperature=float(temperature), top_p=float(top_p))
    else:
        gen.update(do_sample=False, temperature=0.0)
    if prompt == "minerva":
        gen["until"] = ["Problem:"]
    cfg["generation_kwargs"] = gen
    cfg["doc_to_text"] = getattr(utils, "doc_to_text" if prompt == "r1" else f"doc_to_text_{prompt}")
    return cfg


def _check_local_rows(path: str) -> None:
    rows = read_rows(path)
    if not rows:
        raise EvalError(f"{path}: contains no MATH problems. Fix: one JSON object a line with `problem` and `answer`.")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("problem"), str):
            raise EvalError(
                f"{path}: row {i} has no `problem` string. Fix: use the MATH-500 schema (problem, solution, answer, "
                f"subject, level, unique_id)."
            )
        if not isinstance(row.get("answer"), str) and not isinstance(row.get("solution"), str):
            raise EvalError(
                f"{path}: row {i} has neither `answer` nor `solution`. Fix: give the reference answer as `answer` "
                f"(LaTeX, e.g. \\frac{{1}}{{2}}) or a `solution` ending in \\boxed{{...}}."
            )


def run_math500(
    model: Union[str, Any],
    *,
    data: Optional[str] = None,
    split: str = "test",
    n_samples: int = 1,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 2048,
    prompt: str = "r1",
    chat_template: Union[str, bool] = "auto",
    backend: str = "auto",
    batch_size: Union[int, str] = 1,
    limit: Optional[int] = None,
    seed: int = 0,
    dtype: str = "auto",
    backend_kwargs: Optional[Dict[str, Any]] = None,
    output_dir: Optional[Union[str, Path]] = None,
) -> Dict[str, Any]:
    """Run MATH-500 and return the result dict (also written to ``output_dir/math500.json`` when given).

    ``model``: a local HF model directory, a hub name, or an ``lm_eval.api.model.LM`` (e.g.
    `eval.lm.ScriptedLM`). ``chat_template``: ``"auto"`` (on when the model has one, except for
    the ``minerva`` prompt), ``True``/``False``. With ``prompt="r1"`` and the chat template on, the
    paper's open-r1 system prompt is the system message.
    """
    from ..lm import check_generation_room, make_lm

    t0 = time.time()
    check_scorer_runtime()
    cfg = task_config(data, split, n_samples, temperature, top_p, max_new_tokens, prompt)
    lm = make_lm(model, backend, batch_size=batch_size, dtype=dtype, seed=seed, backend_kwargs=backend_kwargs)
    backend_used = _backend_label(lm)
    check_generation_room(lm, max_new_tokens, "`eval.math500.max_new_tokens` (`--max-new-tokens`)")

    use_chat = _uses_chat_template(lm, chat_template, prompt)
    utils = inspect.getmodule(cfg["process_results"])
    system = utils.SYSTEM_PROMPT_R1 if (use_chat and prompt == "r1") else None
    if prompt == "r1" and not use_chat:
        log.warning("MATH500: prompt r1 without a chat template sends the bare problem; consider --prompt boxed.")
    out = _evaluate(lm, cfg, use_chat, system, limit, seed)
    task_res = out["results"][TASK_NAME]
    samples = out.get("samples", {}).get(TASK_NAME, [])
    samples = sorted(samples, key=lambda s: s["doc_id"])
    items = [s["pass@1"] for s in samples]
    per_sample = utils.per_sample_pass_at_1(items)

    result: Dict[str, Any] = {
        "task": "math500",
        "lm_eval_task": TASK_NAME,
        "pass@1": task_res.get("pass@1,samples"),
        "pass@1_std": task_res.get("pass@1_std,samples"),
        "pass@1_per_sample": per_sample,
        "pass@n": task_res.get("pass@n,samples"),
        "n_problems": len(samples),
        "n_samples": int(n_samples),
        "std_definition": "population std (ddof=0) across the n samples of each sample's pass@1 over all problems",
        "sampling": dict(cfg["generation_kwargs"], n=int(n_samples), seed=int(seed)),
        "prompt": prompt,
        "system_prompt": system,
        "chat_template": use_chat,
        "backend": backend_used,
        "model": model if isinstance(model, str) else type(model).__name__,
        "data": {
            "source": data or HUB_DATASET,
            "split": split if not (data and looks_local(data)) else "test",
            "limit": limit,
        },
        "scorer": f"hl_math500 answer rule + math-verify {version_of('math-verify')}",
        "scorer_versions": utils.scorer_versions(),
        "lm_eval_version": version_of("lm_eval"),
        "wall_s": round(time.time() - t0, 3),
    }
    rows = [_sample_row(s, utils) for s in samples]
    if output_dir is not None:
        out_dir = Path(output_dir)
        write_jsonl(out_dir / "math500_samples.jsonl", rows)
        result["files"] = {"samples": "math500_samples.jsonl"}
        write_json(out_dir / "math500.json", result)
    return result


def check_scorer_runtime() -> None:
    """`EvalError` (one paragraph: which runtime, the fix) unless the pinned LaTeX parser runtime is installed; before
    anything imports math_verify (latex2sympy2_extended picks its parser by the runtime's version at import)."""
    from .tasks import utils

    problem = utils.parser_runtime_problem()
    if problem is not None:
        raise EvalError(problem)


def _uses_chat_template(lm, chat_template: Union[str, bool], prompt: str) -> bool:
    """``chat_template`` decided: ``"auto"`` is on when the model has a template, except for the ``minerva`` prompt;
    ``True`` needs one."""
    from ..lm import has_chat_template

    if chat_template == "auto":
        return prompt != "minerva" and has_chat_template(lm)
    if chat_template and not has_chat_template(lm):
        raise EvalError("chat_template=true but the model's tokenizer has no chat template. Fix: use "
                        "--no-chat-template.")
    return bool(chat_template)


def _evaluate(lm, cfg: Dict[str, Any], use_chat: bool, system: Optional[str], limit: Optional[int], seed: int):
    """lm-eval's run of the task ``cfg`` with its samples logged, every generator seeded with ``seed``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=lm,
        tasks=[cfg],
        task_manager=TaskManager(include_defaults=False),
        apply_chat_template=use_chat,
        system_instruction=system,
        fewshot_as_multiturn=False,
        log_samples=True,
        limit=limit,
        bootstrap_iters=0,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )


def _backend_label(lm) -> str:
    name = type(lm).__name__
    return {"HFLM": "hf", "VLLM": "vllm"}.get(name, f"custom:{name}")


def _sample_row(sample: Dict[str, Any], utils) -> Dict[str, Any]:
    doc = sample.get("doc", {})
    completions = sample.get("filtered_resps", [[]])[0]
    if isinstance(completions, str):
        completions = [completions]
    return {
        "doc_id": sample.get("doc_id"),
        "unique_id": doc.get("unique_id"),
        "answer": utils.gold_answer_text(doc),
        "completions": list(completions),
        "extracted": [utils.extract_answer_text(c)[-200:] for c in completions],
        "correct": sample.get("pass@1"),
    }
