"""What a newcomer meets on a fresh machine (issue 25, "First run and everyday use"): a CPU run builds no DeepSpeed
extension (no compiler needed, no two-minute wait); `--validate` catches a metric sink whose package is missing;
`--plan` exits 1 when the estimate does not fit; a LoRA run on a random-init base leaves a loadable merged model;
the tiny online GRPO demo learns."""

import importlib.util
import os

import torch

from helpers import REPO, TINY_HUMANLINE, read_jsonl, run_recipe

LLAMA_8B = REPO / "recipes" / "llama3_8b_humanline_dpo.yaml"
LORA = REPO / "recipes" / "tiny" / "humanline_dpo_lora.yaml"
DIGITS = REPO / "recipes" / "tiny" / "online_grpo_digits.yaml"
ONE_UPDATE = ["train.max_steps=1", "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false"]


def test_a_cpu_run_builds_no_deepspeed_extension_and_needs_no_compiler(tmp_path, monkeypatch):
    """DeepSpeed would JIT-compile its shared-memory all-reduce for CPU ranks (minutes, and g++): with a fresh
    extension cache and no compiler on the PATH, a one-process and a two-process run train and build nothing."""
    extensions, bin_dir = tmp_path / "extensions", tmp_path / "bin"
    bin_dir.mkdir()
    for compiler in ("g++", "c++", "gcc", "cc"):  # a compiler that always fails: a build attempt would show
        (bin_dir / compiler).write_text("#!/bin/sh\necho no compiler here >&2\nexit 1\n")
        (bin_dir / compiler).chmod(0o755)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CXX", str(bin_dir / "g++"))
    for nproc, extra in ((1, []), (2, ["engine.zero_stage=3"])):
        out = tmp_path / f"run{nproc}"
        proc = run_recipe(TINY_HUMANLINE, [*ONE_UPDATE, *extra, f"output_dir={out}"], nproc=nproc)
        assert "built successfully" not in proc.stdout + proc.stderr
        assert len(read_jsonl(out / "metrics.jsonl")) == 1
    assert not extensions.exists() or not any(extensions.rglob("*.so")), list(extensions.rglob("*"))


def test_validate_refuses_a_metric_sink_whose_package_is_missing(monkeypatch, capsys):
    import launchers.run as run

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb")
                        else real(name, *a))
    for key in ("logging.tensorboard", "logging.wandb.enabled"):
        assert run.main([str(TINY_HUMANLINE), "--validate", f"{key}=true"]) == 2
        err = capsys.readouterr().err
        assert f"`{key}: true`" in err and "pip install" in err and f"`{key}=false`" in err
    assert run.main([str(TINY_HUMANLINE), "--validate"]) == 0


def test_plan_exits_1_when_the_estimate_does_not_fit(capsys):
    import launchers.run as run

    assert run.main([str(LLAMA_8B), "--plan"]) == 0
    assert "WARNING" not in capsys.readouterr().out
    assert run.main([str(LLAMA_8B), "--plan", "cluster.gpu_memory_gb=8"]) == 1
    assert "WARNING: the estimate" in capsys.readouterr().out


def test_lora_on_a_random_init_base_leaves_a_loadable_merged_model(tmp_path):
    """The adapter alone names a base that has no weights (random init): `final/merged/` is written even with
    `save_merged: false` and loads with transformers alone (tests/test_lora.py checks it equals the policy)."""
    from transformers import AutoModelForCausalLM

    run_recipe(LORA, [*ONE_UPDATE, "checkpoint.save_final=true", "model.lora.save_merged=false",
                      f"output_dir={tmp_path}"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged")
    assert (tmp_path / "final" / "adapter_config.json").exists()
    ids = torch.arange(1, 9).unsqueeze(0)
    assert torch.isfinite(merged(input_ids=ids).logits).all()


def test_the_online_demo_learns(tmp_path):
    """`online_grpo_digits.yaml` (the README's online demo): the held-out reward of fresh samples rises within
    8 updates (from about -2.2: the random-init model writes long garbage)."""
    run_recipe(DIGITS, ["train.max_steps=8", "eval.every=8", "data.eval.limit=32", "checkpoint.save_final=false",
                        f"output_dir={tmp_path}"])
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 8]
    assert evals[1]["reward"] > evals[0]["reward"] + 0.3, evals
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert sum(r["reward_mean"] for r in rows[-3:]) > sum(r["reward_mean"] for r in rows[:3]) + 0.3
