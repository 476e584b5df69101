"""`--plan`'s DeepSpeed ZeRO terms over several ranks (split from tests/test_plan.py, at the file-size cap): the
ZeRO-1/2 reduce bucket within the backward, ZeRO-2's gradient buffer per rank, ZeRO-3's step sub-group."""

import pytest

from helpers import plan_recipe
from hl_core.models.specs import MODEL_SPECS
from hl_core.preflight.plan import memory_plan


def test_zero12_over_ranks_counts_the_reduce_bucket_within_the_backward():
    """DeepSpeed's ZeRO-1/2 reduce bucket (5e8 elements of the gradients' dtype, measured by --rehearse in bf16 and
    fp32) adds to the backward's side of the peak over more than one rank; not at rest, not on one rank."""
    name = "meta-llama/Meta-Llama-3-8B-Instruct"
    for stage in (1, 2):
        recipe = plan_recipe(name, f"engine.zero_stage={stage}", "model.gradient_checkpointing=true")
        by = memory_plan(recipe, 8)["bytes"]
        assert by["backward_bucket"] == 2 * 5e8 and by["reduce_buckets"] == 0
        # the bucket exists from the first gradient that is ready to the end of each backward: in a layer's backward
        # (the kept inputs + one recomputed layer), not in the log-prob backward (no parameter's gradient yet)
        assert by["phase_layers"] == pytest.approx(by["backward_bucket"] + by["activations_checkpointed"])
        assert by["phase_logits"] > by["phase_layers"] - by["backward_bucket"]
        peak = by["resident"] + by["backward_gradients"] + max(by["phase_layers"], by["phase_logits"],
                                                               by["step_gradients"])
        assert by["total"] == pytest.approx(peak)
        one = memory_plan(plan_recipe(name, f"engine.zero_stage={stage}", "cluster.gpus_per_node=1"), 1)["bytes"]
        assert one["backward_bucket"] == 0


def test_zero2_gradient_buffer_holds_the_overlapping_parameters_whole_and_tied_outputs_wait_for_the_embedding():
    """What --rehearse measured of DeepSpeed's ZeRO-2 on Qwen2.5-1.5B (tied embeddings, docs/perf): the 16-bit
    gradient buffer of a rank is sized by the parameters that overlap its 1/dp of the flattened parameters, each
    whole, so rank 0 (the embedding first) holds the whole V x h embedding, not P/dp; and in a layer's backward
    the output layer's gradient (V x h, tied) waits in autograd for the embedding's own backward."""
    name = "Qwen/Qwen2.5-1.5B-Instruct"
    spec = MODEL_SPECS[name]
    V, h, P = spec.vocab_size, spec.hidden_size, spec.num_params()
    recipe = plan_recipe(name, "engine.zero_stage=2", "model.gradient_checkpointing=true")
    rank0 = memory_plan(recipe, 8, dp_rank=0)["bytes"]
    assert V * h > P / 8  # 233M > 193M: rank 0's range lies inside the embedding
    # plus its overlap of the other group (norms and biases, no weight decay): 1/8 of them, cut at a tensor's end
    vectors = spec.num_layers * (2 * h + spec.q_dim + 2 * spec.kv_dim) + h
    assert 2 * (V * h + vectors / 8) <= rank0["backward_gradients"] <= 2 * (V * h + vectors / 8 + h)
    assert rank0["gradients"] == pytest.approx(2 * P / 8 + 4 * P / 8)  # the model states stay DeepSpeed's estimator
    # rank 1's range starts inside the embedding and runs P/8 elements on, into the layers: the embedding whole
    # plus the layers' tensors it reaches (at least 2P/8 - V*h elements past the embedding)
    rank1 = memory_plan(recipe, 8, dp_rank=1)["bytes"]
    assert 2 * (V * h + (2 * P / 8 - V * h)) <= rank1["backward_gradients"] <= 2 * (2 * P / 8 + 2 * h
                                                                                    * spec.intermediate_size)
    worst = memory_plan(recipe, 8)["bytes"]  # the plan's own answer: the largest over the ranks
    assert worst["backward_gradients"] == max(memory_plan(recipe, 8, dp_rank=r)["bytes"]["backward_gradients"]
                                              for r in range(8))
    assert rank0["phase_layers"] == pytest.approx(rank0["backward_bucket"] + rank0["activations_checkpointed"]
                                                  + 2 * V * h)  # the tied output layer's gradient
    untied = memory_plan(plan_recipe("Qwen/Qwen2.5-7B-Instruct", "engine.zero_stage=2",
                                 "model.gradient_checkpointing=true"),
                         8, dp_rank=0)["bytes"]
    assert untied["phase_layers"] == pytest.approx(untied["backward_bucket"] + untied["activations_checkpointed"])


def test_zero3_step_holds_one_sub_groups_flat_copies():
    """ZeRO-3 steps its optimizer one sub-group at a time (``sub_group_size``, 1e9 elements), each with a flat 16-bit
    copy of its gradients and that copy's float32 twin live together: (2 + 4) bytes per element of the largest
    sub-group in bf16, 4 in fp32 (an H100 rehearsal of Llama-3-8B's rank 0 of 8 measured 5.61 GiB). A sub-group is
    cut after the parameter that brings it to the size, so it holds at least 1e9 and less than 1e9 + one partition."""
    from hl_core.preflight.plan_peak import zero3_largest_sub_group

    spec = MODEL_SPECS["meta-llama/Meta-Llama-3-8B-Instruct"]
    partitions = [-(-n // 8) for n in [spec.embedding_params(), *spec.layer_matrices(), spec.lm_head_params()]]
    assert zero3_largest_sub_group(spec, 8, 1) == max(partitions)  # every parameter its own sub-group
    whole = -(-spec.embedding_params() // 8) * 2 + sum(-(-n // 8) for n in spec.layer_matrices()) * spec.num_layers
    assert zero3_largest_sub_group(spec, 8, 1e12) == whole  # one sub-group: the whole partition of the matrices
    sub_group = zero3_largest_sub_group(spec, 8, 1e9)
    assert 1e9 <= sub_group < 1e9 + max(partitions) and sub_group <= whole
    bf16 = memory_plan(plan_recipe("meta-llama/Meta-Llama-3-8B-Instruct", "engine.zero_stage=3"), 8)
    assert bf16["bytes"]["step_gradients"] == 6 * sub_group
    assert bf16["bytes"]["master_gradients"] == 4 * bf16["params"] / 8  # the whole partition's, the CPU step's base
    fp32 = memory_plan(plan_recipe("meta-llama/Meta-Llama-3-8B-Instruct", "engine.zero_stage=3",
                                   "engine.precision=fp32"), 8)
    assert fp32["bytes"]["step_gradients"] == 4 * sub_group
