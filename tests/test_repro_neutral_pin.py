"""A pinned study curve compared on every x86-64 CPU, Intel's and AMD's alike (issues 39 and 52).

The study pins of ``tests/test_repro.py`` compare to the bit only where the CPU kernels compute the same bytes as the
pinned machine's. This short pin runs in the study's own worker pool under the code paths every x86-64 CPU takes
(``eval.repro.runs.NEUTRAL_KERNELS``: ATen's unvectorised kernels, MKL's COMPATIBLE branch, oneDNN at SSE4.1): a
supervised warm-up of ``WARMUP_STEPS`` updates (the study's warm-up recipe, the quick grid's batch), then
``DPO_STEPS`` updates of the preference study's offline humanline DPO arm from it, on pairs made from the warm-up's
data. Its per-update losses, gradient norms and reward margins are compared with the stored values within
``TOLERANCE``: a training change that moves them fails here on any machine.

Why a tolerance and a short horizon. Those kernels are not bit-identical across vendors: an Intel Xeon (AVX-512)
agreed with the AMD EPYC pin to 1e-6 through warm-up update 19, then drifted to 4.6e-6 at update 20 (the old 30-update
warm-up; Adam turns rounding noise in near-zero gradients into full-size steps, so drift grows fast after ~13
updates). The horizon is therefore 12 warm-up and 8 DPO updates. Measured on an AMD EPYC (2026-12-03) with three kernel
sets that compute other bytes (neutral, the studies' AVX2 set, the CPU's own AVX-512), the largest gap over this
horizon was 1.0e-7 relative on the warm-up losses, 6.5e-7 on the gradient norms and 5.6e-8 absolute on the margins;
``TOLERANCE`` is 15 times that. The planted change (``hl_core/objectives/dpo_losses.py``: the sigmoid loss scaled by
1.0001) moves ``dpo_loss`` and ``dpo_grad_norm`` by 1e-4 relative from the first DPO update, 10 times the tolerance:
this test failed with it and passed once it was reverted (2026-12-03), and
``test_the_pin_tolerance_catches_the_planted_scale`` keeps that margin checked. Not x86-64: skipped."""

from __future__ import annotations

import json
import math
import platform

import pytest

from helpers import REPO, read_jsonl

PIN = REPO / "tests" / "fixtures" / "repro_neutral_pin.json"
WARMUP_STEPS, DPO_STEPS, PAIRS = 12, 8, 96
# (relative, absolute) per key: losses and norms relative; the margins (a difference of two sums, near 0) absolute
TOLERANCE = {"warmup_loss": (1e-5, 0.0), "warmup_grad_norm": (1e-5, 0.0), "dpo_loss": (1e-5, 0.0),
             "dpo_grad_norm": (1e-5, 0.0), "dpo_margin": (0.0, 1e-6)}
PLANTED_SCALE = 1.0001  # the planted loss change the pin must catch


def make_pairs(rows, n: int):
    """Preference pairs from the warm-up's own rows: the answer, against it with its last digit moved by one."""
    pairs = []
    for row in rows[:n]:
        answer = row["completion"]
        wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
        pairs.append({"prompt": row["prompt"], "chosen": answer, "rejected": wrong})
    return pairs


def moved(pinned: dict, actual: dict, tolerance: dict = TOLERANCE):
    """The first ``(key, index, pinned, actual)`` where ``actual`` differs from ``pinned`` beyond the key's
    ``(relative, absolute)`` tolerance, else None. A key missing from ``actual``, or of another length, differs."""
    for key, values in pinned.items():
        got = actual.get(key)
        if got is None or len(got) != len(values):
            return key, None, values, got
        rel, abs_ = tolerance[key]
        for i, (a, b) in enumerate(zip(values, got)):
            if not math.isclose(a, b, rel_tol=rel, abs_tol=abs_):
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


def test_the_pin_tolerance_catches_the_planted_scale(neutral):
    """The planted change scales the first DPO update's loss and gradient (the reference equals the policy there, so
    nothing else moves): the values scaled so are caught, with room to spare; the values themselves are not."""
    _, values, _ = neutral
    assert moved({k: values[k] for k in TOLERANCE}, values) is None
    for key in ("dpo_loss", "dpo_grad_norm"):
        planted = {**values, key: [values[key][0] * PLANTED_SCALE, *values[key][1:]]}
        assert moved(values, planted)[:2] == (key, 0)
        third = {**values, key: [values[key][0] * (1 + (PLANTED_SCALE - 1) / 3), *values[key][1:]]}
        assert moved(values, third)[:2] == (key, 0), "the tolerance leaves less than 3x room below the planted change"


def test_the_pin_compares_strictly():
    pinned = {"dpo_loss": [1.0, 2.0]}
    assert moved(pinned, {"dpo_loss": [1.0, 2.0]}) is None
    assert moved(pinned, {"dpo_loss": [1.0, 2.0 * (1 + 1e-4)]}) == ("dpo_loss", 1, 2.0, 2.0 * (1 + 1e-4))
    assert moved(pinned, {"dpo_loss": [1.0]})[0] == "dpo_loss" and moved(pinned, {})[0] == "dpo_loss"
    assert moved({"dpo_margin": [0.0]}, {"dpo_margin": [5e-7]}) is None
    assert moved({"dpo_margin": [0.0]}, {"dpo_margin": [2e-6]}) is not None
    pairs = make_pairs([{"prompt": "1+2=", "completion": "003"}, {"prompt": "5+4=", "completion": "009"}], 2)
    assert pairs == [{"prompt": "1+2=", "chosen": "003", "rejected": "004"},
                     {"prompt": "5+4=", "chosen": "009", "rejected": "000"}]
