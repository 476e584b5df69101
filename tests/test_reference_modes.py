"""The reference without a second copy of the weights (``hl_core.config.reference_mode``): look-ahead syncing and a
cached frozen reference give the same per-update losses, grad norms, metrics and evaluations as a reference
copy, within 1e-6 (fp32, CPU), on the real engines: one process, two ZeRO-3 processes, megatron tp=2 and pp=2
(``tests/distributed/reference_parity.py``). The choice and its refusals; the cache on disk (fingerprint,
corrupted and partial files). Resume inside a look-ahead window: ``tests/test_resume.py``."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, TINY_HUMANLINE, TINY_OFFLINE, assert_same_rows, read_jsonl, run_recipe, run_worker
from hl_core.config import load_recipe, reference_cache_fields, reference_mode
from launchers.run import main

WORKER = REPO / "tests" / "distributed" / "reference_parity.py"
TINY = "recipes/tiny"
FROZEN = "humanline.sync_every=null"  # the humanline clamp stays on


def _parity(tmp_path, specs, nproc=1):
    report = tmp_path / "parity.json"
    run_worker(WORKER, [report, *specs], nproc=nproc)
    results = json.loads(report.read_text())
    assert list(results) == list(specs)
    for spec, entry in results.items():
        _assert_same(spec, entry)
    return results


def _assert_same(spec, entry):
    copy, free = entry["copy"], entry["free"]
    assert entry["copy_built"] and entry["copy_mode"] == "copy", spec
    assert not entry["free_built"] and entry["free_mode"] in ("lookahead", "cached"), spec
    assert entry["free_forwards"] > 0 and entry["copy_forwards"] == 0, spec  # the policy stood in for the reference
    assert [r.get("kind") for r in copy].count("eval") == 4, spec  # evaluations at 0, 2, 4, 5
    assert len(copy) == len(free) == 9, spec
    assert_same_rows(copy, free, spec, tol=1e-6)
    losses = [r["loss"] for r in copy if r.get("kind") != "eval"]
    assert max(losses) - min(losses) > 1e-4, spec  # the runs train: not a vacuous comparison


def test_copy_free_equals_copy_one_process(tmp_path):
    specs = [f"{TINY}/humanline_{objective}.yaml|humanline.sync_every={k}" for objective in ("dpo", "kto", "grpo")
             for k in (1, 3)]
    specs += [f"{TINY}/humanline_{objective}.yaml|{FROZEN}" for objective in ("dpo", "kto", "grpo")]
    specs += [f"{TINY}/humanline_dpo_lora.yaml|humanline.sync_every=3"]  # LoRA: the adapter copy vs look-ahead
    specs += [f"{TINY}/humanline_dpo.yaml|engine.zero_stage=2,humanline.sync_every=3",  # ZeRO-1/2: optimizer shards
              f"{TINY}/humanline_kto.yaml|engine.zero_stage=1,{FROZEN}",
              f"{TINY}/humanline_dpo.yaml|humanline.sync_every=3,humanline.sync_offset=2"]  # update 0 is no sync
    results = _parity(tmp_path, specs)
    k3 = results[f"{TINY}/humanline_dpo.yaml|humanline.sync_every=3"]
    assert [r["synced"] for r in k3["free"] if r.get("kind") != "eval"] == [True, False, False, True, False]


# every objective x copy-free mode runs on at least one multi-process layout (three specs per layout)
KTO = "objective=kto,train.micro_batch_size=16"
GRPO = "objective=grpo,data.train.path=tests/fixtures/tiny/groups/train.jsonl,train.micro_batch_size=2," \
       "data.eval.path=tests/fixtures/tiny/groups/eval.jsonl"
MULTI = {
    "zero3": ("humanline_dpo.yaml", ["engine.zero_stage=3,humanline.sync_every=3",
                                     f"engine.zero_stage=3,{KTO},humanline.sync_every=1",
                                     f"engine.zero_stage=3,{GRPO},{FROZEN}"]),
    "megatron_tp2": ("megatron_humanline_dpo.yaml", ["humanline.sync_every=3", f"{GRPO},humanline.sync_every=1",
                                                     f"{KTO},{FROZEN}"]),
    # dropout on: update 0's reference is an eval-mode forward, not the policy's own log-probs
    "megatron_pp2": ("megatron_tp1_pp2_humanline_dpo.yaml", [
        FROZEN, f"{KTO},humanline.sync_every=1",
        "humanline.sync_every=3,model.config_overrides={attention_dropout: 0.3}"]),
}


def _specs(layout):
    recipe, overrides = MULTI[layout]
    return [f"{TINY}/{recipe}|{o}" for o in overrides]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Every layout's specs in one pair of processes (each spec a fresh Trainer, the megatron engine's parallel
    state torn down at its close): one start-up of torchrun and the engines' imports instead of one per layout."""
    report = tmp_path_factory.mktemp("parity2") / "parity.json"
    run_worker(WORKER, [report, *(spec for layout in MULTI for spec in _specs(layout))], nproc=2)
    return json.loads(report.read_text())


@pytest.mark.parametrize("layout", list(MULTI))
def test_copy_free_equals_copy_two_processes(two_processes, layout):
    for spec in _specs(layout):
        _assert_same(spec, two_processes[spec])


