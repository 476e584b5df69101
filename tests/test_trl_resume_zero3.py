"""A humanline TRL run under DeepSpeed ZeRO-3 on two processes (gloo, CPU, through accelerate), resumed with
``resume_from_checkpoint`` from checkpoint 4 (k = 3, 8 updates), gives the uninterrupted run's per-update losses
within 1e-5. Each rank restores its own ZeRO-3 partition of the moved reference from its own
``humanline_sync_rank<r>.pt`` (no collective while loading), and the sync marks go on on schedule. The control: the
same resume with the reference shards left out when the sync state is loaded (the reference back to the initial
weights) gives other losses, so the comparison can fail."""

import math
import shutil

import pytest
import torch

from trl_common import STEPS, trl_run

pytest.importorskip("trl")

from hl_core.integrations.trl.checkpoint import digest  # noqa: E402

K, SAVE, NPROC = 3, 4, 2
ZERO3 = ("--zero", "3", "--persist-below", "1000", "--save-steps", str(SAVE))
MARKS = [n % K == 0 for n in range(STEPS)]


def run(kind, weights, tmp_path, name, resume=None, *more):
    more = (("--resume", str(resume)) if resume is not None else ()) + more
    return trl_run(kind, weights, tmp_path, *ZERO3, *more, nproc=NPROC, name=name, k=K)


def losses(reports):
    """The per-update losses (the mean over ranks, which every rank reports alike)."""
    rows = [[row["loss"] for row in report["history"]] for report in reports]
    assert all(r == rows[0] for r in rows), rows
    return rows[0]


def gap(whole, resumed, updates=slice(SAVE, STEPS)):
    a, b = losses(whole)[updates], losses(resumed)[updates]
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


def check_resumed(kind, whole, resumed):
    """Losses within 1e-5 after the resume, the sync marks on schedule, and each rank's reference at the resume its
    restored partition, shard-local: the uninterrupted run's at update 4 on that rank, not the initial one."""
    print(f"{kind}, ZeRO-3, 2 processes: updates {SAVE}-{STEPS - 1} resumed vs whole, "
          f"max |loss difference| {gap(whole, resumed):.2e}")
    assert len(losses(whole)) == len(losses(resumed)) == STEPS
    assert gap(whole, resumed) <= 1e-5, (losses(whole), losses(resumed))
    for w, r in zip(whole, resumed):
        assert [row["synced"] for row in w["history"]] == [row["synced"] for row in r["history"]] == MARKS
        assert [c["update"] for c in r["calls"]] == list(range(SAVE, STEPS))  # the attached sync counts on
        assert [c["synced"] for c in r["calls"]] == MARKS[SAVE:]
        assert all(c["sync_collectives"] == 0 for c in w["calls"] + r["calls"]), r["calls"]
        [restore] = r["restores"]
        assert restore["collectives"] == 0 and restore["gather_probe"] > 0  # none, where a gather would count
        assert restore["ref_checksum"] == pytest.approx(w["hooks"][SAVE]["ref_begin"], abs=1e-9)
        assert restore["ref_checksum"] == r["hooks"][0]["ref_begin"]
        assert abs(restore["ref_checksum"] - w["hooks"][0]["ref_begin"]) > 1e-3  # the reference had moved
    assert whole[0]["hooks"][SAVE]["ref_begin"] != whole[1]["hooks"][SAVE]["ref_begin"]  # two partitions


def check_sync_files(checkpoint, weights, resumed):
    """Rank r's file holds rank r's ZeRO-3 partition of every reference parameter (a flat ceil(n / 2) shard, not
    the full tensor), and the resumed rank r's reference sums to exactly that file."""
    from transformers import AutoModelForCausalLM

    full = {name: p.numel() for name, p in AutoModelForCausalLM.from_pretrained(weights).named_parameters()}
    for rank, report in enumerate(resumed):
        state = torch.load(checkpoint / f"humanline_sync_rank{rank}.pt", weights_only=True)["sync"]
        shards = state["reference_shards"]
        assert sorted(shards) == sorted(full) and state["num_syncs"] == 2 and state["updates_seen"] == SAVE
        assert all(s.dim() == 1 and s.numel() == math.ceil(full[n] / NPROC) for n, s in shards.items())
        total = sum(float(s.double().sum()) for s in shards.values())
        assert report["restores"][0]["ref_checksum"] == pytest.approx(total, abs=1e-9)


def test_dpo_resumed_under_zero3_gives_the_uninterrupted_losses_and_the_control_not(weights, tmp_path):
    whole = run("dpo", weights, tmp_path, "whole")
    checkpoint = tmp_path / "whole_out" / f"checkpoint-{SAVE}"
    resumed = run("dpo", weights, tmp_path, "resumed", checkpoint)
    check_resumed("dpo", whole, resumed)
    check_sync_files(checkpoint, weights, resumed)

    control = run("dpo", weights, tmp_path, "control", checkpoint, "--initial-reference")  # counts, not the moved ref
    print(f"dpo control (no reference shards): max |loss difference| {gap(whole, control):.2e}")
    for w, c in zip(whole, control):  # each rank's reference is back to its initial partition
        assert c["restores"][0]["ref_checksum"] == pytest.approx(w["hooks"][0]["ref_begin"], abs=1e-9)
    assert gap(whole, control, slice(SAVE, SAVE + 2)) > 1e-4, (losses(whole), losses(control))

    damaged = tmp_path / "damaged"  # a NaN in rank 1's shards only: both ranks refuse, neither trains on alone
    shutil.copytree(checkpoint, damaged)
    sync_file = damaged / "humanline_sync_rank1.pt"
    payload = torch.load(sync_file, weights_only=True)
    del payload["checksum"]
    next(iter(payload["sync"]["reference_shards"].values())).view(-1)[0] = float("nan")
    torch.save({**payload, "checksum": digest(payload)}, sync_file)
    refusals = [report["refused"] for report in run("dpo", weights, tmp_path, "damaged", damaged, "--expect-refusal")]
    assert "NaN or inf" in refusals[1] and "rank(s) [1] refused it" in refusals[0], refusals
    assert all("\n" not in message for message in refusals)


@pytest.mark.parametrize("kind", ["kto", "grpo"])
def test_kto_and_grpo_resumed_under_zero3_give_the_uninterrupted_losses(kind, weights, tmp_path):
    whole = run(kind, weights, tmp_path, "whole")
    check_resumed(kind, whole, run(kind, weights, tmp_path, "resumed", tmp_path / "whole_out" / f"checkpoint-{SAVE}"))
