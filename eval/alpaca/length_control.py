"""AlpacaEval's length-controlled win rate, and every reason it cannot be computed as a sentence.

alpaca_eval's GLM (``alpaca_eval.metrics.glm_winrate``, ``length_controlled_v1``) reads each annotation's
instruction difficulty from the ``df_gamed.csv`` table by the annotation's row position: row i must be the table's
instruction i. So the rate is only computed when the annotations are one model against one baseline, with an output
and a preference for every instruction of the set the table covers, each once, in the set's order. `lc_blockers` checks
exactly that and returns one sentence per cause; `make_metric_fn` puts the sentences in ``alpaca_eval.json``
(``length_controlled_reasons``, ``length_controlled_note``) and in the log, and computes the rate when there are none.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._common import EvalError, is_offline

log = logging.getLogger(__name__)

HUB_REPO = "tatsu-lab/alpaca_eval"
LC_FILE = "df_gamed.csv"
LC_MODES = ("auto", "off")
SHOWN = 3  # instructions named in one sentence


@dataclass(frozen=True)
class InstructionSet:
    """What the annotations should cover: ``instructions`` the whole set, in its order (the data before any limit);
    ``label`` its source; ``limit`` the run's limit (the run evaluates the first ``limit``), if any."""

    instructions: Tuple[str, ...]
    label: str = "the instruction set"
    limit: Optional[int] = None


@dataclass(frozen=True)
class GlmTable:
    """The GLM's difficulty table: ``path``, how many instructions it covers (by position) and, when it names them
    (an ``instruction`` column), which."""

    path: str
    n: int
    instructions: Optional[Tuple[str, ...]] = None


def _quote(text: str, width: int = 60) -> str:
    text = " ".join(str(text).split())
    return f"`{text[:width]}{'...' if len(text) > width else ''}`"


def _named(positions: Sequence[int], texts: Sequence[str]) -> str:
    """``#3 `What is ...`, #7 `...` and 2 more`` (1-based positions)."""
    shown = ", ".join(f"#{p + 1} {_quote(t)}" for p, t in list(zip(positions, texts))[:SHOWN])
    return shown + (f" and {len(texts) - SHOWN} more" if len(texts) > SHOWN else "")


def _models_sentences(df) -> List[str]:
    out = []
    for column, who in (("generator_2", "models"), ("generator_1", "baselines")):
        if column in df.columns and df[column].nunique(dropna=False) > 1:
            names = ", ".join(f"`{n}`" for n in sorted(map(str, df[column].unique())))
            out.append(f"The annotation table holds the outputs of {df[column].nunique(dropna=False)} {who} ({names}); "
                       f"the length-control GLM fits one model against one baseline, so judge each model in a run of "
                       f"its own.")
    return out


def _table_sentences(full: InstructionSet, table: GlmTable) -> List[str]:
    if table.instructions is not None and tuple(table.instructions) != tuple(full.instructions):
        differ = next((i for i, (a, b) in enumerate(zip(table.instructions, full.instructions)) if a != b),
                      min(len(table.instructions), len(full.instructions)))
        return [f"The GLM table {table.path} names {len(table.instructions)} instructions and {full.label} has "
                f"{len(full.instructions)} that differ from them from position #{differ + 1} on; the rate needs the "
                f"instruction set the table was fitted on, in its order."]
    if table.n != len(full.instructions):
        return [f"The GLM table {table.path} covers {table.n} instructions (by position) and {full.label} has "
                f"{len(full.instructions)}; the rate needs the full instruction set the table was fitted on "
                f"(AlpacaEval's 805), in its order."]
    return []


def _coverage_sentences(df, full: InstructionSet) -> List[str]:
    """Which instructions the annotations hold against the ones this run evaluates: subset, missing, extra,
    repeated, reordered."""
    wanted = list(full.instructions[: full.limit] if full.limit is not None else full.instructions)
    out = []
    if len(wanted) < len(full.instructions):
        out.append(f"This run evaluates the first {len(wanted)} of the {len(full.instructions)} instructions of "
                   f"{full.label} (`limit={full.limit}`); the rate needs all of them.")
    given = [str(t) for t in df["instruction"]]
    present, counts, index = set(given), Counter(given), {t: i for i, t in enumerate(full.instructions)}
    missing = [(i, t) for i, t in enumerate(wanted) if t not in present]
    if missing:
        out.append(f"{len(missing)} instruction(s) have no model output in the annotations: "
                   f"{_named(*zip(*missing))}; the GLM reads each instruction's difficulty by its position, so "
                   f"every instruction needs an output.")
    extra = [t for t in dict.fromkeys(given) if t not in index]
    if extra:
        out.append(f"{len(extra)} annotated instruction(s) are not in {full.label}: "
                   f"{', '.join(_quote(t) for t in extra[:SHOWN])}{' and more' if len(extra) > SHOWN else ''}.")
    repeated = [t for t, c in counts.items() if c > 1]
    if repeated:
        out.append(f"{len(repeated)} instruction(s) are annotated more than once, e.g. {_quote(repeated[0])} "
                   f"({counts[repeated[0]]} times); the GLM needs each instruction once.")
    if not (missing or extra or repeated):
        order = [index[t] for t in given]
        if order != sorted(order):
            at = next(i for i in range(1, len(order)) if order[i] < order[i - 1])
            out.append(f"The annotations list the instructions in another order than {full.label} (row #{at + 1} is "
                       f"its instruction #{order[at] + 1}, {_quote(given[at])}); the GLM reads an instruction's "
                       f"difficulty by its row, so the order must be the set's.")
    return out


