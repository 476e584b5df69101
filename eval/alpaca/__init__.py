"""AlpacaEval: generate outputs for the AlpacaEval instructions with the model's chat template, judge them
against the reference outputs with the ``alpaca_eval`` package, report the win rate and (when its inputs
are available) the length-controlled win rate.

* Instructions + reference outputs: the hub's ``tatsu-lab/alpaca_eval`` (config
  ``alpaca_eval_gpt4_baseline``: the 805 AlpacaEval 2 instructions with GPT-4 Turbo reference outputs) by
  default, or a local JSON/JSONL file in the same schema (``instruction``, ``output`` = the reference
  output, optional ``generator``, ``dataset``); ``reference_outputs`` may give the reference outputs
  separately.
* Generation: any backend of `eval.lm` (``hf`` on CPU, ``vllm`` on GPU, or an lm-eval ``LM``);
  defaults follow the HALOs sampler the authors used (temperature 0.7, top_p 0.95, 2048 new tokens).
* Judging (`eval.alpaca.judges`): ``alpaca_eval.main.evaluate`` with an API annotator config, or with
  a local annotator wrapping a reward model (e.g. ArmoRM) or a Python callable.
* Metrics: alpaca_eval's ``get_winrate`` (``win_rate`` in percent, ``standard_error``,
  ``discrete_win_rate``, counts) always; ``get_length_controlled_winrate`` when its GLM can be fitted on these
  annotations (`eval.alpaca.length_control`): the ``df_gamed.csv`` table of the ``tatsu-lab/alpaca_eval`` hub repo
  (downloaded or cached, or given with ``lc_data``), and annotations of one model against one baseline with an output
  and a preference for every instruction of the set the table covers, once each, in its order (the GLM reads an
  instruction's difficulty by its row). Otherwise ``length_controlled_winrate`` is null and
  ``length_controlled_reasons`` holds one sentence per cause (also logged; ``length_controlled_note`` joins them);
  ``headline`` names the number that was computed.
* Given outputs (``model_outputs``): an instruction without an output is left out of the win rate and named in
  ``generation.missing_outputs`` (and in the length-controlled rate's reasons).

Writes ``alpaca_eval.json`` (the result), ``alpaca_model_outputs.json`` (alpaca_eval's model-outputs
format) and ``alpaca_annotations.json`` under ``output_dir``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._common import EvalError, is_offline, looks_local, read_rows, seed_everything, version_of, write_json
from .judges import DEFAULT_API_JUDGE, ApiJudge, LocalAnnotator, make_judge
from .length_control import HUB_REPO, InstructionSet, make_metric_fn

__all__ = ["run_alpaca_eval", "make_metric_fn", "InstructionSet", "load_instructions", "judge_outputs"]

log = logging.getLogger(__name__)

HUB_CONFIG = "alpaca_eval_gpt4_baseline"
DEFAULT_JUDGE = f"api:{DEFAULT_API_JUDGE}"


# --------------------------------------------------------------------------------------------- data


def load_instructions(
    data: Optional[str] = None, hub_config: str = HUB_CONFIG, limit: Optional[int] = None
) -> Tuple[List[Dict[str, Any]], str]:
    """``(rows, label)``: rows with ``instruction`` and, when present, the reference ``output``/``generator``."""
    if data is not None and looks_local(data):
        rows, label = read_rows(data), str(data)
    else:
        name = data or HUB_REPO
        label = f"hf:{name}/{hub_config}"
        if is_offline():
            raise EvalError(
                f"AlpacaEval instructions `{label}` come from the Hugging Face hub, which is off (offline mode). Fix: "
                f"pass a local JSON/JSONL file with `instruction` and reference `output` fields."
            )
        rows = _hub_rows(name, hub_config)
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("instruction"), str):
            raise EvalError(
                f"{label}: row {i} has no `instruction` string. Fix: use AlpacaEval's schema (instruction, output, "
                f"generator, dataset)."
            )
        out.append(dict(row))
    if limit is not None:
        out = out[: int(limit)]
    if not out:
        raise EvalError(f"{label}: no AlpacaEval instructions.")
    return out, label


def _hub_rows(name: str, config: str) -> List[Dict[str, Any]]:
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id=name, filename=f"{config}.json", repo_type="dataset")
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except Exception as first:
        try:
            import datasets

            return [dict(r) for r in datasets.load_dataset(name, config, split="eval")]
        except Exception as second:
            raise EvalError(
                f"could not load AlpacaEval `{name}` / `{config}` from the hub ({type(first).__name__}: {first}; "
                f"{type(second).__name__}: {second}). Fix: check network access, or pass a local file."
            ) from None


def attach_references(
    rows: List[Dict[str, Any]], reference_outputs: Optional[str] = None
) -> List[Dict[str, Any]]:
    """Reference outputs (``instruction, output, generator, dataset``) aligned with ``rows``."""
    if reference_outputs is not None:
        by_instr = {}
        for r in read_rows(reference_outputs):
            by_instr[r["instruction"]] = r
        missing = [r["instruction"][:60] for r in rows if r["instruction"] not in by_instr]
        if missing:
            raise EvalError(
                f"{reference_outputs}: no reference output for {len(missing)} instruction(s), e.g. `{missing[0]}`. "
                f"Fix: give a reference output for every instruction."
            )
        src = [by_instr[r["instruction"]] for r in rows]
    else:
        src = rows
    refs = []
    for i, r in enumerate(src):
        if not isinstance(r.get("output"), str):
            raise EvalError(
                f"AlpacaEval row {i} has no reference `output`. Fix: include the baseline's output as `output` in "
                f"the data file, or pass reference outputs separately."
            )
        refs.append(
            {
                "instruction": rows[i]["instruction"],
                "output": r["output"],
                "generator": str(r.get("generator") or "reference"),
                "dataset": rows[i].get("dataset", r.get("dataset", "")),
            }
        )
    return refs


# --------------------------------------------------------------------------------------------- generation


def generate_outputs(
    lm,
    rows: Sequence[Dict[str, Any]],
    generator: str,
    *,
    max_new_tokens: int = 2048,
    temperature: float = 0.7,
    top_p: float = 0.95,
    chat_template: Union[str, bool] = "auto",
    seed: int = 0,
) -> Tuple[List[Dict[str, Any]], bool]:
    """Model outputs in alpaca_eval's format and whether the chat template was used."""
    from ..lm import check_generation_room, generate, has_chat_template, render_chat

    use_chat = has_chat_template(lm) if chat_template == "auto" else bool(chat_template)
    if use_chat and not has_chat_template(lm):
        raise EvalError("chat_template=true but the model's tokenizer has no chat template.")
    contexts = [
        render_chat(lm, [{"role": "user", "content": r["instruction"]}]) if use_chat else r["instruction"]
        for r in rows
    ]
    check_generation_room(lm, max_new_tokens, "`eval.alpaca_eval.max_new_tokens` (`--alpaca-max-new-tokens`)")
    gen: Dict[str, Any] = {"until": [], "max_gen_toks": int(max_new_tokens)}
    if float(temperature) > 0:
        gen.update(do_sample=True, temperature=float(temperature), top_p=float(top_p))
    else:
        gen.update(do_sample=False, temperature=0.0)
    seed_everything(seed)
    texts = generate(lm, contexts, gen)
    outputs = [
        {"instruction": r["instruction"], "output": t.strip(), "generator": generator, "dataset": r.get("dataset", "")}
        for r, t in zip(rows, texts)
    ]
    return outputs, use_chat


