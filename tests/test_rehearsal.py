"""``--rehearse`` at tiny shapes: one rank of a larger world under torch's fake process group, through the real
trainer and engine. What is asserted is the mechanics (the fake world's size and this rank's place in it, the
bytes counted per collective kind against what the shapes imply, nothing written where a real run writes, exit
0), not the big models' numbers (``bench/rehearse.py`` and docs/perf/rehearse.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import REPO, TINY_HUMANLINE, _env, rehearse, run_fresh
from hl_core.rehearsal.memory import TensorLedger
from hl_core.rehearsal.report import memory_rows

TINY_MEGATRON_PP = REPO / "recipes" / "tiny" / "megatron_tp1_pp2_humanline_dpo.yaml"
FP32 = 4


def _tiny_params() -> int:
    """Parameters of the tiny Llama (tests/fixtures/tiny/model): embedding, 2 layers, final norm, output layer."""
    config = json.loads((REPO / "tests" / "fixtures" / "tiny" / "model" / "config.json").read_text())
    h, v, f, layers = (config[key] for key in ("hidden_size", "vocab_size", "intermediate_size", "num_hidden_layers"))
    kv = config["num_key_value_heads"] * config["head_dim"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o, k, v, gate/up/down, two norms
    return v * h + layers * layer + h + v * h


def test_zero3_rank_of_four_counts_gathers_and_reduce_scatters(tmp_path):
    """Rank 1 of a 4-rank ZeRO-3 world, in one process: every parameter is gathered whole for each forward and
    each backward, and every gradient reduce-scattered once per micro-batch, so the bytes counted at the process
    group are at least the model's float32 size times those counts (DeepSpeed pads each partition to the world
    size: a little more, never less); the sync is shard-local (no collective)."""
    result, stdout = rehearse(tmp_path, TINY_HUMANLINE, 1, "engine.zero_stage=3", "cluster.gpus_per_node=4",
                               "train.global_batch_size=64", "engine.zero3_param_persistence_threshold=0",
                               "humanline.reference=copy")
    assert result["world_size"] == 4 and result["rank"] == 1
    assert result["coords"]["dp"] == 1 and result["coords"]["dp_size"] == 4
    micro = result["micro_batches"]
    assert micro == result["accumulation"] == 2
    params = _tiny_params()
    traffic = result["traffic"]
    padding = 4 * 64 * FP32 * 40  # at most world - 1 padding elements per parameter tensor (about 20) per transfer
    scattered = traffic["reduce-scatter"]["payload"]
    assert micro * params * FP32 <= scattered <= micro * (params * FP32 + padding)
    gathered = traffic["all-gather"]["payload"]
    assert gathered >= 2 * micro * params * FP32  # forward + backward of every micro-batch at least
    assert result["sync_bytes"] == 0 and "shard-local copy: no collective" in stdout
    memory = result["memory"]
    assert 0 < memory["weights"] <= (params // 4 + 64 * 40) * FP32  # this rank's partition, not the whole model
    assert memory["activations"] > 0 and memory["logits"] > 0
    assert result["skipped_updates"] == 0


def test_megatron_last_pipeline_stage_receives_and_sends(tmp_path):
    """The last stage (rank 1 of tp 1 x pp 2) of megatron's pipeline, alone: it receives activations it never
    got from stage 0 (the receive shim gives zeros of megatron's shape), runs the output layer and the loss,
    and sends the gradients of its inputs back; each pipeline micro-batch moves one [tokens, hidden] bfloat16 or
    float32 tensor each way."""
    result, _ = rehearse(tmp_path, TINY_MEGATRON_PP, 1, "cluster.gpus_per_node=2")
    assert result["world_size"] == 2 and result["coords"]["pp_stage"] == 1
    traffic = result["traffic"]
    assert traffic["pp recv"]["calls"] > 0 and traffic["pp send"]["calls"] > 0
    assert traffic["pp send"]["payload"] > 0
    assert result["memory"]["logits"] > 0  # the last stage holds the logits
    assert result["skipped_updates"] == 0


@pytest.mark.parametrize("argv, needle", [
    (["--rehearse-rank", "4", "cluster.gpus_per_node=4"], "outside the recipe's world of 4 ranks"),
    (["--rehearse-rank", "0", "--rehearse-micro-batches", "1"], "at least 2"),
])
def test_bad_rehearsal_arguments_exit_2(argv, needle):
    proc = subprocess.run([sys.executable, str(REPO / "launchers" / "run.py"), str(TINY_HUMANLINE), *argv], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert needle in proc.stderr


def test_zero2_rank_of_four_reduces_every_micro_batch_and_the_plan_counts_its_bucket(tmp_path):
    """Rank 1 of a 4-rank ZeRO-2 world: every rank holds the whole model; each micro-batch's gradients are reduced
    (ZeRO-2 partitions gradients, so it cannot wait for the accumulation boundary) and the updated partitions are
    all-gathered once per update; the peak holds DeepSpeed's reduce bucket (5e8 float32 elements here), which
    `--plan` counts (within 10%)."""
    result, _ = rehearse(tmp_path, TINY_HUMANLINE, 1, "engine.zero_stage=2", "cluster.gpus_per_node=4",
                          "train.global_batch_size=64", "humanline.reference=copy")
    assert result["world_size"] == 4 and result["coords"]["dp_size"] == 4
    params, micro = _tiny_params(), result["micro_batches"]
    traffic, memory = result["traffic"], result["memory"]
    assert traffic["all-reduce"]["payload"] >= micro * params * FP32
    assert params * FP32 <= traffic["all-gather"]["payload"] <= params * FP32 + 4 * 64 * 40 * FP32
    assert memory["weights"] == params * FP32  # not partitioned
    plan = result["plan"]["bytes"]
    assert plan["backward_bucket"] == 5e8 * FP32
    assert abs(memory["peak_tensors"] / plan["total"] - 1) < 0.10


def _in_fresh_process(script: str) -> str:
    """Run ``script`` in a Python process of its own (the fake process group is process-wide); its stdout."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "script.py").write_text(script)
        proc = run_fresh([Path(tmp) / "script.py"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_fake_world_makes_deepspeeds_backend_without_the_shm_op():
    """Under the fake process group (already initialised by the rehearsal), the DeepSpeed engine's start-up makes
    DeepSpeed's communication backend itself, with the shared-memory all-reduce op left unbuilt (as under gloo),
    instead of leaving it to ``deepspeed.initialize``, which would JIT-compile the op for peers that do not exist."""
    script = (
        "from hl_core.rehearsal.world import join_fake_world\n"
        "from hl_core.engines.deepspeed_engine import _init_distributed\n"
        "import deepspeed.comm.comm as ds\n"
        "join_fake_world(0, 4)\n"
        "_init_distributed(None)\n"
        "assert ds.cdb is not None and ds.cdb.is_initialized(), 'no DeepSpeed backend'\n"
        "assert ds.cdb.shm_comm_op is None, 'the shm op was built'\n"
        "print('ok', ds.cdb.get_world_size())\n"
    )
    assert "ok 4" in _in_fresh_process(script)


def test_traffic_link_follows_the_nodes_a_group_spans():
    """Rank 0 of 16 on 2 nodes of 8 (the Gemma-2-27B megatron layout, tp 8 x pp 2): an all-reduce over its tensor
    group (ranks 0-7, one node) is NVLink traffic; a send to the next pipeline stage (rank 8, the other node) and
    an all-reduce over ranks 0 and 8 cross nodes (InfiniBand). On one 16-GPU node the same send stays within it."""
    script = (
        "import json, torch, torch.distributed as dist\n"
        "from hl_core.rehearsal.world import join_fake_world, CollectiveTraffic\n"
        "from hl_core.rehearsal.memory import TensorLedger\n"
        "from hl_core.rehearsal.run import RehearsalMode\n"
        "join_fake_world(0, 16)\n"
        "tp, pp = dist.new_group(list(range(8))), dist.new_group([0, 8])\n"
        "out = {}\n"
        "for per_node in (8, 16):\n"
        "    traffic = CollectiveTraffic(per_node)\n"
        "    traffic.recording = True\n"
        "    with RehearsalMode(traffic, TensorLedger([], torch.device('cpu'))):\n"
        "        dist.all_reduce(torch.ones(1024), group=tp)\n"
        "        dist.all_reduce(torch.ones(256), group=pp)\n"
        "        dist.send(torch.ones(512), dst=8, group=pp)\n"
        "    out[per_node] = {k: [r.payload, r.between_nodes] for k, r in traffic.by_kind().items()}\n"
        "print(json.dumps(out))\n"
    )
    two_nodes, one_node = json.loads(_in_fresh_process(script).strip().splitlines()[-1]).values()
    assert two_nodes == {"all-reduce": [1024 * FP32, False], "all-reduce between nodes": [256 * FP32, True],
                         "pp send between nodes": [512 * FP32, True]}
    assert one_node == {"all-reduce": [(1024 + 256) * FP32, False], "pp send": [512 * FP32, False]}


def test_report_adds_the_generic_cpu_step_only_where_the_plan_lacks_it():
    """On the CPU the report adds two float32 temporaries of the largest stepped tensor to a DeepSpeed plan's step
    (torch AdamW's); the megatron CPU path's plan counts its own step (plan_terms.megatron_cpu_step_bytes), so
    nothing is added to it."""
    plan = dict(weights=10, resident=40, optimizer=20, reference=0, backward_gradients=10, step_gradients=7,
                activations_full=5, activations_checkpointed=3, logits=4, total=60)
    memory = dict(at_rest=40, weights=10, optimizer=20, reference=0, kept_other=10, backward_gradients=10,
                  step_gradients=7, activations=5, logits=4, peak_tensors=60, peak_process=60, at_peak={},
                  largest_stepped_numel=100)
    for engine, added in (("deepspeed", 2 * 4 * 100), ("megatron", 0)):
        result = dict(memory=memory, plan=dict(bytes=plan, gradient_checkpointing=False), device="CPU", engine=engine)
        step = {label.strip(): planned for label, _, planned, _ in memory_rows(result)}["float32 gradients at step"]
        assert step == 7 + added


def test_ledger_counts_a_recomputed_autograd_function_as_an_activation():
    """Gradient checkpointing recomputes a layer inside the backward; an autograd.Function's forward (DeepSpeed
    ZeRO-3's linear is one) runs with gradients off, so only torch's recomputation hooks tell its outputs (saved
    for the layer's backward: activations) from the backward's own tensors (gradients)."""
    ledger = TensorLedger([], torch.device("cpu"))
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x * 2
            seen.append((torch.is_grad_enabled(), ledger.category_of(out)))
            return out

        @staticmethod
        def backward(ctx, grad):
            seen.append(("backward", ledger.category_of(grad * 2)))
            return grad * 2

    x = torch.randn(8, 4, requires_grad=True)
    ledger.phase = "forward"
    y = checkpoint(lambda t: Double.apply(t).sin(), x, use_reentrant=False)
    ledger.phase = "backward"
    y.sum().backward()
    forward, recomputed, backward = seen
    assert forward == (False, "forward")  # the first forward: its phase
    assert recomputed == (False, "activation")  # gradients off, yet recomputed for the backward
    assert backward == ("backward", "backward")  # the backward function's gradient


def test_a_nonfinite_gradient_is_zeroed_so_the_step_and_its_memory_are_rehearsed(tmp_path):
    """A gradient full of NaN in the warm-up update (fake collectives and unfilled buffers can leave garbage) is
    zeroed, named in the result and the report, and the update steps: the optimizer states are there at rest (a
    skipped warm-up step would leave them out, 0 bytes) and no update is skipped."""
    result, stdout = rehearse(tmp_path, TINY_HUMANLINE, 0, "engine.zero_stage=0", "cluster.gpus_per_node=2",
                               "humanline.reference=copy", script=REPO / "tests" / "distributed"
                               / "rehearse_poisoned.py")
    assert result["skipped_updates"] == 0
    (event,) = result["zeroed_gradients"]
    assert event["update"] == 0 and event["dtype"] == "float32" and event["shape"]
    assert result["memory"]["optimizer"] == pytest.approx(2 * _tiny_params() * FP32, rel=0.01)  # AdamW's 2 moments
    assert "1 gradient tensor(s) held NaN or inf" in stdout


def test_zero0_rank_of_four_all_reduces_the_gradients_once_per_update(tmp_path):
    """Rank 1 of a 4-rank ZeRO-0 world: nothing is partitioned (the whole model and its whole gradients on every
    rank, no reduction bucket in the plan) and the gradients are all-reduced once per update, at the accumulation
    boundary: the payload is the model's float32 size once, not once per micro-batch; nothing is all-gathered."""
    result, _ = rehearse(tmp_path, TINY_HUMANLINE, 1, "engine.zero_stage=0", "cluster.gpus_per_node=4",
                          "train.global_batch_size=64", "humanline.reference=copy")
    assert result["world_size"] == 4 and result["coords"]["dp_size"] == 4
    params, micro = _tiny_params(), result["micro_batches"]
    assert micro == 2
    traffic, memory, plan = result["traffic"], result["memory"], result["plan"]["bytes"]
    assert params * FP32 <= traffic["all-reduce"]["payload"] < 2 * params * FP32
    assert "all-gather" not in traffic and "reduce-scatter" not in traffic
    assert memory["weights"] == params * FP32
    # the whole float32 gradients, kept from the backward to the step, as the plan counts them
    assert memory["backward_gradients"] == pytest.approx(params * FP32, rel=0.01)
    assert plan["backward_bucket"] == 0 and plan["backward_gradients"] == params * FP32


def test_zero1_rank_of_four_reduces_once_per_update_with_zero2s_bf16_bucket(tmp_path):
    """Rank 1 of a 4-rank bf16 ZeRO-1 world: whole gradients on every rank (only the optimizer states and the
    float32 master copy are partitioned), reduced once per update at the accumulation boundary (ZeRO-2 reduces
    every micro-batch), the updated partitions all-gathered once; the backward makes ZeRO-2's reduction bucket,
    5e8 elements of the gradients' dtype (bf16: the engine sets no separate accumulation dtype), which `--plan`
    counts (a float32 bucket would put the peak near twice the plan's)."""
    result, _ = rehearse(tmp_path, TINY_HUMANLINE, 1, "engine.zero_stage=1", "engine.precision=bf16",
                          "cluster.gpus_per_node=4", "train.global_batch_size=64", "humanline.reference=copy")
    params, micro, bf16 = _tiny_params(), result["micro_batches"], 2
    assert micro == 2
    traffic, memory, plan = result["traffic"], result["memory"], result["plan"]["bytes"]
    reduced = sum(traffic.get(kind, {}).get("payload", 0) for kind in ("all-reduce", "reduce-scatter"))
    assert params * bf16 <= reduced < 2 * params * bf16  # once per update, not once per micro-batch
    assert params * bf16 <= traffic["all-gather"]["payload"] <= (params + 4 * 64 * 40) * bf16
    assert memory["weights"] == params * bf16
    assert memory["optimizer"] <= 12 * (params / 4 + 64 * 40)  # master copy + two moments: this rank's quarter
    assert plan["backward_bucket"] == 5e8 * bf16
    assert abs(memory["peak_tensors"] / plan["total"] - 1) < 0.10