def _value_sentences(df) -> List[str]:
    out = []
    for column, what in (("output_2", "model output"), ("preference", "preference from the judge")):
        if column not in df.columns:
            out.append(f"The annotation table has no `{column}` column.")
            continue
        empty = [i for i, v in enumerate(df[column]) if v is None or v != v or (column == "output_2"
                                                                                and not isinstance(v, str))]
        if empty:
            texts = [df["instruction"].iloc[i] if "instruction" in df.columns else "" for i in empty]
            out.append(f"{len(empty)} annotation row(s) have no {what}: {_named(empty, texts)}; the rate needs one "
                       f"for every instruction.")
    return out


def lc_blockers(df, full: Optional[InstructionSet], table: GlmTable) -> List[str]:
    """Every reason the length-controlled win rate cannot be computed from the annotations ``df``, one sentence each
    (empty: it can). ``full``: the instruction set the run evaluates (None: the annotations' own instructions)."""
    out = _models_sentences(df)
    if "instruction" not in df.columns:
        return out + ["The annotation table has no `instruction` column, so which instructions it covers, and in "
                      "which order, cannot be checked."]
    full = full or InstructionSet(tuple(str(t) for t in df["instruction"]), "the annotated instructions")
    return out + _table_sentences(full, table) + _coverage_sentences(df, full) + _value_sentences(df)


def read_glm_table(lc_data: Optional[str]) -> Tuple[Optional[GlmTable], Optional[str]]:
    """``(table, None)``, or ``(None, sentence)`` saying why it is not available."""
    import pandas as pd

    path = lc_data
    if lc_data is not None and not os.path.isfile(lc_data):
        return None, f"The GLM table given as lc_data, {lc_data}, does not exist."
    if lc_data is None:
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(repo_id=HUB_REPO, filename=LC_FILE, repo_type="dataset",
                                   local_files_only=is_offline())
        except Exception as exc:
            return None, (f"The length-control GLM's table ({HUB_REPO}/{LC_FILE}) is not available here "
                          f"({type(exc).__name__}); offline runs need a cached copy or lc_data=PATH.")
    try:
        frame = pd.read_csv(path)
        first = frame.drop_duplicates("index").sort_values("index")
        names = tuple(str(t) for t in first["instruction"]) if "instruction" in frame.columns else None
        return GlmTable(str(path), int(frame["index"].nunique()), names), None
    except Exception as exc:
        return None, f"The GLM table {path} cannot be read ({type(exc).__name__}: {exc})."


@contextlib.contextmanager
def _local_hub_file(module, path: str):
    """Make ``module.hf_hub_download`` return ``path`` (alpaca_eval's GLM reads df_gamed.csv through it)."""
    saved = module.hf_hub_download
    module.hf_hub_download = lambda *a, **k: path
    try:
        yield
    finally:
        module.hf_hub_download = saved


def _glm(df, path: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    from alpaca_eval.metrics import glm_winrate

    try:
        with _local_hub_file(glm_winrate, path):
            return glm_winrate.get_length_controlled_winrate(df, save_weights_dir=None), None
    except Exception as exc:  # the fit itself can fail on degenerate inputs (e.g. one preference value throughout)
        return None, (f"alpaca_eval's length-control GLM failed on these annotations ({type(exc).__name__}: "
                      f"{str(exc) or 'no message'}).")


def make_metric_fn(length_controlled: str = "auto", lc_data: Optional[str] = None,
                   instructions: Optional[InstructionSet] = None):
    """``fn(annotations) -> metrics`` for ``alpaca_eval.main.evaluate(fn_metric=...)``: the win rate always, the
    length-controlled win rate when `lc_blockers` finds nothing. ``fn.info``: ``computed``, ``reasons`` (the
    sentences), ``note``. ``instructions``: the set the run evaluates (None: the annotations' own)."""
    import pandas as pd
    from alpaca_eval import metrics as ae_metrics

    if length_controlled not in LC_MODES:
        raise EvalError(f"length_controlled `{length_controlled}` is not known; use one of {', '.join(LC_MODES)}.")
    info: Dict[str, Any] = {"computed": False, "reasons": [], "note": ""}

    def fn(annotations) -> Dict[str, Any]:
        df = annotations if isinstance(annotations, pd.DataFrame) else pd.DataFrame(list(annotations))
        df = df.reset_index(drop=True)
        out = dict(ae_metrics.get_winrate(df), length_controlled_winrate=None, lc_standard_error=None)
        reasons, lc = _lc_reasons(df, length_controlled, lc_data, instructions)
        if lc is not None:
            out.update(length_controlled_winrate=lc["length_controlled_winrate"],
                       lc_standard_error=lc["lc_standard_error"])
        info.update(computed=lc is not None, reasons=reasons, note=" ".join(reasons) if reasons else
                    f"computed with alpaca_eval's length_controlled_v1 GLM ({lc and lc.get('table')})")
        for sentence in reasons:
            log.warning("AlpacaEval: no length-controlled win rate: %s", sentence)
        return out

    fn.info = info
    return fn


def _lc_reasons(df, mode: str, lc_data: Optional[str], instructions: Optional[InstructionSet]):
    """``(reasons, glm result or None)``."""
    if mode == "off":
        return ["The length-controlled win rate was switched off (length_controlled=off)."], None
    table, missing = read_glm_table(lc_data)
    if table is None:
        return [missing], None
    reasons = lc_blockers(df, instructions, table)
    if reasons:
        return reasons, None
    lc, failed = _glm(df, table.path)
    return ([failed], None) if failed else ([], dict(lc, table=table.path))
