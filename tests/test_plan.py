"""`--plan` and the offline layout checks: model dimensions, memory formulas, agreement with DeepSpeed's
own ZeRO estimators, layout errors, and the plan on every recipe in the pack."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch

from helpers import REPO, TINY_HUMANLINE, plan_recipe, start_model_overrides
from hl_core.config import load_recipe
from hl_core.errors import RecipeError
from hl_core.models.specs import MODEL_SPECS, check_layout, resolve_spec, spec_from_config
from hl_core.preflight import plan_terms
from hl_core.preflight.plan import memory_plan, plan_report

RECIPE_MODELS = [  # the models our recipes name, plus the ones the issue lists
    "meta-llama/Meta-Llama-3-8B-Instruct",
    "meta-llama/Llama-3.1-8B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2.5-7B-Instruct",
    "google/gemma-2-9b-it",
    "google/gemma-2-27b-it",
]
# Public parameter counts (model cards / safetensors index totals).
PUBLISHED_PARAMS = {
    "meta-llama/Meta-Llama-3-8B-Instruct": 8_030_261_248,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "google/gemma-2-9b-it": 9_241_705_984,
    "google/gemma-2-27b-it": 27_227_128_320,
}


def _meta_model(spec):
    """The real transformers module tree for ``spec``, on the meta device (no memory, no download)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "gemma2": transformers.Gemma2Config}
    kwargs = dict(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                  num_key_value_heads=spec.num_kv_heads, vocab_size=spec.vocab_size,
                  intermediate_size=spec.intermediate_size, tie_word_embeddings=spec.tie_word_embeddings)
    if spec.head_dim is not None:
        kwargs["head_dim"] = spec.head_dim
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cls[spec.model_type](**kwargs))


def _module_counts(model):
    """DeepSpeed's ``model_to_params`` (shared parameters once; the largest single module), by identity
    instead of ``data_ptr`` (all meta tensors share data_ptr 0)."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


# ---------------------------------------------------------------------------------------------- dims


@pytest.mark.parametrize("name", RECIPE_MODELS)
def test_spec_matches_the_transformers_module_tree(name):
    spec = MODEL_SPECS[name]
    model = _meta_model(spec)
    total, largest = _module_counts(model)
    assert spec.num_params() == total == PUBLISHED_PARAMS[name]
    assert spec.largest_layer_params() == largest
    # one decoder layer's tensors, as the ZeRO-2 buffer and the megatron CPU step of --plan list them
    layer = sorted(p.numel() for p in model.model.layers[0].parameters())
    assert sorted(spec.layer_matrices() + spec.layer_vectors()) == layer
    assert sum(layer) == spec.layer_params()


def test_local_model_dir_is_read_from_its_config_json():
    import transformers

    recipe = load_recipe(TINY_HUMANLINE)
    spec = resolve_spec(recipe.model)
    cfg = json.loads((REPO / "tests/fixtures/tiny/model/config.json").read_text())
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.vocab_size) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["vocab_size"])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(
        REPO / "tests/fixtures/tiny/model"))
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    # config_overrides apply on top (the benchmark's `{hidden_size: 256}` style)
    bigger = resolve_spec(load_recipe(TINY_HUMANLINE,
                                      ["model.config_overrides={hidden_size: 256, num_hidden_layers: 4}"]).model)
    assert (bigger.hidden_size, bigger.num_layers) == (256, 4)


def test_spec_from_config_handles_qwen_bias_gemma_norms_and_defaults():
    qwen = spec_from_config({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "vocab_size": 100, "intermediate_size": 128})
    assert qwen.qkv_bias and not qwen.tie_word_embeddings
    gemma = spec_from_config({"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 128, "head_dim": 32})
    assert gemma.norms_per_layer == 4 and gemma.tie_word_embeddings and gemma.num_kv_heads == 4
    assert gemma.kv_channels == 32
    with pytest.raises(RecipeError, match="intermediate_size"):
        spec_from_config({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "vocab_size": 100})


# ------------------------------------------------------------------------------ DeepSpeed estimators


def _deepspeed_gpu_gib(stage: int, total_params: int, largest: int, nodes: int, gpus: int) -> float:
    """Per-GPU GB that DeepSpeed's ``*_all_cold`` estimator prints for no offload (it prints 2 decimals)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if stage == 3:
            estimate_zero3_model_states_mem_needs_all_cold(total_params, largest, num_gpus_per_node=gpus,
                                                           num_nodes=nodes)
        else:
            estimate_zero2_model_states_mem_needs_all_cold(total_params, num_gpus_per_node=gpus, num_nodes=nodes)
    text = out.getvalue()
    wanted = ("offload_param=none, offload_optimizer=none, zero_init=1" if stage == 3 else "offload_optimizer=none")
    for line in text.splitlines():
        if line.rstrip().endswith(wanted):
            return float(re.findall(r"([\d.]+)GB", line)[1])
    raise AssertionError(f"no `{wanted}` row in DeepSpeed's output:\n{text}")


