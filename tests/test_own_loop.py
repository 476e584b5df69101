"""Humanline in your own loop (``examples/``): a plain DeepSpeed loop at ZeRO-3 on two processes and a Megatron-core
loop at tensor parallel 2 give the pack's per-update losses (``launchers/run.py`` on the equivalent recipe) within
1e-5, over 8 updates with k = 2 and clip bounds that bind; no collective runs during their syncs; and the same
loop with its sync moved after the optimizer step (TRL's ``on_step_end`` timing) does not match. Only the public
``hl_core.humanline`` names are imported here and in the examples."""

import json
import re
import shutil

import pytest

from helpers import REPO, TINY_HUMANLINE, read_jsonl, run_recipe, run_torchrun

EXAMPLES = REPO / "examples"
PROBE = REPO / "tests" / "distributed" / "own_loop_probe.py"
PAIRS = REPO / "tests" / "fixtures" / "tiny" / "prefs" / "train.jsonl"  # what the tiny recipes train on
CLIP = (-0.05, 0.05)  # tight enough to bind on well over 5% of tokens once the policy moves
STEPS, K = 8, 2
SYNC_LINE = "        synced = sync.before_optimizer_step(update).synced"
LINE = re.compile(r"^update (\d+)  loss (\S+)  clipped (\S+)  synced (True|False)$", re.M)


def _pack_losses(weights, tmp_path, *overrides):
    out = tmp_path / "pack"
    run_recipe(TINY_HUMANLINE, [f"output_dir={out}", f"model.name_or_path={weights}", "model.random_init=false",
                                "data.shuffle=false", f"train.max_steps={STEPS}", f"humanline.sync_every={K}",
                                f"humanline.log_eps_P={CLIP[0]}", f"humanline.log_eps_R={CLIP[1]}",
                                "humanline.reference=copy", "eval.every=null", "checkpoint.save_every=null",
                                "checkpoint.save_final=false", *overrides], nproc=2)
    return [row["loss"] for row in read_jsonl(out / "metrics.jsonl")]


def _example(path, weights, tmp_path, *args):
    """The example's printed rows and, per rank, what each sync call did."""
    report = tmp_path / f"{path.stem}_sync"
    proc = run_torchrun(PROBE, [report, path, "--model", weights, "--data", PAIRS, "--steps", STEPS, "--sync-every", K,
                                "--clip", *CLIP, *args], nproc=2)
    rows = [(int(n), float(loss), float(clipped), synced == "True") for n, loss, clipped, synced in
            LINE.findall(proc.stdout)]
    assert [r[0] for r in rows] == list(range(STEPS)), proc.stdout[-3000:]
    calls = [json.loads((tmp_path / f"{report.name}.rank{r}.json").read_text()) for r in range(2)]
    return rows, calls


def _sync_after_step(example, tmp_path, step_line):
    """A copy of ``examples/`` whose ``example`` syncs after the optimizer step instead of before."""
    copy = tmp_path / "late_sync"
    shutil.copytree(EXAMPLES, copy, ignore=shutil.ignore_patterns("__pycache__"))
    lines = (copy / example).read_text().splitlines()
    sync = [i for i, line in enumerate(lines) if line.startswith(SYNC_LINE)]
    assert len(sync) == 1 and lines.count(step_line) == 1
    moved = lines.pop(sync[0])
    lines.insert(lines.index(step_line) + 1, moved)
    (copy / example).write_text("\n".join(lines) + "\n")
    return copy / example


def _check(rows, calls, pack):
    assert max(r[2] for r in rows) >= 0.05, rows  # the clip binds: the comparison is not vacuous
    assert [r[3] for r in rows] == [n % K == 0 for n in range(STEPS)]
    assert max(abs(r[1] - p) for r, p in zip(rows, pack)) <= 1e-5, (rows, pack)
    for rank_calls in calls:
        assert [c["synced"] for c in rank_calls] == [n % K == 0 for n in range(STEPS)]
        assert all(c["sync_collectives"] == 0 for c in rank_calls), rank_calls
        assert rank_calls[0]["probe"] > 0  # the counter sees a collective when one runs


