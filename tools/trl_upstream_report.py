"""Compare two runs of TRL's trainer tests (``tests/trl_upstream``): TRL's own trainers (the control) and ours.

Each run writes a JSON summary (``HL_TRL_UPSTREAM_REPORT``; one per pytest process, several may be given per side).
This prints, as Markdown: the counts of each run; of the tests that pass with TRL's trainers, how many pass with
ours, end in our refusal or fail, with the failures grouped by cause (the error's first line) and the refusals by
their reason; and the tests that fail with TRL's own trainers too (left out of the comparison).
``--json PATH`` writes the same as one JSON file.

``--ci-list PATH --budget S`` writes the CI subset (``tests/trl_upstream/ci_subset.txt``): of the tests that pass
with TRL's trainers, the fastest (by our run's durations) of each test function and outcome with ours (so a function
whose parameters pass, refuse or crash differently appears once for each), with what it gives with ours; a crash
whose error does not start with a builtin exception's name cannot be a strict xfail and is left out (named).
Fastest first until the budget of summed test durations is spent.

Usage: ``python3 tools/trl_upstream_report.py --control trl-*.json --ours humanline-*.json [--json out.json]
[--ci-list tests/trl_upstream/ci_subset.txt --budget 300]``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List


def load(paths: List[Path]) -> Dict[str, dict]:
    """Test id -> its row, over every summary given (later files win on a repeated id)."""
    tests: Dict[str, dict] = {}
    for path in paths:
        tests.update(json.loads(path.read_text())["tests"])
    return tests


def compare(control: Dict[str, dict], ours: Dict[str, dict]) -> dict:
    """The comparison as plain data (what ``--json`` writes and the Markdown shows)."""
    baseline = sorted(t for t, row in control.items() if row["outcome"] == "passed")
    outcome = {t: ours.get(t, {"outcome": "not run", "cause": ""}) for t in baseline}
    by_file = defaultdict(Counter)
    for test, row in outcome.items():
        by_file[test.split("::", 1)[0]][row["outcome"]] += 1
    causes: Dict[str, Dict[str, List[str]]] = {"failed": defaultdict(list), "refusal": defaultdict(list)}
    for test, row in outcome.items():
        if row["outcome"] in causes:
            causes[row["outcome"]][row["cause"]].append(test)
    return {
        "control_counts": dict(Counter(r["outcome"] for r in control.values())),
        "ours_counts": dict(Counter(r["outcome"] for r in ours.values())),
        "baseline": len(baseline),
        "ours_on_baseline": dict(Counter(r["outcome"] for r in outcome.values())),
        "by_file": {f: dict(c) for f, c in sorted(by_file.items())},
        "failed": {k: sorted(v) for k, v in sorted(causes["failed"].items(), key=lambda kv: -len(kv[1]))},
        "refusal": {k: sorted(v) for k, v in sorted(causes["refusal"].items(), key=lambda kv: -len(kv[1]))},
        "control_failed": {t: r["cause"] for t, r in sorted(control.items()) if r["outcome"] == "failed"},
        "messages": {row["cause"]: row["message"] for row in ours.values() if row.get("message")},
    }


def markdown(data: dict) -> List[str]:
    """The comparison as Markdown lines."""
    fmt = lambda counts: ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))  # noqa: E731
    lines = [f"- TRL's trainers: {fmt(data['control_counts'])}", f"- ours: {fmt(data['ours_counts'])}",
             f"- of the {data['baseline']} that pass with TRL's trainers, with ours: {fmt(data['ours_on_baseline'])}",
             "", "| file | " + " | ".join(("passed", "refusal", "failed")) + " |", "| --- | --- | --- | --- |"]
    for name, counts in data["by_file"].items():
        lines.append(f"| {name} | " + " | ".join(str(counts.get(k, 0)) for k in ("passed", "refusal", "failed")) + " |")
    for kind in ("failed", "refusal"):
        lines += ["", f"| {kind}: cause (first line) | tests |", "| --- | --- |"]
        lines += [f"| `{cause}` | {len(tests)} |" for cause, tests in data[kind].items()]
    lines += ["", "Each refusal, as the adapter states it (tests: how many of those passing with TRL's trainers):", ""]
    for cause, tests in data["refusal"].items():
        lines.append(f"- ({len(tests)} tests, e.g. `{tests[0]}`) {data['messages'].get(cause, cause)}")
    if data["control_failed"]:
        lines += ["", "Failing with TRL's own trainers too (left out):", ""]
        lines += [f"- `{test}`: `{cause}`" for test, cause in data["control_failed"].items()]
    return lines


def ci_subset(control: Dict[str, dict], ours: Dict[str, dict], budget: float) -> tuple:
    """(lines of the CI list, tests left out with the reason): one test per (function, outcome, cause)."""
    import builtins

    groups: Dict[tuple, List[str]] = defaultdict(list)
    left_out = {}
    for test, row in control.items():
        mine = ours.get(test)
        if row["outcome"] != "passed" or mine is None or mine["outcome"] not in ("passed", "refusal", "failed"):
            continue
        name = mine["cause"].split(":", 1)[0]
        if mine["outcome"] == "failed" and not isinstance(getattr(builtins, name, None), type):
            left_out[test] = f"its crash ({mine['cause']}) is no builtin exception: no strict xfail"
            continue
        groups[(test.split("[", 1)[0], mine["outcome"], mine["cause"])].append(test)
    picks = sorted((min(tests, key=lambda t: ours[t]["duration"]) for tests in groups.values()),
                   key=lambda t: ours[t]["duration"])
    lines, spent = [], 0.0
    for test in picks:
        if spent + ours[test]["duration"] > budget:
            left_out[test] = "over the time budget"
            continue
        spent += ours[test]["duration"]
        mine = ours[test]
        expect = {"passed": "pass", "refusal": "refusal", "failed": "xfail"}[mine["outcome"]]
        lines.append(f"{expect} {test}" + (f" {mine['cause']}" if expect == "xfail" else ""))
    return sorted(lines, key=lambda line: line.split()[1]), left_out, spent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", nargs="+", type=Path, required=True, help="summaries of TRL's trainers' run")
    parser.add_argument("--ours", nargs="+", type=Path, required=True, help="summaries of our trainers' run")
    parser.add_argument("--json", type=Path, help="write the comparison here as JSON too")
    parser.add_argument("--ci-list", type=Path, help="write the CI subset here (its header kept)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds of summed test durations for --ci-list")
    args = parser.parse_args(argv)
    data = compare(load(args.control), load(args.ours))
    print("\n".join(markdown(data)))
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    if args.ci_list:
        lines, left_out, spent = ci_subset(load(args.control), load(args.ours), args.budget)
        header = [line for line in args.ci_list.read_text().splitlines() if line.startswith("#")] \
            if args.ci_list.exists() else []
        args.ci_list.write_text("\n".join(header + lines) + "\n")
        print(f"\nCI subset: {len(lines)} tests, {spent:.0f} s of test durations; left out: {len(left_out)}")
        for test, why in sorted(left_out.items()):
            print(f"- `{test}`: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