# --------------------------------------------------------------------------------------------- metrics


# --------------------------------------------------------------------------------------------- run


def judge_outputs(
    model_outputs: List[Dict[str, Any]],
    reference_outputs: List[Dict[str, Any]],
    judge,
    *,
    generator: str,
    length_controlled: str = "auto",
    lc_data: Optional[str] = None,
    cache_path: Optional[str] = None,
    instructions: Optional[InstructionSet] = None,
) -> Tuple[Dict[str, Any], List[Dict[str, Any]], Dict[str, Any]]:
    """``(metrics, annotations, lc_info)`` from ``alpaca_eval.main.evaluate``; ``instructions``: the set the run
    evaluates, which the length-controlled rate's guard checks the annotations against (`length_control`)."""
    import pandas as pd

    from .compat import import_alpaca_eval

    import_alpaca_eval()
    from alpaca_eval import main as ae_main

    metric_fn = make_metric_fn(length_controlled, lc_data, instructions)
    kwargs: Dict[str, Any] = dict(
        model_outputs=pd.DataFrame(model_outputs),
        reference_outputs=pd.DataFrame(reference_outputs),
        name=generator,
        output_path=None,
        precomputed_leaderboard=None,
        is_return_instead_of_print=True,
        fn_metric=metric_fn,
        sort_by="win_rate",
        is_cache_leaderboard=False,
    )
    if isinstance(judge, ApiJudge):
        kwargs.update(annotators_config=judge.annotators_config, caching_path=cache_path)
    else:
        kwargs.update(annotators_config=f"local:{judge.kind}:{judge.name}", Annotator=LocalAnnotator, judge=judge)
    leaderboard, annotations = ae_main.evaluate(**kwargs)
    metrics = leaderboard.loc[generator].to_dict()
    ann = annotations.to_dict("records") if isinstance(annotations, pd.DataFrame) else list(annotations)
    return metrics, ann, metric_fn.info


