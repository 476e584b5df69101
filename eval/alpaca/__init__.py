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
  ``discrete_win_rate``, counts) always; ``get_length_controlled_winrate`` when its GLM inputs are
  available: the ``df_gamed.csv`` table of the ``tatsu-lab/alpaca_eval`` hub repo (downloaded or cached, or
  given with ``lc_data``) and an instruction set of the size that table covers (it indexes instructions by
  position: the full 805). Otherwise ``length_controlled_winrate`` is null and ``length_controlled_note``
  says why; ``headline`` names the number that was computed.

Writes ``alpaca_eval.json`` (the result), ``alpaca_model_outputs.json`` (alpaca_eval's model-outputs
format) and ``alpaca_annotations.json`` under ``output_dir``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .._common import EvalError, is_offline, looks_local, read_rows, seed_everything, version_of, write_json
from .judges import DEFAULT_API_JUDGE, ApiJudge, LocalAnnotator, make_judge

log = logging.getLogger(__name__)

HUB_REPO = "tatsu-lab/alpaca_eval"
HUB_CONFIG = "alpaca_eval_gpt4_baseline"
LC_FILE = "df_gamed.csv"
DEFAULT_JUDGE = f"api:{DEFAULT_API_JUDGE}"
LC_MODES = ("auto", "off")


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


def _lc_table(lc_data: Optional[str]) -> Tuple[Optional[str], str]:
    if lc_data is not None:
        if not os.path.isfile(lc_data):
            return None, f"not computed: lc_data `{lc_data}` does not exist"
        return lc_data, ""
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id=HUB_REPO, filename=LC_FILE, repo_type="dataset", local_files_only=is_offline())
        return path, ""
    except Exception as exc:
        return None, (
            f"not computed: the length-control GLM inputs ({HUB_REPO}/{LC_FILE}) are not available "
            f"({type(exc).__name__}); offline runs need a cached copy or lc_data=PATH"
        )


@contextlib.contextmanager
def _local_hub_file(module, path: str):
    """Make ``module.hf_hub_download`` return ``path`` (alpaca_eval's GLM reads df_gamed.csv through it)."""
    saved = module.hf_hub_download
    module.hf_hub_download = lambda *a, **k: path
    try:
        yield
    finally:
        module.hf_hub_download = saved


def make_metric_fn(length_controlled: str = "auto", lc_data: Optional[str] = None):
    """``fn(annotations) -> metrics`` for ``alpaca_eval.main.evaluate(fn_metric=...)``; ``fn.info`` records
    whether the length-controlled win rate was computed and why not."""
    import pandas as pd
    from alpaca_eval import metrics as ae_metrics

    if length_controlled not in LC_MODES:
        raise EvalError(f"length_controlled `{length_controlled}` is not known; use one of {', '.join(LC_MODES)}.")
    info: Dict[str, Any] = {"computed": False, "note": ""}

    def fn(annotations) -> Dict[str, Any]:
        df = pd.DataFrame(list(annotations)) if not isinstance(annotations, pd.DataFrame) else annotations
        df = df.reset_index(drop=True)
        out = dict(ae_metrics.get_winrate(df))
        out["length_controlled_winrate"] = None
        out["lc_standard_error"] = None
        if length_controlled == "off":
            info["note"] = "not computed: length_controlled=off"
            return out
        path, note = _lc_table(lc_data)
        if path is None:
            info["note"] = note
            return out
        try:
            n_lc = int(pd.read_csv(path)["index"].nunique())
        except Exception as exc:
            info["note"] = f"not computed: cannot read the GLM table {path} ({exc})"
            return out
        if len(df) != n_lc:
            info["note"] = (
                f"not computed: the length-control GLM's instruction-difficulty table covers {n_lc} instructions "
                f"(by position) and this run has {len(df)}; LC needs the full AlpacaEval set in its order"
            )
            return out
        try:
            from alpaca_eval.metrics import glm_winrate

            with _local_hub_file(glm_winrate, path):
                lc = glm_winrate.get_length_controlled_winrate(df, save_weights_dir=None)
        except Exception as exc:  # the GLM fit can fail on degenerate inputs
            info["note"] = f"not computed: alpaca_eval's GLM failed ({type(exc).__name__}: {exc})"
            return out
        out["length_controlled_winrate"] = lc["length_controlled_winrate"]
        out["lc_standard_error"] = lc["lc_standard_error"]
        info["computed"] = True
        info["note"] = f"computed with alpaca_eval's length_controlled_v1 GLM ({path})"
        return out

    fn.info = info
    return fn


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
) -> Tuple[Dict[str, Any], List[Dict[str, Any]], Dict[str, Any]]:
    """``(metrics, annotations, lc_info)`` from ``alpaca_eval.main.evaluate``."""
    import pandas as pd

    from .compat import import_alpaca_eval

    import_alpaca_eval()
    from alpaca_eval import main as ae_main

    metric_fn = make_metric_fn(length_controlled, lc_data)
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
    rows, data_label = load_instructions(data, hub_config, limit)
    refs = attach_references(rows, reference_outputs)
    generator = generator_name or default_generator_name(model if model is not None else "model")

    judge_args = dict(workdir=out_dir or Path.cwd(), rm_mode=rm_mode, rm_batch_size=rm_batch_size,
                      rm_max_length=rm_max_length, trust_remote_code=trust_remote_code)
    loads_a_model = isinstance(judge, str) and judge.startswith("rm:")  # after generation: not both in memory
    judge_obj = None if loads_a_model else make_judge(judge, **judge_args)  # an API judge's credentials, first
    if model_outputs is not None:
        outputs, generation = _given_outputs(rows, model_outputs, generator)
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
        cache_path=cache,
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
    """The model's outputs read from ``model_outputs`` (one per instruction, matched by its text)."""
    by_instr = {r["instruction"]: r for r in read_rows(model_outputs)}
    missing = [r["instruction"] for r in rows if r["instruction"] not in by_instr]
    if missing:
        raise EvalError(f"{model_outputs}: no model output for {len(missing)} instruction(s).")
    outputs = [
        {"instruction": r["instruction"], "output": str(by_instr[r["instruction"]]["output"]),
         "generator": generator, "dataset": r.get("dataset", "")}
        for r in rows
    ]
    return outputs, {"source": str(model_outputs)}


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
        "alpaca_eval_version": version_of("alpaca_eval"),
    }
