"""Run every tiny recipe and compare two such runs' ``metrics.jsonl``, timing fields aside.

A restructure must not change what a run computes. Run this on a checkout from before the change and on one from
after it, then compare:

    python3 tools/tiny_metrics.py run /tmp/before        # in the checkout before the change
    python3 tools/tiny_metrics.py run /tmp/after         # in the checkout after it
    python3 tools/tiny_metrics.py compare /tmp/before /tmp/after

``run`` writes ``DIR/<recipe>/metrics.jsonl`` (and the run's log as ``DIR/<recipe>.log``) for each recipe under
``recipes/tiny/`` (the ``megatron_*`` ones on two processes under torchrun), or for the recipe names given after the
directory. ``compare`` exits 0 when every recipe's rows are equal once the timing fields are dropped, 1 otherwise,
naming the first differing row and key.
"""

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
# wall-clock measurements: they differ run to run and are no part of what a run computes
TIMING_SUFFIXES = ("_time_s", "tokens_per_s", "_s_per_update")


def tiny_recipes() -> list:
    """The runnable tiny recipes (``_``-prefixed files are shared defaults)."""
    return sorted(p.stem for p in (REPO / "recipes" / "tiny").glob("*.yaml") if not p.name.startswith("_"))


def _command(name: str, out: pathlib.Path) -> list:
    script = [str(REPO / "launchers" / "run.py"), str(REPO / "recipes" / "tiny" / f"{name}.yaml"),
              f"output_dir={out}", "checkpoint.save_every=null", "checkpoint.save_final=false",
              "logging.progress_bar=false"]
    if name.startswith("megatron"):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *script]
    return [sys.executable, *script]


def run_all(directory: pathlib.Path, names: list) -> int:
    """Run each recipe into ``directory/<name>``; returns how many runs failed."""
    directory.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    failed = 0
    for name in names:
        with open(directory / f"{name}.log", "w") as log:
            proc = subprocess.Popen(_command(name, directory / name), cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=1800)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code = -9
        print(f"{name}: exit {code}", flush=True)
        failed += code != 0
    return failed


def without_timing(row: dict) -> dict:
    """The row less its wall-clock fields."""
    return {k: v for k, v in row.items() if not k.endswith(TIMING_SUFFIXES)}


def _rows(path: pathlib.Path) -> list:
    return [without_timing(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    """Print one line per recipe; returns how many differ (or are missing on either side)."""
    bad = 0
    for metrics in sorted(before.glob("*/metrics.jsonl")):
        name = metrics.parent.name
        other = after / name / "metrics.jsonl"
        if not other.exists():
            print(f"{name}: missing in {after}")
            bad += 1
            continue
        a, b = _rows(metrics), _rows(other)
        diff = next(((i, k) for i, (x, y) in enumerate(zip(a, b)) for k in sorted(set(x) | set(y))
                     if x.get(k) != y.get(k)), None)
        if len(a) != len(b) or diff:
            where = f"row {diff[0]} key {diff[1]!r}" if diff else f"{len(a)} rows vs {len(b)}"
            print(f"{name}: DIFFERS ({where})")
            bad += 1
        else:
            print(f"{name}: equal ({len(a)} rows, {len(a[0]) if a else 0} keys each)")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the tiny recipes into DIR")
    run.add_argument("dir", type=pathlib.Path)
    run.add_argument("names", nargs="*", help="recipe names (default: every tiny recipe)")
    cmp = sub.add_parser("compare", help="compare two run directories, timing fields aside")
    cmp.add_argument("before", type=pathlib.Path)
    cmp.add_argument("after", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        return 1 if run_all(args.dir, args.names or tiny_recipes()) else 0
    return 1 if compare(args.before, args.after) else 0


if __name__ == "__main__":
    sys.exit(main())