def default_generator_name(model: Union[str, Any]) -> str:
    if isinstance(model, str):
        p = Path(model.rstrip("/"))
        return p.parent.name if p.name == "final" and p.parent.name else p.name
    return type(model).__name__


def run_alpaca_eval(
    model: Union[str, Any, None],
    *,
    data: Optional[str] = None,
    hub_config: str = HUB_CONFIG,
    reference_outputs: Optional[str] = None,
    model_outputs: Optional[str] = None,
    judge: Union[str, Callable, Any] = DEFAULT_JUDGE,
    generator_name: Optional[str] = None,
    backend: str = "auto",
    batch_size: Union[int, str] = 1,
    dtype: str = "auto",
    backend_kwargs: Optional[Dict[str, Any]] = None,
    max_new_tokens: int = 2048,
    temperature: float = 0.7,
    top_p: float = 0.95,
    chat_template: Union[str, bool] = "auto",
    limit: Optional[int] = None,
    seed: int = 0,
    length_controlled: str = "auto",
    lc_data: Optional[str] = None,
    rm_mode: str = "hard",
    rm_batch_size: int = 8,
    rm_max_length: int = 4096,
    trust_remote_code: bool = False,
    output_dir: Optional[Union[str, Path]] = None,
) -> Dict[str, Any]:
    """Generate (unless ``model_outputs`` gives them), judge, and return the result dict (see the module doc).

    ``model``: a local HF model directory / hub name, or an lm-eval ``LM``; ``None`` with ``model_outputs``.
    ``judge``: a spec string (``api:NAME``, ``rm:MODEL``, ``py:MODULE:FUNCTION``), a callable
    ``(instruction, output_1=reference, output_2=model) -> preference in [1, 2]``, or a judge object.
    """
    t0 = time.time()
    out_dir = Path(output_dir) if output_dir is not None else None
    all_rows, data_label = load_instructions(data, hub_config)
    rows = all_rows[: int(limit)] if limit is not None else all_rows
    if not rows:
        raise EvalError(f"{data_label}: `limit={limit}` leaves no AlpacaEval instruction. Fix: a limit of at least 1.")
    instruction_set = InstructionSet(tuple(r["instruction"] for r in all_rows), f"`{data_label}`", limit)
    refs = attach_references(rows, reference_outputs)
    generator = generator_name or default_generator_name(model if model is not None else "model")

    judge_args = dict(workdir=out_dir or Path.cwd(), rm_mode=rm_mode, rm_batch_size=rm_batch_size,
                      rm_max_length=rm_max_length, trust_remote_code=trust_remote_code)
    loads_a_model = isinstance(judge, str) and judge.startswith("rm:")  # after generation: not both in memory
    judge_obj = None if loads_a_model else make_judge(judge, **judge_args)  # an API judge's credentials, first
    if model_outputs is not None:
        outputs, generation = _given_outputs(rows, model_outputs, generator)
        refs = [ref for ref in refs if ref["instruction"] in {o["instruction"] for o in outputs}]
    else:
        if model is None:
            raise EvalError("AlpacaEval needs a model to generate with, or model_outputs.")
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                        chat_template=chat_template, seed=seed)
        outputs, generation = _generate(model, rows, generator, sampling, backend=backend, batch_size=batch_size,
                                        dtype=dtype, backend_kwargs=backend_kwargs)
    if out_dir is not None:
        write_json(out_dir / "alpaca_model_outputs.json", outputs)

    if judge_obj is None:
        judge_obj = make_judge(judge, **judge_args)
    cache = str(out_dir / "alpaca_annotator_cache.json") if out_dir is not None else None
    metrics, annotations, lc_info = judge_outputs(
        outputs, refs, judge_obj, generator=generator, length_controlled=length_controlled, lc_data=lc_data,
        cache_path=cache, instructions=instruction_set,
    )
    result = _result(metrics, lc_info, generator=generator, model=model, data_label=data_label, rows=rows,
                     limit=limit, refs=refs, judge=judge_obj.describe(), generation=generation)
    result["wall_s"] = round(time.time() - t0, 3)
    if out_dir is not None:
        write_json(out_dir / "alpaca_annotations.json", annotations)
        result["files"] = {"model_outputs": "alpaca_model_outputs.json", "annotations": "alpaca_annotations.json"}
        write_json(out_dir / "alpaca_eval.json", result)
    log.info("AlpacaEval %s: %s", generator, {k: result[k] for k in result["computed"]})
    return result


