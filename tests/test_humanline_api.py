"""The public ``hl_core.humanline`` API on its own: the documented names, the transforms' device metrics, the
shard-local sync of plain modules, DDP, FSDP2 and LoRA adapter pairs, and ``ReferenceSync.attach`` on a torch
optimizer (the reference gets the pre-step weights every k updates, with no collective). DeepSpeed ZeRO 0-3 and
Megatron-core chunks through the same functions: tests/test_own_loop.py, test_sync_zero3.py,
test_megatron_engine.py. Only public names are imported."""

import json
import re
import subprocess

import pytest
import torch

import hl_core.humanline as humanline
from helpers import REPO, run_torchrun
from hl_core.humanline import (
    ClipTransform,
    NoTransform,
    ParameterPairs,
    ReferenceSync,
    SampleTransform,
    SyncSchedule,
    pair_lora_adapters,
    pair_parameters,
)


def test_the_public_names_are_the_documented_ones():
    page = (REPO / "docs" / "reference" / "humanline-api.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", page, re.M))
    assert documented == set(humanline.__all__)
    assert "docs/concepts/method.md" in humanline.__doc__ and (REPO / "docs/concepts/method.md").is_file()


def test_no_test_only_switch_is_read_by_the_core():
    found = subprocess.run(["git", "grep", "-n", "HL_TEST_", "--", "hl_core"], cwd=REPO, capture_output=True,
                           text=True)
    assert found.stdout == "", found.stdout


@pytest.mark.parametrize("transform", [NoTransform(), ClipTransform(-0.1, 0.1), SampleTransform(seed=1)])
def test_transform_metrics_stay_tensors_and_equal_the_host_arithmetic(transform):
    gen = torch.Generator().manual_seed(0)
    policy, ref = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    mask = (torch.rand(3, 7, generator=gen) > 0.3).float()
    log_ratios, metrics = transform(policy, ref, mask)
    assert set(metrics) == set(transform.METRIC_KEYS)
    assert all(torch.is_tensor(v) and v.dim() == 0 and v.dtype == torch.float64 for v in metrics.values())
    d = (policy - ref)[mask.bool()]
    if not isinstance(transform, SampleTransform):
        bounds = (transform.log_eps_P, transform.log_eps_R)
        assert float(metrics["unclamped_frac"]) == int(((d > bounds[0]) & (d < bounds[1])).sum()) / d.numel()
    assert torch.equal(log_ratios * (1 - mask), torch.zeros_like(mask))
    _, empty = transform(policy, ref, torch.zeros_like(mask))  # nothing counts: defined, no division by zero
    assert float(empty["unclamped_frac"]) == 1.0


def _two_mlps():
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return policy, reference


def test_plain_modules_sync_on_the_schedule_and_refuse_another_layout():
    policy, reference = _two_mlps()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=3, offset=1, mix=1.0))
    assert [sync.before_optimizer_step(n).synced for n in range(3)] == [False, True, False]
    assert all(torch.equal(p, r) for p, r in zip(policy.parameters(), reference.parameters()))
    assert sync.pairs.shard_bytes() == 4 * sum(p.numel() for p in policy.parameters())
    with pytest.raises(ValueError, match="names or order"):
        pair_parameters(policy, torch.nn.Sequential(torch.nn.Linear(4, 3)))
    with pytest.raises(ValueError, match="local shard"):
        pair_parameters(policy, torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)))
    with pytest.raises(ValueError):
        SyncSchedule(every=2, offset=2)


def test_attach_syncs_the_pre_step_weights_before_every_kth_step():
    policy, reference = _two_mlps()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    handle = sync.attach(optimizer)
    for n in range(4):
        policy(torch.ones(1, 4)).sum().backward()
        before = [p.detach().clone() for p in policy.parameters()]
        ref_before = [r.detach().clone() for r in reference.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        expected = before if n % 2 == 0 else ref_before
        assert all(torch.equal(r, e) for r, e in zip(reference.parameters(), expected)), n
        assert not all(torch.equal(p, b) for p, b in zip(policy.parameters(), before))  # the step did move it
    handle.remove()
    assert sync.updates_seen == 4 and sync.num_syncs == 2


def test_lora_adapter_pairs_sync_only_the_adapter():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "tests/fixtures/tiny/model"))
    config = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, LoraConfig(**config))
    model.add_adapter("reference", LoraConfig(**config))
    pairs = pair_lora_adapters(model)
    assert len(pairs) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert all("reference" in name and not r.requires_grad for name, _, r in pairs)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}
    assert any(not torch.equal(p, r) for _, p, r in pairs)
    ParameterPairs(pairs).sync()
    assert all(torch.equal(p, r) for _, p, r in pairs)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)  # base untouched
    with pytest.raises(ValueError, match="no layer holds"):
        pair_lora_adapters(model, reference_adapter="absent")


def test_ddp_and_fsdp2_sync_their_local_shards_through_the_optimizer_hook(tmp_path):
    run_torchrun(REPO / "tests/distributed/api_sync.py", [tmp_path / "report"], nproc=2)
    for rank in range(2):
        report = json.loads((tmp_path / f"report.rank{rank}.json").read_text())
        for kind, data in report.items():
            assert data["probe"] > 0 and data["pairs"] == 4
            assert [r["synced"] for r in data["records"]] == [True, False, True, False], kind
            for r in data["records"]:
                assert r["collectives"] == 0, (kind, r)
                assert r["policy_moved"] > 1e-3
                assert (r["ref_vs_pre_policy"] if r["synced"] else r["ref_vs_pre_ref"]) == 0.0, (kind, r)
        assert report["fsdp2"]["records"][0]["local_shard"] == [3, 8]  # FSDP2: half the rows of the [6, 8] weight
        assert report["ddp"]["records"][0]["local_shard"] == [6, 8]


def test_the_input_helpers_give_the_layout_the_transforms_take():
    """``prefix_token_logps`` shifts (0 at position 0) and equals the plain log-softmax; ``fused_sequence_token_logps``
    gives the same from the hidden states; ``mask_from_labels`` of -100 labels is our collators' completion mask.
    The trainer's DeepSpeed engine calls these same functions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hl_core.engines.deepspeed_engine as ds_engine
    import hl_core.logprobs.logits as logits_module
    from hl_core.data.tokens import pad_right
    from hl_core.humanline import fused_sequence_token_logps, mask_from_labels, prefix_token_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "tests/fixtures/tiny/model"))
    batch = pad_right([[5, 6, 7, 8, 9], [5, 6, 11]], [[0, 0, 1, 1, 1], [0, 1, 1]], pad_token_id=0)
    ids, attention = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=attention).logits
    got = prefix_token_logps(logits, ids)
    plain = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert got.shape == ids.shape and torch.equal(got[:, 0], torch.zeros(2))
    assert torch.allclose(got[:, 1:], plain, atol=1e-5)
    fused = fused_sequence_token_logps(model, ids, attention)
    assert torch.allclose(fused * attention, got * attention, atol=1e-5)
    labels = ids.masked_fill(batch["completion_mask"] == 0, -100)
    mask = mask_from_labels(labels)
    assert mask.dtype == torch.float32 and torch.equal(mask, batch["completion_mask"].float())
    assert mask_from_labels(torch.zeros(1, 3, dtype=torch.long))[0].tolist() == [0.0, 1.0, 1.0]  # never position 0
    # the public functions check their arguments, then call what the trainer's engine calls
    assert ds_engine.fused_sequence_token_logps is fused_sequence_token_logps.__wrapped__
    assert logits_module.prefix_token_logps is prefix_token_logps.__wrapped__  # what sequence_token_logps calls
