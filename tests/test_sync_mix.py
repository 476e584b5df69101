"""The soft reference update (`humanline.sync_mix`): the arithmetic, the reference mode it needs, and one soft update
per sync through the real trainer for DPO, KTO, GRPO and LoRA (one process; ZeRO-3 over two processes is in
test_sync_zero3.py, megatron tp=2 in test_megatron_engine.py)."""

import json

import pytest
import torch

from helpers import REPO, run_worker
from hl_core.config import check_recipe, load_recipe, reference_mode
from hl_core.errors import RecipeError
from hl_core.humanline import ParameterPairs, ReferenceSync, SyncSchedule
from hl_core.humanline.functional import mix_into
from launchers.run import main

TINY = REPO / "recipes" / "tiny"
SOFT = TINY / "humanline_soft_sync_dpo.yaml"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mix_into_is_the_copy_at_one_and_the_formula_shard_by_shard(dtype):
    gen = torch.Generator().manual_seed(0)
    policy, reference = (torch.randn(1001, generator=gen).to(dtype) for _ in range(2))
    copy = reference.clone()
    mix_into(copy, policy, 1.0)
    assert torch.equal(copy, policy)  # bit for bit
    whole = reference.clone()
    mix_into(whole, policy, 0.3)
    formula = (0.3 * policy.double() + 0.7 * reference.double()).to(dtype)
    ulp = torch.finfo(dtype).eps * reference.double().abs().max()
    assert (whole.double() - formula.double()).abs().max() <= ulp  # the formula, rounded once in the dtype
    assert torch.equal(whole, torch.lerp(reference, policy, 0.3))
    shards = reference.clone()
    for piece in torch.arange(1001).tensor_split(3):  # three ranks' partitions of one flat parameter
        view = shards[piece[0]:piece[-1] + 1]
        mix_into(view, policy[piece[0]:piece[-1] + 1], 0.3)
    assert torch.equal(shards, whole)  # shard-local equals whole


def test_reference_sync_mixes_on_its_schedule():
    policy, reference = torch.full((3,), 2.0), torch.zeros(3)
    sync = ReferenceSync(ParameterPairs([("w", policy, reference)]), SyncSchedule(every=2, offset=0, mix=0.25))
    records = [sync.before_optimizer_step(n) for n in range(4)]
    assert [r.synced for r in records] == [True, False, True, False] and sync.num_syncs == 2
    assert torch.equal(reference, torch.full((3,), 2.0 * 0.25 + 0.5 * 0.75))  # two soft updates: 0.5, then 0.875
    assert records[0].bytes == 12 and records[1].bytes == 0
    with pytest.raises(ValueError):
        SyncSchedule(1, 0, 0.0)


def test_lookahead_cannot_serve_a_mixed_reference():
    auto = load_recipe(SOFT)
    mode, reason = reference_mode(auto)
    assert mode == "copy" and "`humanline.sync_mix: 0.5`" in reason  # auto picks the copy and says why
    assert reference_mode(load_recipe(SOFT, ["humanline.sync_mix=1.0"]))[0] == "lookahead"
    with pytest.raises(RecipeError) as info:
        check_recipe(load_recipe(SOFT, ["humanline.reference=lookahead"]))
    assert "`humanline.reference: lookahead` does not apply" in str(info.value)
    assert "`humanline.sync_mix: 0.5`" in str(info.value) and "Fix" in str(info.value)
    assert main([str(SOFT), "humanline.reference=lookahead", "--validate"]) == 2
    with pytest.raises(RecipeError, match="syncing is off"):
        load_recipe(SOFT, ["humanline.sync_every=null"])
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(RecipeError, match="`humanline.sync_mix` is invalid"):
            load_recipe(SOFT, [f"humanline.sync_mix={bad}"])


def test_one_soft_update_per_sync_through_the_trainer_dpo_kto_grpo_lora(tmp_path):
    """Each sync leaves the reference at `lerp(reference, pre-update policy, 0.5)` (checked on the whole weights: ZeRO-0
    and LoRA hold them on the one rank), which after update 0 is neither the policy nor the old reference."""
    common = "train.max_steps=3,train.lr=5e-3,humanline.sync_every=1,humanline.sync_mix=0.5"
    runs = {
        "dpo": (SOFT, common),
        "kto": (TINY / "humanline_kto.yaml", common + ",train.micro_batch_size=8"),
        "grpo": (TINY / "humanline_grpo.yaml", common),
        "lora": (TINY / "humanline_dpo_lora.yaml", common),
    }
    report = tmp_path / "report.json"
    run_worker(REPO / "tests/distributed/trainer_runs.py", [report, *(f"{n}|{r}|{o}" for n, (r, o) in runs.items())])
    got = json.loads(report.read_text())
    for name, run in got.items():
        assert run["reference_mode"] == "copy" and "`humanline.sync_mix: 0.5`" in run["reference_reason"], name
        records = run["records"]
        assert [r["n"] for r in records] == [0, 1, 2] and all(r["synced"] for r in records), (name, records)
        for r in records:
            assert r["ref_vs_mix"] <= 1e-6, (name, r)
            assert r["policy_moved"] > 1e-4, (name, r)
        for r in records[1:]:  # the policy has moved away from the reference: a mixture, not a copy, not a no-op
            assert r["ref_vs_pre_policy"] > 1e-4 and r["ref_vs_pre_ref"] > 1e-4, (name, r)
        assert [row["synced"] for row in run["rows"]] == [True, True, True]
