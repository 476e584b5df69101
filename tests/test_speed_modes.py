"""The speed switches against the modes they replace, through the real trainer and DeepSpeed engine on the CPU in
fp32 (`tests/distributed/mode_parity.py`: three updates in each mode from the same start): the same per-update
losses, gradient norms and every other metric.

* `train.fused_logprobs` (log-probs from the hidden states): within 1e-5, for DPO (packed, tied embeddings), KTO,
  GRPO on rollouts (log-probs at the sampling temperature) and LoRA DPO in one process, and DPO under ZeRO-3 on two
  processes (the output layer's weight partitioned, gathered by its module hooks for the forward and the backward).
* `train.compile` (each decoder layer compiled): DPO, KTO and GRPO on rollouts through the captured graphs
  (`train.compile_backend=aot_eager`) within 1e-5, and SFT with inductor's generated kernels within 1e-4 (why: in
  that test's docstring; inductor compiles for minutes on a loaded 2-core machine, so it runs one recipe, whose
  one training graph is the same decoder layer every objective runs). The run summary's compile fields too.

The refusals (megatron; Liger on the CPU or an uncovered family; a family whose logits are not the output layer's)
exit 2 naming the key."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, assert_same_rows, run_worker
from launchers.run import main

WORKER = REPO / "tests" / "distributed" / "mode_parity.py"
FUSED_MODES = ["mode:logits=train.fused_logprobs=false", "mode:fused=train.fused_logprobs=true"]
ROLLOUT_GRPO = ("recipes/tiny/humanline_sparse_grpo_math.yaml|rollout.every=1,rollout.reward.kind=reward_model,"
                "rollout.reward.model=tests/fixtures/tiny/reward_model")  # scores that vary: non-zero advantages


def _run(modes, specs, tmp_path, nproc=1, in_process=True):
    out = tmp_path / "parity.json"
    run_worker(WORKER, [out, *modes, *specs], nproc=nproc, in_process=in_process)
    return json.loads(out.read_text())


def _assert_fused_same(results):
    for name, modes in results.items():
        assert modes["logits_fused_calls"] == 0 and modes["fused_fused_calls"] > 0, name
        assert_same_rows(modes["logits"], modes["fused"], name, tol=1e-5)
        norms = [row["grad_norm"] for row in modes["logits"]]
        assert min(norms) > 0 and len(set(norms)) == 3, name  # the runs train (GRPO synced at k = 1 has loss 0)


def test_fused_logprobs_equal_the_logits_path_one_process(tmp_path):
    specs = ["recipes/tiny/humanline_dpo.yaml|data.packing=true,model.config_overrides.tie_word_embeddings=true",
             "recipes/tiny/humanline_kto.yaml", ROLLOUT_GRPO, "recipes/tiny/humanline_dpo_lora.yaml"]
    results = _run(FUSED_MODES, specs, tmp_path)
    assert len(results) == len(specs)
    _assert_fused_same(results)
    packed = results[next(n for n in results if "packing" in n)]
    assert packed["fused_forwards"] and packed["logits_forwards"]  # both modes packed


def test_fused_logprobs_equal_the_logits_path_zero3_two_processes(tmp_path):
    _assert_fused_same(_run(FUSED_MODES, ["recipes/tiny/humanline_dpo.yaml|engine.zero_stage=3"], tmp_path, nproc=2))


def _assert_compiled_same(results, tol, backend):
    for name, modes in results.items():
        assert modes["eager_summary"] == {}, name
        summary = modes["compiled_summary"]
        # every decoder layer of every model (the policy, and the reference copy where the run has one)
        assert summary["compiled_layers"] in (2, 4, 8) and summary["compile_backend"] == backend, summary
        # compiled once per kind of forward: training, no-grad (reference, old log-probs), maybe a one-row variant;
        # not once per update or per sequence length
        assert 1 <= summary["compiled_graphs"] <= 4 and summary["recompiles"] <= 3 and summary["compile_s"] > 0, summary
        assert_same_rows(modes["eager"], modes["compiled"], name, tol=tol)
        assert len({row["grad_norm"] for row in modes["eager"]}) == 3, name


def test_compiled_layers_equal_eager_layers(tmp_path):
    """DPO (packed: bins of varying number and width), KTO and GRPO on rollouts through the captured graphs
    (`aot_eager`: dynamo's capture, guards, dynamic shapes and AOT autograd's forward and backward graphs, run by
    PyTorch's own operators): 1e-5."""
    specs = ["recipes/tiny/humanline_dpo.yaml|data.packing=true", "recipes/tiny/humanline_kto.yaml", ROLLOUT_GRPO]
    modes = ["mode:eager=train.compile=false", "mode:compiled=train.compile=true,train.compile_backend=aot_eager"]
    # a fresh process: dynamo's caches and counters start empty, as the summary's graph and recompile counts assume
    _assert_compiled_same(_run(modes, specs, tmp_path, in_process=False), 1e-5, "aot_eager")


def test_inductor_compiled_layers_equal_eager_layers(tmp_path):
    """Inductor's generated kernels (the speed-up), on SFT (one graph: no reference, so one compile on the CPU):
    1e-4, not 1e-5, because the generated kernels fuse and reorder float32 sums (RMSNorm's mean, the attention's
    softmax, the matmul epilogues), about 1e-6 relative per forward, which three Adam updates at lr 1e-3 carry
    into the losses."""
    spec = "recipes/repro/warmup.yaml|train.micro_batch_size=16,train.warmup_steps=0"
    modes = ["mode:eager=train.compile=false", "mode:compiled=train.compile=true"]
    _assert_compiled_same(_run(modes, [spec], tmp_path, in_process=False), 1e-4, "inductor")  # a fresh process too


@pytest.mark.parametrize("overrides,words", [
    (["engine.name=megatron", "engine.zero_stage=0", "train.fused_logprobs=true", "train.compile=true"],
     ["`train.fused_logprobs`, `train.compile` are not available with `engine.name: megatron`"]),
    (["model.kernels=liger"], ["`model.kernels: liger`", "no CUDA GPU"]),
    (["engine.zero_stage=3", "train.compile=true"], ["`train.compile: true`", "`engine.zero_stage: 3`", "recompile"]),
    (["train.compile=true", "model.kernels=liger"], ["`train.compile: true` with `model.kernels: liger`", "Fix:"]),
])
def test_refusals_name_the_key(capsys, overrides, words):
    assert main([str(REPO / "recipes" / "tiny" / "humanline_dpo.yaml"), "--validate", *overrides]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_refusals_by_model_family():
    from hl_core.config import load_recipe
    from hl_core.errors import RecipeError
    from hl_core.models.speed import check_speed_options

    recipe = load_recipe(REPO / "recipes" / "tiny" / "humanline_dpo.yaml",
                         ["model.kernels=liger", "train.fused_logprobs=true"])
    with pytest.raises(RecipeError, match="`model.kernels: liger`.*`phi3`"):
        check_speed_options(recipe.model, recipe.train.fused_logprobs, model_type="phi3", cuda=True)
    recipe = load_recipe(REPO / "recipes" / "tiny" / "humanline_dpo.yaml", ["train.fused_logprobs=true"])
    # the soft-cap is applied from the config
    check_speed_options(recipe.model, recipe.train.fused_logprobs, model_type="gemma2", cuda=False)
    with pytest.raises(RecipeError, match="`train.fused_logprobs: true`.*`cohere`"):
        check_speed_options(recipe.model, recipe.train.fused_logprobs, model_type="cohere", cuda=False)


def test_the_run_summary_reports_compilation(tmp_path, capsys):
    """The engine's compile facts reach summary.json and the printed summary (a run without `train.compile` has
    none)."""
    from hl_core.loop.report import RunReport, StepTimes

    fields = {"compiled_layers": 4, "compile_backend": "inductor", "compile_s": 12.5, "compiled_graphs": 2,
              "recompiles": 1}
    report = RunReport(True, tmp_path, None, "run")
    times = StepTimes([1.0], [0.1], [0.0])
    summary = report.summary(1, 2.0, times, [], 0, 0, dict(fields), "reference sync", False)
    assert json.loads((tmp_path / "summary.json").read_text())["recompiles"] == 1 and summary["compile_s"] == 12.5
    expected = "compiled 4 decoder layers (inductor): 2 graphs (1 recompiles) in 12.5s of compile time"
    assert expected in capsys.readouterr().out
    report.summary(1, 2.0, times, [], 0, 0, {}, "reference sync", False)
    assert "compiled" not in capsys.readouterr().out