@pytest.mark.parametrize("name", RECIPE_MODELS)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("nodes,gpus", [(1, 8), (2, 8), (4, 8)])
def test_model_states_agree_with_deepspeed_estimators(name, stage, nodes, gpus):
    spec = MODEL_SPECS[name]
    total, largest = _module_counts(_meta_model(spec))  # the same model, measured, for DeepSpeed
    recipe = plan_recipe(name, f"engine.zero_stage={stage}", f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus}")
    plan = memory_plan(recipe)
    ours = plan["gib"]["model_states"]
    theirs = _deepspeed_gpu_gib(stage, total, largest, nodes, gpus)
    if stage == 3:  # plus the 16-bit gradient partition DeepSpeed's estimator leaves out (measured, see plan.py)
        theirs += 2 * total / (nodes * gpus) / 1024**3
    assert abs(ours - theirs) <= 0.05 * theirs, (name, stage, nodes * gpus, ours, theirs)
    assert abs(ours - theirs) <= 0.006  # in fact equal up to DeepSpeed's 2-decimal print


def test_zero1_keeps_whole_bf16_gradients_above_the_stage12_estimator():
    name, world = "meta-llama/Meta-Llama-3-8B-Instruct", 8
    p1 = memory_plan(plan_recipe(name, "engine.zero_stage=1"), world)
    p2 = memory_plan(plan_recipe(name, "engine.zero_stage=2"), world)
    P = p1["params"]
    assert p1["bytes"]["model_states"] - p2["bytes"]["model_states"] == pytest.approx(2 * P * (1 - 1 / world))
    assert p1["bytes"]["optimizer"] == p2["bytes"]["optimizer"] == pytest.approx(12 * P / world)


