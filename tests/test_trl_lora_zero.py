"""A LoRA policy through the TRL adapter under DeepSpeed ZeRO-2 and ZeRO-3 on two processes (gloo, CPU, real
``deepspeed.initialize`` through accelerate; 4 pairs per process): the per-update losses equal one process without
DeepSpeed (8 pairs) within 1e-5 (k = 3, bounds that bind, 8 updates), the reference adapter synced shard by shard
with no collective; resumed from checkpoint 4, the run gives the uninterrupted losses exactly (gap 0.0). The
control: the same resume with the reference adapter left at its initial weights differs."""

import pytest

from trl_common import STEPS, check_equal, trl_run

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("deepspeed")

K, SAVE = 3, 4
LORA = ("--lora-seed", "0", "--lr", "0.01")  # the LoRA recipe's learning rate: the adapter moves, the clip binds


@pytest.fixture(scope="module")
def one_process(weights, tmp_path_factory):
    return trl_run("dpo", weights, tmp_path_factory.mktemp("one"), *LORA, nproc=1, name="one", k=K)[0]["history"]


def losses(reports):
    rows = [[row["loss"] for row in report["history"]] for report in reports]
    assert all(r == rows[0] for r in rows), rows
    return rows[0]


@pytest.mark.parametrize("zero", [2, 3])
def test_lora_under_zero_on_two_processes_equals_one_process_and_resumes_exactly(zero, one_process, weights,  # noqa
                                                                                 tmp_path):
    run = ("--zero", str(zero), "--batch", "4", "--save-steps", str(SAVE), *LORA)
    whole = trl_run("dpo", weights, tmp_path, *run, nproc=2, name="whole", k=K)
    check_equal(whole, [row["loss"] for row in one_process], f"dpo, LoRA, ZeRO-{zero}, 2 processes vs 1", k=K)
    checkpoint = tmp_path / "whole_out" / f"checkpoint-{SAVE}"
    resumed = trl_run("dpo", weights, tmp_path, *run, "--resume", str(checkpoint), nproc=2, name="resumed", k=K)
    gap = max(abs(a - b) for a, b in zip(losses(whole)[SAVE:], losses(resumed)[SAVE:]))
    print(f"dpo, LoRA, ZeRO-{zero}, 2 processes: updates {SAVE}-{STEPS - 1} resumed vs whole, max |loss difference| "
          f"{gap:.2e}")
    assert len(losses(resumed)) == STEPS and gap == 0.0, (losses(whole), losses(resumed))
    assert [row["synced"] for row in resumed[0]["history"]] == [n % K == 0 for n in range(STEPS)]
    if zero == 3:
        control = trl_run("dpo", weights, tmp_path, *run, "--resume", str(checkpoint), "--initial-reference",
                          nproc=2, name="control", k=K)
        assert max(abs(a - b) for a, b in zip(losses(whole)[SAVE:], losses(control)[SAVE:])) > 1e-4
