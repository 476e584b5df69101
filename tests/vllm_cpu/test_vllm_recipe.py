"""The online GRPO digits recipe learns with ``rollout.backend: vllm``, and raises held-out reward at least as far as
the HF sampler in the same number of updates (the recipe's 30): at one process over six rollout seeds, and at two
processes (ZeRO-2 and ZeRO-3).

What "at least as far" can mean here. The two samplers draw from the same distribution (tests/vllm_cpu/
test_vllm_sampler.py: the log-probs vLLM reports equal the policy's within 1e-4 after every push) with different random
streams, so one run of each is one draw of each: over rollout seeds 0-3 the HF sampler's final held-out reward spread
over 0.068, as wide as any difference between the samplers. The comparison is therefore over seeds: every run starts
from the same weights (the same seeded random init), so the same start policy, and the held-out reward it reaches at
update 30 is compared by a one-sided Welch test: vLLM's mean over the seeds may not lie below HF's by more than
``T`` standard errors of the difference (about 2.5% one-sided). Each run must also learn (``GAIN``).

Negative control: the same comparison, for a vLLM engine that keeps the weights of its first push (it rolls out and
evaluates the start policy throughout), must fail. The numbers are printed (``-s``) and stated in
docs/results/vllm.md.

All runs use the tiny model's head_dim-32 variant (vLLM's CPU attention needs head_dim >= 32), the HF ones too, so the
two samplers train the same model. Held-out reward: ``eval.jsonl`` (64 held-out prompts, one sample each).
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
from digits_seeds import COMMON, RECIPE
from vllm_helpers import REPO, run_python, torchrun

SEEDS = "0,1,2,3,4,5"
UPDATES = 30
GAIN = 1.0  # the random-init model starts near -2 (long garbage); learning the answer's shape is worth > 1
T = 2.23  # Student's t at 97.5%, 10 degrees of freedom (6 + 6 seeds)
T_ONE_RUN = 3.0  # a single run (world size 2) against HF's mean: three standard errors (were the samplers equal,
# such a test would fail on about one machine in several hundred; at 2.23, one in 40)


def ends(runs: dict) -> list:
    return [rows[-1]["reward"] for rows in runs.values()]


def learned(runs: dict) -> None:
    for seed, rows in runs.items():
        assert (rows[0]["step"], rows[-1]["step"]) == (0, UPDATES), seed
        assert rows[-1]["reward"] - rows[0]["reward"] > GAIN, (seed, rows[0]["reward"], rows[-1]["reward"])


def shortfall(vllm_ends: list, hf_ends: list, vllm_sd: float, t: float = T) -> tuple:
    """``(how far vLLM's mean lies below HF's, the allowed margin)``: ``t`` standard errors of the difference of the
    means; ``vllm_sd`` is the seed-to-seed spread of one vLLM run (measured over the seeds)."""
    hf_sd = statistics.stdev(hf_ends)
    margin = t * math.sqrt(vllm_sd ** 2 / len(vllm_ends) + hf_sd ** 2 / len(hf_ends))
    return statistics.fmean(hf_ends) - statistics.fmean(vllm_ends), margin


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    out = {}
    for backend, extra in (("hf", []), ("vllm", ["--stale", "0,1"])):
        path = tmp_path_factory.mktemp(f"digits-{backend}") / "out.json"
        run_python([REPO / "tests/vllm_cpu/digits_seeds.py", path, backend, SEEDS, *extra], timeout=400)
        out[backend] = json.loads(path.read_text())
    return out


def test_digits_learns_with_vllm_at_least_as_far_as_hf_over_seeds(seeds):
    hf, vllm = seeds["hf"]["fresh"], seeds["vllm"]["fresh"]
    learned(hf)
    learned(vllm)
    start = statistics.fmean(rows[0]["reward"] for runs in (hf, vllm) for rows in runs.values())  # one start policy
    behind, margin = shortfall(ends(vllm), ends(hf), statistics.stdev(ends(vllm)))
    for name, runs in (("hf", hf), ("vllm", vllm)):
        finals = ends(runs)
        print(f"{name}: held-out reward at update {UPDATES} over rollout seeds {SEEDS}: "
              f"{', '.join(f'{e:.3f}' for e in finals)}; mean {statistics.fmean(finals):.3f} "
              f"(sd {statistics.stdev(finals):.3f}), gain from the start policy's {start:.3f}: "
              f"+{statistics.fmean(finals) - start:.3f}")
    print(f"vllm's mean lies {behind:+.3f} below hf's (allowed: {margin:.3f})")
    assert behind <= margin


def test_the_comparison_fails_for_an_engine_that_keeps_its_first_weights(seeds):
    hf, stale = seeds["hf"]["fresh"], seeds["vllm"]["stale"]
    behind, margin = shortfall(ends(stale), ends(hf), statistics.stdev(ends(seeds["vllm"]["fresh"])))
    print(f"stale engine: held-out reward at update {UPDATES}: {', '.join(f'{e:.3f}' for e in ends(stale))}; "
          f"{behind:+.3f} below hf's mean (allowed: {margin:.3f})")
    assert behind > margin


@pytest.mark.parametrize("zero", [2, 3])
def test_digits_learns_with_vllm_at_two_processes(tmp_path, seeds, zero):
    """Rollout seed 0 at world size 2: it learns, and its final held-out reward is not below HF's mean over the seeds
    by more than ``T_ONE_RUN`` standard errors of one run."""
    torchrun([REPO / "launchers/run.py", RECIPE, "rollout.backend=vllm", f"engine.zero_stage={zero}", "rollout.seed=0",
              f"output_dir={tmp_path}", *COMMON], nproc=2)
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    learned({0: rows})
    behind, margin = shortfall([rows[-1]["reward"]], ends(seeds["hf"]["fresh"]),
                               statistics.stdev(ends(seeds["vllm"]["fresh"])), t=T_ONE_RUN)
    print(f"world 2, ZeRO-{zero}: held-out reward {rows[0]['reward']:.3f} -> {rows[-1]['reward']:.3f}; "
          f"{behind:+.3f} below hf's mean (allowed: {margin:.3f})")
    assert behind <= margin