def test_component_formulas():
    recipe = plan_recipe("Qwen/Qwen2.5-7B-Instruct", "engine.zero_stage=0", "data.max_length=1024",
                     "data.max_prompt_length=512", "train.micro_batch_size=2")
    spec = MODEL_SPECS["Qwen/Qwen2.5-7B-Instruct"]
    P, world = spec.num_params(), 8
    plan = memory_plan(recipe, world)
    b, s, h, a, L, V = 4, 1024, spec.hidden_size, spec.num_heads, spec.num_layers, spec.vocab_size
    assert plan["sequences_per_micro_batch"] == b  # DPO: chosen + rejected
    by = plan["bytes"]
    assert by["weights"] == 2 * P and by["gradients"] == 6 * P and by["optimizer"] == 12 * P  # bf16 ZeRO-0
    assert by["reference"] == 2 * P
    # per token and layer, counted by hand for Qwen2.5-7B (h 3584, q 28 x 128 = 3584, kv 4 x 128 = 512, I 18944),
    # bf16: two RMSNorms (fp32 input copy + output: 6h each), attention 2 x (7q + 2kv), MLP 2 x 4I
    per_token_layer = 2 * 6 * 3584 + 2 * (7 * 3584 + 2 * 512) + 2 * 4 * 18944
    assert per_token_layer == 246784
    final_norm = s * b * 6 * 3584  # once per token: the final RMSNorm
    assert by["activations_full"] == pytest.approx(s * b * per_token_layer * L + final_norm)  # sdpa: no stored scores
    eager = memory_plan(plan_recipe("Qwen/Qwen2.5-7B-Instruct", "engine.zero_stage=0", "data.max_length=1024",
                                "data.max_prompt_length=512", "train.micro_batch_size=2",
                                "model.attn_implementation=eager"), world)
    # eager scores: the float32 softmax and its bf16 copy per head and key (no soft-capping in Qwen)
    assert eager["bytes"]["activations_full"] == pytest.approx(s * b * (per_token_layer + 6 * a * s) * L + final_norm)
    # checkpointed: every layer's input, plus one recomputed layer (its backward) or the final norm (the log-prob
    # backward), never both: the final norm's backward frees its tensors before the first layer is recomputed
    assert by["activations_checkpointed"] == pytest.approx(2 * s * b * h * L + s * b * max(per_token_layer, 6 * 3584))
    # logits kept (2) + their gradient (2) per logit, and 1.5 float32 blocks of 256 tokens
    assert by["logits"] == pytest.approx(4 * b * s * V + 1.5 * 4 * 256 * V)
    # the peak: at rest + the bf16 gradients + the largest phase: the log-prob backward (every activation and the
    # logits), a layer's backward (the layers' activations, the final norm's freed; Qwen2.5-7B is untied) or the
    # step's float32 gradients
    assert by["resident"] == 2 * P + 12 * P + 2 * P
    full = by["activations_full"]
    assert by["total"] == pytest.approx(16 * P + 2 * P + max(full + by["logits"], full - final_norm, 4 * P))
    # ZeRO-3: the reference is partitioned like the policy
    z3 = memory_plan(plan_recipe("Qwen/Qwen2.5-7B-Instruct", "engine.zero_stage=3"), world)
    assert z3["bytes"]["reference"] == pytest.approx(2 * P / world)
    # fp32: no master copy, 4-byte weights and gradients, two fp32 moments
    fp32 = memory_plan(plan_recipe("Qwen/Qwen2.5-7B-Instruct", "engine.zero_stage=0", "engine.precision=fp32"), world)
    assert (fp32["bytes"]["weights"], fp32["bytes"]["gradients"], fp32["bytes"]["optimizer"]) == (4 * P, 4 * P, 8 * P)


def test_megatron_shards_weights_and_distributes_the_optimizer(monkeypatch):
    monkeypatch.setattr(plan_terms, "fused_adam_installed", lambda: True)  # a GPU node's megatron: steps in place
    name = "meta-llama/Meta-Llama-3-8B-Instruct"
    base = ["engine.name=megatron", "engine.zero_stage=0"]
    flat = memory_plan(plan_recipe(name, *base), 8)
    tp2pp2 = memory_plan(plan_recipe(name, *base, "parallel.tp=2", "parallel.pp=2"), 8)
    spec = MODEL_SPECS[name]
    assert (tp2pp2["dp"], tp2pp2["tp"], tp2pp2["pp"]) == (2, 2, 2)
    # each stage: 16 layers (matrices / 2, norms whole) + one of embedding / lm_head (each V*h / 2); the last stage
    # also the final norm. The plan shows the stage whose total is largest: stage 0 (1F1B keeps the most in flight)
    layer_matrices = spec.layer_params() - 2 * spec.hidden_size
    first = 16 * layer_matrices // 2 + 16 * 2 * spec.hidden_size + spec.vocab_size * spec.hidden_size // 2
    assert tp2pp2["stage"] == 0 and tp2pp2["params_per_rank"] == first
    last = memory_plan(plan_recipe(name, *base, "parallel.tp=2", "parallel.pp=2"), 8, stage=1)
    assert last["stage"] == 1 and last["params_per_rank"] == first + spec.hidden_size
    assert set(tp2pp2["stage_totals"]) == {0, 1} and tp2pp2["stage_totals"][0] >= tp2pp2["stage_totals"][1]
    expected = first
    assert tp2pp2["bytes"]["weights"] == 2 * expected and tp2pp2["bytes"]["reference"] == 2 * expected
    assert tp2pp2["bytes"]["optimizer"] == pytest.approx(12 * expected / 2)
    assert flat["bytes"]["optimizer"] == pytest.approx(12 * spec.num_params() / 8)
    assert tp2pp2["gib"]["total"] < flat["gib"]["total"] * 0.75