@pytest.mark.parametrize("example, step_line, pack_overrides, args", [
    ("deepspeed_dpo.py", "        policy.step()",
     ["engine.zero_stage=3", "engine.zero3_param_persistence_threshold=1000"],
     ["--zero", "3", "--persist-below", "1000"]),
    ("megatron_dpo.py", "        optimizer.step()", ["engine.name=megatron", "parallel.tp=2"], ["--tp", "2"]),
])
def test_example_equals_the_pack_and_only_with_the_sync_before_the_step(weights, tmp_path, example, step_line,
                                                                        pack_overrides, args):
    pack = _pack_losses(weights, tmp_path, *pack_overrides)
    rows, calls = _example(EXAMPLES / example, weights, tmp_path, *args)
    print(f"{example}: max clipped fraction {max(r[2] for r in rows):.3f}, max |loss - pack| "
          f"{max(abs(r[1] - p) for r, p in zip(rows, pack)):.2e}")
    _check(rows, calls, pack)
    late, _ = _example(_sync_after_step(example, tmp_path, step_line), weights, tmp_path, *args)
    assert max(abs(r[1] - p) for r, p in zip(late, pack)) > 1e-4, "a sync after the step must not match"


def test_the_docs_page_shows_lines_of_the_scripts_that_run():
    """Every line of every Python snippet on "humanline in your own loop" is a line of a script the tests run."""
    page = (REPO / "docs" / "howto" / "own-loop.md").read_text()
    sources = [*EXAMPLES.glob("*.py"), REPO / "tests" / "distributed" / "api_sync.py"]
    lines = {line.strip() for path in sources for line in path.read_text().splitlines()}
    snippets = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(snippets) >= 4
    for snippet in snippets:
        for line in filter(str.strip, snippet.splitlines()):
            assert line.strip() in lines, line


def test_the_plain_torch_snippets_pasted_in_order_are_the_script_in_its_order():
    """The plain PyTorch section's snippets of ``examples/torch_dpo.py`` (the others: ``load_model`` from
    ``examples/_launch.py``, the DDP/FSDP2 lines of ``api_sync.py``) are lines of it in the script's own order,
    indentation included: the resumable loop, pasted in order."""
    page = (REPO / "docs" / "howto" / "own-loop.md").read_text()
    section = page.split("## A plain PyTorch loop")[1].split("\n## ")[0]
    snippets = re.findall(r"```python\n(.*?)```", section, re.S)
    script = (EXAMPLES / "torch_dpo.py").read_text().splitlines()
    own = [snippet for snippet in snippets if all(line in script for line in filter(str.strip, snippet.splitlines()))]
    assert len(own) >= 6 and len(snippets) - len(own) == 2
    at = 0
    for line in filter(str.strip, "".join(own).splitlines()):
        assert line in script[at:], f"not in examples/torch_dpo.py after line {at}: {line}"
        at = script.index(line, at) + 1
    for needed in ("sync.attach(optimizer)", 'sync.load_state_dict(state["sync"])', '"sync": sync.state_dict()',
                   "prefix_token_logps(", "mask_from_labels(labels)", "load_checkpoint_file(saved)",
                   'transform.load_state_dict(state["transform"])', "def load_model("):
        assert needed in section


def test_the_page_defines_or_imports_what_it_calls_and_fits_the_page():
    """Every function the page's Python calls is imported or defined on the page (or assigned there, or a builtin;
    ``hl_core.data`` and ``hl_core.humanline`` are on API pages), and no code line is longer than 100 characters."""
    import builtins

    page = (REPO / "docs" / "howto" / "own-loop.md").read_text()
    code = "".join(re.findall(r"```python\n(.*?)```", page, re.S))
    assert max(len(line) for line in code.splitlines()) <= 100
    known = set(dir(builtins))
    known |= set(re.findall(r"^\s*def (\w+)\(", code, re.M))
    known |= set(re.findall(r"^\s*(?:import|from \S+ import) (\w+)", code, re.M))
    known |= set(re.findall(r"^\s+(\w+),$", code, re.M))  # the names of a parenthesised import
    known |= set(re.findall(r"import [\w.]+ as (\w+)", code))
    known |= {n.strip() for line in re.findall(r"^from \S+ import ([\w, ]+)$", code, re.M) for n in line.split(",")}
    known |= {n.strip() for line in re.findall(r"^\s*([\w, ]+?) = ", code, re.M) for n in line.split(",")}
    called = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)\(", code))
    assert called - known == set(), sorted(called - known)
    for module in ("hl_core.data", "hl_core.humanline"):
        imported = re.findall(rf"^from {re.escape(module)} import \(?([^)]*?)\)?$", code, re.M | re.S)
        assert imported, module
    api = (REPO / "docs" / "reference" / "api.md").read_text()
    for name in ("collate_preference", "load_preference_records", "tokenize_preference"):
        assert f"::: hl_core.data.{name}" in api
