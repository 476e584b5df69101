"""Agreement of MATH answer checkers with a person's grades: ``python -m eval.math500.agreement``.

Scores every (gold, completion) pair of the human-graded table (``tests/fixtures/eval/math_graded_pairs.jsonl``,
docs/results/math-scorer.md) with

* the pack's scorer (``eval/math500/tasks/utils.py``: the extraction rule and normal form, then math-verify), in this
  environment (which must have the pinned LaTeX parser runtime);
* math-verify alone: ``verify(parse("$" + gold + "$"), parse(completion))``, its defaults, in this environment;
* with ``--minerva-python PY`` (a Python whose environment has lm-eval and ``antlr4-python3-runtime`` 4.11, which
  lm-eval's MATH tasks require): lm-eval's ``minerva_math`` scorer, its installed ``process_docs`` and
  ``process_results`` called on a one-line solution ``$\\boxed{gold}$`` (both of its metrics: ``exact_match``, the
  Minerva answer normalisation with sympy's LaTeX parser, and ``math_verify``), and math-verify alone again under
  that runtime.

Prints, per checker, its agreement with the person on the pairs graded correct or wrong (the ambiguous ones are left
out), its false accepts and false rejects, and per answer form; ``--json PATH`` writes the same numbers and every
verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "tests" / "fixtures" / "eval" / "math_graded_pairs.jsonl"
VERDICTS = ("correct", "wrong", "ambiguous")


def read_table(path: Path = TABLE) -> List[Dict[str, Any]]:
    """The graded pairs: ``id``, ``form``, ``problem``, ``gold``, ``completion``, ``human`` (correct / wrong /
    ambiguous), ``reason``, and ``scorer_disagrees`` where the pack's scorer is known to differ from the person."""
    with open(path, "r", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def math_verify_alone(gold: str, completion: str) -> bool:
    """math-verify with its defaults: the gold as inline math, the completion as it is."""
    from math_verify import parse, verify

    return bool(verify(parse("$" + gold + "$"), parse(completion)))


def pack_scorer() -> Callable[[str, str], bool]:
    """The pack's MATH-500 scorer as ``(gold, completion) -> verdict`` (refuses another parser runtime)."""
    from eval.math500.tasks import utils

    utils.check_parser_runtime()
    return lambda gold, completion: utils.is_correct(completion, {"answer": gold})


def minerva_verdicts(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """lm-eval's minerva_math scorer (and math-verify alone) on every row, in this process: it must run where
    ``antlr4-python3-runtime`` 4.11 is installed (lm-eval's minerva_math utils refuse any other at import)."""
    import datasets
    from lm_eval.tasks.minerva_math import utils as minerva

    docs = minerva.process_docs(datasets.Dataset.from_list(
        [{"problem": r["problem"], "solution": f"$\\boxed{{{r['gold']}}}$"} for r in rows]))
    out = []
    for row, doc in zip(rows, docs):
        metrics = minerva.process_results(doc, [row["completion"]])
        out.append({"id": row["id"], "minerva_exact_match": bool(metrics["exact_match"]),
                    "minerva_math_verify": bool(metrics["math_verify"]),
                    "math_verify_alone": math_verify_alone(row["gold"], row["completion"])})
    return out


def run_minerva(python: str, table: Path) -> Tuple[Dict[int, Dict[str, Any]], Dict[str, Optional[str]]]:
    """`minerva_verdicts` run by ``python`` (another environment), by row id; also that environment's versions."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([python, "-m", "eval.math500.agreement", "--minerva-worker", "--table", str(table)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"error: the minerva_math worker ({python}) failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {v["id"]: v for v in report["verdicts"]}, report["versions"]


def versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    found = {}
    for name in ("math-verify", "latex2sympy2_extended", "antlr4-python3-runtime", "sympy", "lm_eval"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def summarize(rows: List[Dict[str, Any]], verdicts: Dict[str, Dict[int, bool]]) -> Dict[str, Any]:
    """Per checker: agreement with the person on the unambiguous rows, false accepts / rejects (ids), per form."""
    graded = [r for r in rows if r["human"] != "ambiguous"]
    out: Dict[str, Any] = {"n_rows": len(rows), "n_graded": len(graded),
                           "n_ambiguous": len(rows) - len(graded), "checkers": {}}
    for name, by_id in verdicts.items():
        false_accepts = [r["id"] for r in graded if r["human"] == "wrong" and by_id[r["id"]]]
        false_rejects = [r["id"] for r in graded if r["human"] == "correct" and not by_id[r["id"]]]
        per_form: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
        for r in graded:
            per_form[r["form"]][0] += int(by_id[r["id"]] == (r["human"] == "correct"))
            per_form[r["form"]][1] += 1
        agree = len(graded) - len(false_accepts) - len(false_rejects)
        out["checkers"][name] = {"agree": agree, "rate": agree / len(graded) if graded else None,
                                 "false_accepts": false_accepts, "false_rejects": false_rejects,
                                 "per_form": {k: tuple(v) for k, v in sorted(per_form.items())}}
    return out


def markdown(summary: Dict[str, Any]) -> str:
    """The summary as two Markdown tables: per checker, then per answer form."""
    names = list(summary["checkers"])
    lines = [f"{summary['n_graded']} pairs graded correct or wrong ({summary['n_ambiguous']} ambiguous left out).", "",
             "| checker | agrees with the person | false accepts | false rejects |", "|---|---|---|---|"]
    for name in names:
        c = summary["checkers"][name]
        lines.append(f"| {name} | {c['agree']}/{summary['n_graded']} ({100 * c['rate']:.1f}%) | "
                     f"{len(c['false_accepts'])} | {len(c['false_rejects'])} |")
    forms = sorted({f for c in summary["checkers"].values() for f in c["per_form"]})
    lines += ["", "| form | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for form in forms:
        cells = ["{}/{}".format(*summary["checkers"][n]["per_form"][form]) for n in names]
        lines.append(f"| {form} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.math500.agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", type=Path, default=TABLE, help="the graded pairs (JSONL)")
    p.add_argument("--minerva-python", help="a Python with lm-eval and antlr4-python3-runtime 4.11 (lm-eval's "
                                            "minerva_math scorer runs there)")
    p.add_argument("--json", type=Path, help="write the summary and every verdict here")
    p.add_argument("--minerva-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rows = read_table(args.table)
    if args.minerva_worker:
        print(json.dumps({"verdicts": minerva_verdicts(rows), "versions": versions()}))
        return 0
    pack = pack_scorer()
    verdicts = {"hl_math500 (this pack)": {r["id"]: pack(r["gold"], r["completion"]) for r in rows},
                "math-verify alone": {r["id"]: math_verify_alone(r["gold"], r["completion"]) for r in rows}}
    env = {"here": versions()}
    if args.minerva_python:
        other, env["minerva_env"] = run_minerva(args.minerva_python, args.table)
        runtime = env["minerva_env"]["antlr4-python3-runtime"]
        verdicts["lm-eval minerva_math exact_match"] = {i: v["minerva_exact_match"] for i, v in other.items()}
        verdicts["lm-eval minerva_math math_verify"] = {i: v["minerva_math_verify"] for i, v in other.items()}
        verdicts[f"math-verify alone (antlr {runtime})"] = {i: v["math_verify_alone"] for i, v in other.items()}
    summary = summarize(rows, verdicts)
    print(markdown(summary))
    print("\nversions: " + json.dumps(env))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "versions": env, "verdicts": verdicts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