def test_plan_report_warns_when_over_gpu_memory_and_not_otherwise():
    big = plan_report(plan_recipe("google/gemma-2-27b-it", "engine.zero_stage=2", "data.max_length=2048",
                              "data.max_prompt_length=1024"))
    assert "WARNING" in big and "cluster.gpu_memory_gb" in big and "engine.zero_stage" in big
    fits = plan_report(plan_recipe("Qwen/Qwen2.5-1.5B-Instruct", "engine.zero_stage=3",
                               "model.gradient_checkpointing=true"))
    assert "WARNING" not in fits
    # the same recipe on a small GPU warns
    small = plan_report(plan_recipe("Qwen/Qwen2.5-1.5B-Instruct", "engine.zero_stage=3", "cluster.gpu_memory_gb=4"))
    assert "WARNING" in small
    for key in ("weights", "gradients", "optimizer states", "reference model", "without gradient checkpointing",
                "with gradient checkpointing", "logits", "total", "dp=8 tp=1 pp=1", "grad-accum"):
        assert key in big


# ------------------------------------------------------------------------------------- layout errors


@pytest.mark.parametrize(
    "model,overrides,world,needles",
    [
        ("Qwen/Qwen2.5-1.5B-Instruct", ["parallel.tp=8"], 8, ["parallel.tp", "12 attention heads", "1, 2"]),
        ("meta-llama/Meta-Llama-3-8B-Instruct", ["parallel.tp=16"], 16, ["parallel.tp", "8 key/value heads"]),
        ("Qwen/Qwen2.5-7B-Instruct", ["parallel.pp=3"], 3, ["parallel.pp", "28 layers", "1, 2, 4, 7, 14, 28"]),
        ("meta-llama/Meta-Llama-3-8B-Instruct", ["parallel.tp=4"], 6, ["world size 6", "parallel.tp", "Fix"]),
        ("meta-llama/Meta-Llama-3-8B-Instruct", ["train.global_batch_size=12"], 8, ["train.global_batch_size", "Fix"]),
        ("meta-llama/Meta-Llama-3-8B-Instruct", ["engine.zero_stage=3"], 8,
         ["engine.zero_stage", "megatron", "ignore"]),
        ("acme/unknown-70b", [], 8, ["acme/unknown-70b", "config.json", "models/specs.py"]),
    ],
)
def test_check_layout_errors_name_the_key_and_the_fix(model, overrides, world, needles):
    recipe = plan_recipe(model, "engine.name=megatron", "engine.zero_stage=0", *overrides)
    with pytest.raises(RecipeError) as err:
        check_layout(recipe, world)
    message = str(err.value)
    for needle in needles:
        assert needle in message, message
    assert "Fix" in message or "fix" in message


def test_check_layout_accepts_valid_layouts():
    check_layout(plan_recipe("meta-llama/Meta-Llama-3-8B-Instruct", "engine.name=megatron", "engine.zero_stage=0",
                         "parallel.tp=8", "parallel.pp=4", "train.global_batch_size=64"), 64)
    check_layout(plan_recipe("google/gemma-2-27b-it", "engine.zero_stage=3", "train.global_batch_size=128"), 32)
    check_layout(load_recipe(TINY_HUMANLINE), 2)


# ---------------------------------------------------------------------------------- every recipe


def _all_recipes():
    return sorted(p for p in (REPO / "recipes").rglob("*.yaml") if not p.name.startswith("_") and "_base"
                  not in p.parts)