# ------------------------------------------------------------------------------------------ the choice
@pytest.mark.parametrize("recipe, overrides, mode", [
    ("humanline_dpo.yaml", [], "lookahead"),
    ("humanline_dpo.yaml", ["humanline.reference=copy"], "copy"),
    ("humanline_dpo.yaml", ["train.on_nonfinite=skip"], "copy"),
    ("humanline_sparse_grpo_math.yaml", [], "copy"),  # rollouts
    ("offline_dpo.yaml", [], "copy"),
    ("offline_dpo.yaml", ["train.cache_reference_logps=true"], "cached"),
])
def test_reference_mode_choice(recipe, overrides, mode):
    assert reference_mode(load_recipe(REPO / TINY / recipe, overrides))[0] == mode


@pytest.mark.parametrize("recipe, overrides, needle", [
    ("humanline_dpo.yaml", ["train.cache_reference_logps=true"], "moves the reference"),
    ("online_grpo_math.yaml", ["train.cache_reference_logps=true", "objective.beta_kl=0.01"], "rollouts"),
    ("online_grpo_math.yaml", ["train.cache_reference_logps=true", "objective.beta_kl=0"], "nothing in this run reads"),
    ("humanline_sparse_grpo_math.yaml", ["humanline.reference=lookahead"], "not known at the sync"),
    ("humanline_dpo.yaml", ["humanline.reference=lookahead", "train.on_nonfinite=skip"], "on_nonfinite: skip"),
    ("offline_dpo.yaml", ["humanline.reference=lookahead"], "syncing is off"),
])
def test_refusals_name_the_key(capsys, recipe, overrides, needle):
    assert main([str(REPO / TINY / recipe), "--validate", *overrides]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------ the cache on disk
def test_cache_is_fingerprinted_checked_and_rebuilt(tmp_path):
    """A rerun reads the cache; a torn part is computed again (the intact one still read); a changed
    fingerprint recomputes all and names what changed. Parts hold 32 updates: 34 updates make two."""
    data = tmp_path / "train.jsonl"
    data.write_text((REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text())
    out = tmp_path / "run"
    common = [f"output_dir={out}", "train.max_steps=34", "eval.every=null", "checkpoint.save_every=null",
              "checkpoint.save_final=false", "logging.progress_bar=false", "checkpoint.resume=never",
              "train.cache_reference_logps=true", f"data.train.path={data}", "train.micro_batch_size=2"]
    cache = out / "reference_cache" / "rank00000"

    first = run_recipe(TINY_OFFLINE, common)
    assert "reference log-probs: cached" in first.stdout
    manifest = json.loads((cache / "manifest.json").read_text())
    assert list(manifest["parts"]) == ["updates-000000-000031", "updates-000032-000033"]
    intact, torn = (cache / f"{name}.pt" for name in manifest["parts"])
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    stamps = intact.stat().st_mtime_ns, torn.stat().st_mtime_ns

    torn.write_bytes(torn.read_bytes()[:100])  # a torn file (a kill mid-write): its checksum no longer matches
    second = run_recipe(TINY_OFFLINE, common)
    assert f"reference cache part {torn} is missing or corrupted: computing it again" in second.stdout
    assert intact.stat().st_mtime_ns == stamps[0] and torn.stat().st_mtime_ns != stamps[1]  # read / rebuilt
    assert "recomputing" not in second.stdout
    assert [r["loss"] for r in read_jsonl(out / "metrics.jsonl")] == losses

    third = run_recipe(TINY_OFFLINE, [*common, "data.max_length=48"])
    assert "data.max_length changed): recomputing it" in third.stdout


def test_cache_fingerprint_names_a_changed_data_file(tmp_path):
    from hl_core.reference.cache import changed_fields, fingerprint

    def fields(*overrides, world=1, dp=1):
        recipe = load_recipe(TINY_OFFLINE, [f"data.train.path={data}", *overrides])
        return fingerprint(reference_cache_fields(recipe), world, dp, 1)

    data = tmp_path / "train.jsonl"
    data.write_text((REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text())
    before = fields()
    rows = data.read_text().splitlines()
    row = json.loads(rows[0])
    row["chosen"][-1]["content"] += " indeed"  # one completion changes
    data.write_text("\n".join([json.dumps(row), *rows[1:]]) + "\n")
    after = fields()
    assert changed_fields(before, after) == ["data.train file train.jsonl"]
    assert changed_fields(after, fields(world=2, dp=2)) == ["data-parallel size", "world size"]
    assert changed_fields(before, fields("data.max_length=48")) == ["data.max_length", "data.train file train.jsonl"]


def test_resume_across_reference_modes(tmp_path):
    """A checkpoint written with a reference copy resumes under look-ahead (and the reverse: the run guard's
    advice to resume with `train.on_nonfinite=skip` turns a look-ahead run into a copy one,
    `tests/test_run_guard.py`): the new mode's reference starts from the policy at the resume, said in one line."""
    out = tmp_path / "run"
    common = [f"output_dir={out}", "train.max_steps=4", "eval.every=null", "checkpoint.save_every=2",
              "checkpoint.save_final=false", "logging.progress_bar=false", "humanline.sync_every=3"]
    run_recipe(TINY_HUMANLINE, [*common, "humanline.reference=copy", "train.stop_after=2"])
    resumed = run_recipe(TINY_HUMANLINE, common)  # auto: look-ahead
    assert "keeps a reference copy, not look-ahead log-probs" in resumed.stdout
    assert "Resumed from" in resumed.stdout
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
