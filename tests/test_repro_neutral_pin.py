"""A pinned study curve compared on every x86-64 CPU (issue 39): the study pins of ``tests/test_repro.py`` compare
only where the CPU kernels compute the same bytes as the pinned machine's (AVX2 branches differ between vendors), so
they skip on most machines. This short pin runs in the study's own worker pool under the code paths every x86-64
CPU takes alike (``eval.repro.runs.NEUTRAL_KERNELS``: ATen's unvectorised kernels, MKL's COMPATIBLE branch,
oneDNN at SSE4.1): a supervised warm-up of ``WARMUP_STEPS`` updates (the study's warm-up recipe, the quick grid's
batch), then ``DPO_STEPS`` updates of the preference study's offline humanline DPO arm from it on pairs made from the
warm-up's data. Its per-update losses, gradient norms and reward margins are compared with the stored values to
``REL`` (relative): a training change that moves them fails here on any machine. Checked by planting a one-line
change (``hl_core/objectives/dpo_losses.py``: the sigmoid loss scaled by 1.0001): this test failed, then passed
again once reverted. Not x86-64 (another instruction set rounds otherwise): skipped."""

from __future__ import annotations

import json
import math
import platform

import pytest

from helpers import REPO, read_jsonl

PIN = REPO / "tests" / "fixtures" / "repro_neutral_pin.json"
WARMUP_STEPS, DPO_STEPS, PAIRS = 30, 6, 96
REL = 1e-6


def make_pairs(rows, n: int):
    """Preference pairs from the warm-up's own rows: the answer, against it with its last digit moved by one."""
    pairs = []
    for row in rows[:n]:
        answer = row["completion"]
        wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
        pairs.append({"prompt": row["prompt"], "chosen": answer, "rejected": wrong})
    return pairs


def moved(pinned: dict, actual: dict, rel: float = REL):
    """The first ``(key, index, pinned, actual)`` where ``actual`` differs from ``pinned`` beyond ``rel``, else None."""
    for key, values in pinned.items():
        got = actual.get(key)
        if got is None or len(got) != len(values):
            return key, None, values, got
        for i, (a, b) in enumerate(zip(values, got)):
            if not math.isclose(a, b, rel_tol=rel, abs_tol=rel * 1e-3):
                return key, i, a, b
    return None


@pytest.fixture(scope="module")
def neutral(tmp_path_factory):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the vendor-neutral pin is x86-64's; this machine is {platform.machine()}")
    from eval.repro.runs import NEUTRAL_KERNELS, Run, WorkerPool, kernel_fingerprint, run_all, warmups
    from eval.repro.studies import QUICK, RECIPES

    root = tmp_path_factory.mktemp("neutral_pin")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in make_pairs(
        read_jsonl(REPO / "tests" / "fixtures" / "toy_add" / "sft_train.jsonl"), PAIRS)))
    with WorkerPool(1, root / "workers", kernels=NEUTRAL_KERNELS) as pool:
        kernels = kernel_fingerprint(pool)
        model = warmups(root / "cache", [*QUICK.warmup_overrides, f"train.max_steps={WARMUP_STEPS}"], [0], pool)[0]
        dpo = Run("dpo_offline_humanline", 0, RECIPES / "preference" / "dpo_offline_humanline.yaml",
                  [f"model.name_or_path={model}", f"data.train.path={data}", "data.eval=null", "eval.every=null",
                   f"train.max_steps={DPO_STEPS}", "train.warmup_steps=0", "train.lr=1e-3"], root / "dpo")
        (dpo,) = run_all([dpo], pool, "neutral pin")
    warm = read_jsonl(model.parent / "metrics.jsonl")
    values = {"warmup_loss": [r["loss"] for r in warm], "warmup_grad_norm": [r["grad_norm"] for r in warm],
              "dpo_loss": [r["loss"] for r in dpo.metrics], "dpo_grad_norm": [r["grad_norm"] for r in dpo.metrics],
              "dpo_margin": [r["rewards/margin"] for r in dpo.metrics]}
    return kernels, values, root


def test_neutral_pin_is_compared_on_every_x86_cpu(neutral, tmp_path):
    kernels, values, _ = neutral
    fresh = tmp_path / PIN.name
    fresh.write_text(json.dumps({"kernels": kernels, "values": values}, indent=1) + "\n")
    assert PIN.exists(), f"no pin yet: cp {fresh} {PIN}"
    pinned = json.loads(PIN.read_text())
    assert all(len(v) for v in values.values()), values
    difference = moved(pinned["values"], values)
    same_kernels = {k: v for k, v in kernels.items() if k != "cpu"} == {
        k: v for k, v in pinned["kernels"].items() if k != "cpu"}
    assert difference is None, (
        f"the vendor-neutral pin moved at {difference[0]}[{difference[1]}]: {difference[2]!r} -> {difference[3]!r}"
        + ("" if same_kernels else f" (the neutral kernels computed other bytes here than on "
           f"{pinned['kernels'].get('cpu')}: {kernels})")
        + f". If a training change moved it on purpose: cp {fresh} {PIN}")


def test_the_pin_compares_strictly():
    pinned = {"a": [1.0, 2.0]}
    assert moved(pinned, {"a": [1.0, 2.0]}) is None
    assert moved(pinned, {"a": [1.0, 2.0 * (1 + 1e-5)]}) == ("a", 1, 2.0, 2.0 * (1 + 1e-5))
    assert moved(pinned, {"a": [1.0]})[0] == "a" and moved(pinned, {})[0] == "a"
    pairs = make_pairs([{"prompt": "1+2=", "completion": "003"}, {"prompt": "5+4=", "completion": "009"}], 2)
    assert pairs == [{"prompt": "1+2=", "chosen": "003", "rejected": "004"},
                     {"prompt": "5+4=", "chosen": "009", "rejected": "000"}]