@pytest.mark.parametrize("path", _all_recipes(), ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_plan_runs_on_every_recipe(path, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe = load_recipe(path, start_model_overrides(path))
    report = plan_report(recipe)
    assert "per-GPU memory estimate" in report and "total" in report
    plan = memory_plan(recipe)
    assert plan["world_size"] == recipe.cluster.nodes * recipe.cluster.gpus_per_node
    assert plan["gib"]["total"] > 0 and all(v >= 0 for v in plan["gib"].values())
    assert plan["exceeds"] == ("WARNING" in report)


def test_run_py_plan_flag(monkeypatch, capsys):
    """`launchers/run.py RECIPE --plan` prints the plan (wired in run.py from hl_core.preflight.plan)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from launchers import run
    assert run.main([str(TINY_HUMANLINE), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "per-GPU memory estimate" in out and "dp=8 tp=1 pp=1" in out
    assert run.main([str(TINY_HUMANLINE), "--plan", "model.name_or_path=acme/unknown-70b",
                     "model.random_init=false"]) == 2
    assert "models/specs.py" in capsys.readouterr().err


def test_copy_free_reference_holds_no_weights():
    """Look-ahead syncing and a cached frozen reference build no reference model: 0 bytes of it, and a note with
    the CPU memory their log-probs take."""
    copy = memory_plan(plan_recipe(), 8)
    lookahead = memory_plan(plan_recipe("meta-llama/Meta-Llama-3-8B-Instruct", "humanline.reference=auto"), 8)
    cached = memory_plan(plan_recipe("meta-llama/Meta-Llama-3-8B-Instruct", "humanline.reference=auto",
                                 "humanline.sync_every=null", "train.cache_reference_logps=true"), 8)
    assert copy["bytes"]["reference"] > 0
    for plan, mode in ((lookahead, "lookahead"), (cached, "cached")):
        assert plan["bytes"]["reference"] == 0
        assert any(f"no reference model ({mode}" in note and "MiB per rank" in note for note in plan["notes"])
        assert plan["bytes"]["total"] == pytest.approx(copy["bytes"]["total"] - copy["bytes"]["reference"])


def test_zero3_rest_holds_the_partition_and_the_reduce_bucket_and_the_update_gathers_the_prefetch_window():
    """What --rehearse measured of DeepSpeed's ZeRO-3 (docs/perf/rehearse_*.md): at rest the 16-bit partition, not a
    gathered layer, plus the 5e8-element reduce bucket; within an update the prefetcher's window of the parameters
    used next, up to stage3_max_live_parameters (1e9) and the one crossing it (plan_peak.zero3_gathered_elements),
    computed here by hand from the shapes. One rank (dp = 1) is not changed (not rehearsed: nothing is partitioned)."""
    name = "meta-llama/Meta-Llama-3-8B-Instruct"
    plan = memory_plan(plan_recipe(name, "engine.zero_stage=3"), 8)
    by, P, L = plan["bytes"], plan["params"], plan["largest_layer_params"]
    assert by["weights_at_rest"] == pytest.approx(2 * P / 8) and by["weights"] == pytest.approx(2 * P / 8 + 2 * L)
    assert by["reduce_buckets"] == 2 * 5e8
    spec = resolve_spec(plan_recipe(name).model)
    h, V, i, q, kv = spec.hidden_size, spec.vocab_size, spec.intermediate_size, spec.q_dim, spec.kv_dim
    layer, down = 2 * h * q + 2 * h * kv + 3 * h * i, h * i  # norms (4096 elements) are persistent: not gathered
    # log-prob backward: output layer + layers 31, 30 (9.6e8), layer 29's down projection crosses 1e9 (H100: 1.020e9)
    assert V * h + 2 * layer < 1e9 <= V * h + 2 * layer + down
    assert by["gathered_weights_logits"] == 2 * (V * h + 2 * layer + down)
    # a layer's backward: the top layer but its (released) down projection, three more layers, then the next one's in
    # backward order: without checkpointing down, up, gate, o (past 1e9); with it down, q, k, v, o, gate, up
    assert not plan["gradient_checkpointing"]
    assert by["gathered_weights_layers"] == 2 * (4 * layer + 2 * down + h * q)
    ckpt = memory_plan(plan_recipe(name, "engine.zero_stage=3", "model.gradient_checkpointing=true"), 8)["bytes"]
    assert ckpt["gathered_weights_layers"] == 2 * (5 * layer - down) and ckpt["gathered_weights_logits"] == by[
        "gathered_weights_logits"]
    assert by["phase_logits"] > by["phase_layers"] and by["gathered_weights"] == by["gathered_weights_logits"]
    assert by["resident"] == pytest.approx(2 * P / 8 + 12 * P / 8 + 2 * P / 8 + 2 * 5e8 + by["reference"])
    small = memory_plan(plan_recipe(name, "engine.zero_stage=3", "model.config_overrides={num_hidden_layers: 2}"), 8)
    norms = 2 * spec.norms_per_layer * h + h
    assert small["bytes"]["gathered_weights"] == 2 * (small["params"] - norms)  # every partitioned parameter
    # Gemma 2 (tied embeddings): the output layer is the embedding (2.4e9 bytes, past 1e9 elements alone); a layer's
    # backward holds two layers' worth (the H100 rehearsal of the 27B recipe, 46 layers: 1.132e9 elements)
    g_recipe = load_recipe(REPO / "recipes" / "gemma2_27b_humanline_dpo_zero3.yaml")
    gemma, g = memory_plan(g_recipe, 16)["bytes"], resolve_spec(g_recipe.model)
    g_layer = 2 * g.hidden_size * (g.q_dim + g.kv_dim) + 3 * g.hidden_size * g.intermediate_size
    assert gemma["gathered_weights_logits"] == 2 * g.vocab_size * g.hidden_size
    assert gemma["gathered_weights_layers"] == 2 * 2 * g_layer
    one = memory_plan(plan_recipe(name, "engine.zero_stage=3", "cluster.gpus_per_node=1"), 1)["bytes"]
    assert one["reduce_buckets"] == one["gathered_weights"] == 0 and one["weights_at_rest"] == one["weights"]


def test_megatron_cpu_path_steps_the_compute_dtype_shards_without_a_master_copy():
    """The megatron engine's CPU path (torch AdamW on the local shards, measured by --rehearse): two moments in the
    compute dtype per parameter, no float32 master copy; the GPU path keeps 12 bytes (bf16) per parameter."""
    name = "meta-llama/Meta-Llama-3-8B-Instruct"
    for precision, per_param in (("bf16", 4), ("fp32", 8)):
        recipe = plan_recipe(name, "engine.name=megatron", "engine.zero_stage=0", "parallel.tp=2", "parallel.pp=2",
                         f"engine.precision={precision}")
        cpu = memory_plan(recipe, 8, distributed_optimizer=False, megatron_gpu=False)
        assert cpu["bytes"]["optimizer"] == per_param * cpu["params_per_rank"]
    gpu = memory_plan(recipe, 8, distributed_optimizer=False)
    assert gpu["bytes"]["optimizer"] == 8 * gpu["params_per_rank"]  # fp32 GPU: master weights are the params


GEMMA2_27B_MEGATRON = REPO / "recipes" / "gemma2_27b_humanline_dpo.yaml"


def _gemma_megatron(*overrides: str):
    return load_recipe(GEMMA2_27B_MEGATRON, ["model.config_overrides={num_hidden_layers: 4}", *overrides])


def test_megatron_cpu_path_counts_its_steps_temporaries(monkeypatch):
    """The CPU path's step (``MegatronEngine._cpu_step``) on Gemma-2-27B at tp 8 x pp 2, counted by hand: stage 0's
    peak is the gradient norm's ``grad.float().pow(2)`` of its embedding slice (two float32 copies); stage 1's tied
    output-layer copy is left out of the norm (``shared``), so its peak is AdamW's ``sqrt`` and quotient of that
    copy (two bf16 tensors) while the denominator of fc2, stepped just before it, is still bound. Over dp 2 the
    flat gradient copy it all-reduces (2 bytes per parameter) comes on top. The GPU path steps in place with a fused
    Adam (0), else with torch's AdamW: a float32 square root of its shard of the moments (measured on an H100)."""
    h, V, inter, tp = 4608, 256000, 36864, 8
    first = memory_plan(_gemma_megatron(), 16, stage=0, distributed_optimizer=False, megatron_gpu=False)["bytes"]
    assert first["step_gradients"] == 8 * V * h / tp
    last = memory_plan(_gemma_megatron(), 16, stage=1, distributed_optimizer=False, megatron_gpu=False)
    fc1 = 2 * inter * h / tp
    assert 8 * fc1 < 2 * (2 * V * h / tp + inter * h / tp)  # the norm's largest (fc1) is not the peak
    assert last["bytes"]["step_gradients"] == 2 * (2 * V * h / tp + inter * h / tp)
    dp2 = memory_plan(_gemma_megatron("cluster.nodes=4"), 32, stage=1, distributed_optimizer=False, megatron_gpu=False)
    assert dp2["dp"] == 2
    assert dp2["bytes"]["step_gradients"] == 2 * dp2["params_per_rank"] + last["bytes"]["step_gradients"]
    monkeypatch.setattr(plan_terms, "fused_adam_installed", lambda: True)  # transformer-engine's or apex's Adam
    gpu = memory_plan(_gemma_megatron(), 16, stage=1)["bytes"]
    assert gpu["step_gradients"] == 0.0
    monkeypatch.setattr(plan_terms, "fused_adam_installed", lambda: False)  # torch's AdamW: sqrt of each moment
    torch_adam = memory_plan(_gemma_megatron(), 16, stage=1)
    assert torch_adam["bytes"]["step_gradients"] == 4 * torch_adam["params_per_rank"]  # dp 1: the whole shard
    sharded = memory_plan(_gemma_megatron("cluster.nodes=4"), 32, stage=1)
    assert sharded["dp"] == 2 and sharded["bytes"]["step_gradients"] == 4 * sharded["params_per_rank"] / 2
    assert "no fused Adam" in " ".join(torch_adam["notes"])


def test_megatron_gemma2_logits_and_the_peak_beside_them():
    """The last stage's soft-capped logits (one row of 2048 tokens per pipeline micro-batch, 256-token chunks,
    V / tp = 32000 per rank), by hand: the forward ends with the bf16 logits, every chunk's float32 tanh and
    softmax and the last chunk's float32 copy and quotient, (2 + 8) L + 4c; the backward's second chunk holds the
    logits, the summed and the new full-size bf16 gradient beside the float32 tensors of 6 chunks, 3 * 2L + 8 (L - 2c):
    the larger. With gradient checkpointing the logits peak beside the layers' inputs and the final norm only (no
    layer is being recomputed then)."""
    recipe = _gemma_megatron()
    plan = memory_plan(recipe, 16, stage=1, distributed_optimizer=False, megatron_gpu=False)
    by = plan["bytes"]
    L, c = 2048 * 256000 / 8, 256 * 256000 / 8
    assert 3 * 2 * L + 8 * (L - 2 * c) > (2 + 8) * L + 4 * c
    assert by["logits"] == pytest.approx(3 * 2 * L + 8 * (L - 2 * c))
    short = memory_plan(_gemma_megatron("data.max_length=256", "data.max_prompt_length=128"), 16, stage=1,
                        distributed_optimizer=False, megatron_gpu=False)["bytes"]
    assert short["logits"] == pytest.approx((2 + 12) * 256 * 256000 / 8)  # one chunk: copy, quotient, tanh, softmax
    assert recipe.model.gradient_checkpointing
    h = 4608
    inputs = 2 * 2048 * h * 2  # bf16 input of each of the stage's 2 layers (1 in flight on the last stage)
    final_norm = 2048 * (4 + 2 + 4) * h  # Gemma 2's RMSNorm: float32 input, bf16 output, float32 normalised
    assert by["activations_checkpointed"] > inputs + final_norm
    assert by["total"] == pytest.approx(by["resident"] + by["backward_gradients"] + max(
        inputs + final_norm + by["logits"], by["activations_checkpointed"], by["step_gradients"]))
