"""Humanline in your own loop, stopped and resumed: with ``SyncSchedule(every=3)``, 10 updates in one go equal 4
updates, a save (policy, optimizer, schedule, ``ReferenceSync.state_dict()``: the count and the moved reference),
fresh objects, a load and 6 more, in per-update losses (1e-6) and in the updates that sync. Run for the plain-torch
example (``attach(optimizer)``, one process), the DeepSpeed example (ZeRO-3, 2 processes) and the Megatron-core
example (tp 2). Without the restored sync state (the same example with its ``sync.load_state_dict`` line removed)
the plain-torch comparison fails: the syncs move and the losses differ. With humanline sampling (``--sample``) the
resumed losses equal the uninterrupted ones exactly (gap 0.0: the transform's generators are in the checkpoint), for
the plain-torch and the DeepSpeed example (ZeRO-3, each rank its own draws); without the restored draws they
differ."""

import re
import shutil

import pytest

from helpers import REPO, run_fresh, run_torchrun

EXAMPLES = REPO / "examples"
TINY = REPO / "tests" / "fixtures" / "tiny"  # named: a copy of examples/ elsewhere has no default model and data
K, STEPS, STOP = 3, 10, 4  # a stop at an update that is not a multiple of k
LINE = re.compile(r"^update (\d+)  loss (\S+)  clipped (\S+)  synced (True|False)$", re.M)
RESTORE_LINE = 'sync.load_state_dict(state["sync"])'
DRAWS_LINE = 'transform.load_state_dict(state["transform"])'


def _rows(stdout):
    return [(int(n), float(loss), float(clipped), synced == "True")
            for n, loss, clipped, synced in LINE.findall(stdout)]


def _run(script, nproc, *args):
    args = [*map(str, args), "--steps", STEPS, "--sync-every", K, "--model", TINY / "model", "--data",
            TINY / "prefs" / "train.jsonl"]
    if nproc == 1:
        proc = run_fresh([script, *args], timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    else:
        proc = run_torchrun(script, args, nproc=nproc, timeout=900)
    return _rows(proc.stdout), proc.stdout


def _stopped_and_resumed(script, nproc, checkpoint, *args):
    first, _ = _run(script, nproc, "--checkpoint", checkpoint, "--stop-after", STOP, *args)
    assert [r[0] for r in first] == list(range(STOP))
    second, out = _run(script, nproc, "--checkpoint", checkpoint, *args)
    assert [r[0] for r in second] == list(range(STOP, STEPS)), out[-2000:]
    return first + second


def _differences(whole, resumed):
    """The largest loss difference and whether the syncs fell on the same updates."""
    return (max(abs(a[1] - b[1]) for a, b in zip(whole, resumed)),
            [r[3] for r in whole] == [r[3] for r in resumed])


def _without(tmp_path, example: str, line: str):
    """A copy of ``examples/`` whose ``example`` lacks the one line holding ``line``."""
    copy = tmp_path / "without"
    shutil.copytree(EXAMPLES, copy, ignore=shutil.ignore_patterns("__pycache__"))
    lines = (copy / example).read_text().splitlines()
    assert sum(line in text for text in lines) == 1
    (copy / example).write_text("\n".join(text for text in lines if line not in text) + "\n")
    return copy / example


def test_plain_torch_resumes_exactly_and_not_without_the_sync_state(tmp_path):
    script = EXAMPLES / "torch_dpo.py"
    whole, out = _run(script, 1)
    assert [r[0] for r in whole] == list(range(STEPS)), out[-2000:]
    assert [r[3] for r in whole] == [n % K == 0 for n in range(STEPS)]
    assert max(r[2] for r in whole) > 0.05  # the clip binds: the reference matters to the loss
    resumed = _stopped_and_resumed(script, 1, tmp_path / "ckpt")
    gap, same_syncs = _differences(whole, resumed)
    print(f"plain torch: max |loss - uninterrupted| {gap:.2e}")
    assert gap <= 1e-6 and same_syncs, (whole, resumed)

    forgetful = _stopped_and_resumed(_without(tmp_path, "torch_dpo.py", RESTORE_LINE), 1, tmp_path / "ckpt2")
    gap, same_syncs = _differences(whole, forgetful)
    print(f"plain torch without the sync state: max |loss - uninterrupted| {gap:.2e}, same syncs {same_syncs}")
    assert gap > 1e-6 and not same_syncs


@pytest.mark.parametrize("example, args", [
    ("deepspeed_dpo.py", ["--zero", "3", "--persist-below", "1000"]),
    ("megatron_dpo.py", ["--tp", "2"]),
])
def test_distributed_example_resumes_exactly(tmp_path, example, args):
    script = EXAMPLES / example
    whole, out = _run(script, 2, *args)
    assert [r[0] for r in whole] == list(range(STEPS)), out[-2000:]
    assert "the clip bound at updates [" in out and max(r[2] for r in whole) > 0.05
    resumed = _stopped_and_resumed(script, 2, tmp_path / "ckpt", *args)
    gap, same_syncs = _differences(whole, resumed)
    print(f"{example}: max |loss - uninterrupted| {gap:.2e}")
    assert gap <= 1e-6 and same_syncs, (whole, resumed)


@pytest.mark.parametrize("example, nproc, args", [
    ("torch_dpo.py", 1, []),
    ("deepspeed_dpo.py", 2, ["--zero", "3", "--persist-below", "1000"]),
])
def test_sampling_resumes_with_a_gap_of_zero_and_not_without_the_draws(tmp_path, example, nproc, args):
    script = EXAMPLES / example
    whole, out = _run(script, nproc, "--sample", *args)
    assert [r[0] for r in whole] == list(range(STEPS)), out[-2000:]
    assert max(r[2] for r in whole) > 0.05  # tokens were rejected: the draws matter to the loss
    resumed = _stopped_and_resumed(script, nproc, tmp_path / "ckpt", "--sample", *args)
    gap, same_syncs = _differences(whole, resumed)
    print(f"{example} --sample: max |loss - uninterrupted| {gap:.2e}")
    assert gap == 0.0 and same_syncs, (whole, resumed)
    forgetful = _stopped_and_resumed(_without(tmp_path, example, DRAWS_LINE), nproc, tmp_path / "ckpt2", "--sample",
                                     *args)
    gap, _ = _differences(whole, forgetful)
    print(f"{example} --sample without the restored draws: max |loss - uninterrupted| {gap:.2e}")
    assert gap > 1e-6