def _given_outputs(rows: List[Dict[str, Any]], model_outputs: str, generator: str) -> Tuple[list, Dict[str, Any]]:
    """The model's outputs read from ``model_outputs`` (matched to the instructions by their text). Instructions
    without an output string are judged without it: the win rate covers the others, ``generation.missing_outputs``
    names them, and the length-controlled rate says why it is not computed."""
    given = {r.get("instruction"): r.get("output") for r in read_rows(model_outputs) if isinstance(r, dict)}
    outputs, missing = [], []
    for i, r in enumerate(rows):
        output = given.get(r["instruction"])
        if isinstance(output, str):
            outputs.append({"instruction": r["instruction"], "output": output, "generator": generator,
                            "dataset": r.get("dataset", "")})
        else:
            missing.append({"position": i + 1, "instruction": r["instruction"]})
    if not outputs:
        raise EvalError(f"{model_outputs}: no model output (an `output` string) for any of the {len(rows)} "
                        f"instructions. Fix: one row per instruction with `instruction` (its exact text) and `output`.")
    if missing:
        log.warning("AlpacaEval: %s has no model output for %d of the %d instructions (#%s); they are left out of "
                    "the win rate.", model_outputs, len(missing), len(rows),
                    ", #".join(str(m["position"]) for m in missing[:10]))
    return outputs, {"source": str(model_outputs), "missing_outputs": missing}


def _generate(model, rows: List[Dict[str, Any]], generator: str, sampling: Dict[str, Any], *, backend: str,
              batch_size, dtype: str, backend_kwargs) -> Tuple[list, Dict[str, Any]]:
    """The model's outputs, generated with ``sampling`` (max_new_tokens, temperature, top_p, chat_template,
    seed), and how they were generated."""
    from ..lm import make_lm

    seed, temperature = sampling["seed"], float(sampling["temperature"])
    lm = make_lm(model, backend, batch_size=batch_size, dtype=dtype, seed=seed, backend_kwargs=backend_kwargs)
    outputs, used_chat = generate_outputs(lm, rows, generator, **sampling)
    generation = {
        "backend": {"HFLM": "hf", "VLLM": "vllm"}.get(type(lm).__name__, f"custom:{type(lm).__name__}"),
        "max_new_tokens": int(sampling["max_new_tokens"]), "temperature": temperature,
        "top_p": float(sampling["top_p"]) if temperature > 0 else None, "do_sample": temperature > 0,
        "chat_template": used_chat, "seed": int(seed),
    }
    return outputs, generation


def _result(metrics: Dict[str, Any], lc_info: Dict[str, Any], *, generator: str, model, data_label: str, rows: list,
            limit: Optional[int], refs: list, judge: Dict[str, Any], generation: Dict[str, Any]) -> Dict[str, Any]:
    """The result dict (see the module doc) from the judge's metrics."""
    computed = ["win_rate"] + (["length_controlled_winrate"] if lc_info["computed"] else [])
    return {
        "task": "alpaca_eval",
        "generator": generator,
        "model": model if isinstance(model, str) else (type(model).__name__ if model is not None else None),
        "data": {"source": data_label, "n": len(rows), "limit": limit,
                 "reference_generator": sorted({r["generator"] for r in refs})},
        "judge": judge,
        "generation": generation,
        "units": "percent (0-100), alpaca_eval convention",
        "win_rate": metrics.get("win_rate"),
        "standard_error": metrics.get("standard_error"),
        "discrete_win_rate": metrics.get("discrete_win_rate"),
        "n_wins": metrics.get("n_wins"),
        "n_wins_base": metrics.get("n_wins_base"),
        "n_draws": metrics.get("n_draws"),
        "n_total": metrics.get("n_total"),
        "avg_length": metrics.get("avg_length"),
        "length_controlled_winrate": metrics.get("length_controlled_winrate") if lc_info["computed"] else None,
        "lc_standard_error": metrics.get("lc_standard_error") if lc_info["computed"] else None,
        "computed": computed,
        "headline": computed[-1],
        "length_controlled_note": lc_info["note"],
        "length_controlled_reasons": lc_info["reasons"],
        "alpaca_eval_version": version_of("alpaca_eval"),
    }
