"""The vLLM sampler on real vLLM (CPU build): pushed weights are the ones used, the prefix cache is reset at every
push, ZeRO-3 pushes in buckets, and the same seeds give the same samples at world size 1 and 2.

One run of tests/vllm_cpu/push_check.py per world size (1 rank ZeRO-0; 2 ranks ZeRO-3), 7 updates each: a push before
every update, checked after it; the 7th push skips the prefix-cache reset, the negative control that shows the check
sees stale KV (so the checks of the first 6 pushes could fail).
"""

from __future__ import annotations

import json

import pytest
from vllm_helpers import REPO, torchrun

UPDATES = 7  # 6 checked pushes, then one without the reset
TOLERANCE = 1e-4  # fp32: vLLM's log-probs of its sampled tokens against the policy's own


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for world, zero in ((1, 0), (2, 3)):
        path = tmp_path_factory.mktemp(f"push-ws{world}") / "out.json"
        torchrun([REPO / "tests/vllm_cpu/push_check.py", path, zero, UPDATES, "--no-reset-last"], nproc=world)
        out[world] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_pushed_weights_are_the_ones_used(runs, world):
    for rank in runs[world]:
        checked = [u for u in rank["updates"] if u["reset"]]
        assert len(checked) >= 6
        for u in checked:
            assert u["long_prompts"] >= 1 and u["prompts"] >= 3  # a prompt longer than two 128-token KV blocks
            assert u["max_logp_diff"] < TOLERANCE, (rank["rank"], u["update"], u["max_logp_diff"])
            assert u["greedy_equal"] == u["prompts"], (rank["rank"], u["update"], u["vllm_greedy"], u["hf_greedy"])
        # the weights moved between pushes: the greedy completions are not those of the first push throughout
        assert any(u["vllm_greedy"] != checked[0]["vllm_greedy"] for u in checked[1:]), "the updates changed nothing"


@pytest.mark.parametrize("world", [1, 2])
def test_without_the_prefix_cache_reset_the_check_fails(runs, world):
    """The last push skipped ``reset_prefix_cache``: the long prompts' KV came from the previous weights, and the
    log-prob check sees it (the short ones, within one block, are never cached)."""
    for rank in runs[world]:
        stale = rank["updates"][-1]
        assert not stale["reset"]
        assert stale["max_logp_diff_long"] > 100 * TOLERANCE, stale["max_logp_diff_long"]


def test_zero3_pushes_in_buckets(runs):
    for rank in runs[2]:
        sizes, limit = rank["bucket_bytes"], rank["bucket_limit"]
        assert len(sizes) > 2 and sum(sizes) == rank["params_bytes"]
        # a parameter over the limit (the embedding, the LM head) is a bucket of its own; never the whole model
        assert max(sizes) <= max(limit, rank["largest_param_bytes"]) < rank["params_bytes"]


def test_same_seeds_same_samples_at_world_size_1_and_2(runs):
    one = runs[1][0]["first_samples"]
    two = {}
    for rank in runs[2]:
        two.update(rank["first_samples"])
    assert sorted(one, key=int) == sorted(two, key=int) == [str(i) for i in range(6)]
    assert one == two
    # not trivially equal: a prompt's two samples differ, and so do different prompts' samples
    assert all(group[0] != group[1] for group in one.values())
    assert len({json.dumps(group) for group in one.values()}) == len(one)
