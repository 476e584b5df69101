"""KTO's reference point z0 with real engines: KL rows pair each prompt with another prompt's completion
(online KTO, one prompt per micro-batch and two), zero-weight examples stay out of z0, and a dummy eval
row is weighted 0."""

import json

import pytest
import torch

from helpers import REPO, run_worker


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kto_rows")
    run_worker(REPO / "tests" / "distributed" / "kto_kl_rows.py", [out / "r.json", out])
    return json.loads((out / "r.json").read_text())


@pytest.mark.parametrize("shape", ["one_prompt", "two_prompts"])
def test_online_kl_rows_pair_a_prompt_with_another_prompts_completion(report, shape):
    """Rollouts put each prompt's best and worst completions side by side; a plain circular shift would
    pair every KL row with its own prompt's other completion (with one prompt per micro-batch: all of them)."""
    rows = report[shape]["step0"]
    assert len(rows) == 4
    assert all(r["same_prompt_tokens"] for r in rows)  # row i keeps prompt i
    assert all(r["other_prompts_completion"] for r in rows)
    assert report[shape]["same_prompt_metric"] == [0.0] * len(report[shape]["same_prompt_metric"])


def test_lone_prompt_is_flagged_in_the_metrics(report):
    """One prompt in the whole update of the only rank: no mismatched row exists, and the metric says so."""
    assert report["alone"]["same_prompt_metric"] == [1.0]
    assert not any(r["other_prompts_completion"] for r in report["alone"]["step0"])


def test_zero_weight_rows_stay_out_of_z0(report):
    """After one update (policy != reference): with only the row of the largest KL sum weighted, the
    engine's z0 is that row's sum (floored at 0), not the mean over all rows."""
    informative = 0
    for shape in ("one_prompt", "two_prompts", "alone"):
        z = report[shape]["z0"]
        sums = z["kl_sums"]
        assert z["engine_z0"] == pytest.approx(max(0.0, sums[z["weighted_row"]]), abs=1e-5)
        nonzero = [s for s in sums if s != 0]
        if sums[z["weighted_row"]] > 1e-3 and abs(max(0.0, sum(nonzero)
                                                      / len(nonzero)) - sums[z["weighted_row"]]) > 1e-3:
            informative += 1
    assert informative >= 1, "no shape could tell the weighted z0 from the unweighted one"


def test_dummy_eval_row_has_weight_zero():
    from hl_core.data.build import eval_batch
    from hl_core.data.unpaired import collate_unpaired

    def feat(p, c):
        return {"prompt_ids": [1, p], "completion_ids": [c, 2], "desirable": True, "max_length": None}

    data = [feat(5, 10), feat(5, 11), feat(6, 12)]
    collate = lambda f, donors=None: collate_unpaired(f, 0, donors=donors)  # noqa: E731
    dummy = eval_batch(collate, data, [], range(0, 3))
    assert dummy["weights"].tolist() == [0.0]
    real = eval_batch(collate, data, [0, 1], range(0, 3))
    assert "weights" not in real
    # both rows share prompt 5: the round's third row lends its completion
    assert real["kl_input_ids"].tolist() == [[1, 5, 12, 2], [1, 5, 12, 2]] and not real["kl_same_prompt"].any()
    assert torch.equal(real["input_ids"], collate_unpaired(data[:2], 0)["input_ids"])


def test_offline_unshuffled_pairs_borrow_from_the_update():
    """`data.shuffle: false` keeps a pair's halves side by side: with two examples per micro-batch each
    micro-batch holds one prompt, and its KL rows borrow from the update's other examples (other ranks' too)."""
    from types import SimpleNamespace

    from hl_core.data.build import TokenizedDataset
    from hl_core.data.unpaired import collate_unpaired
    from hl_core.loop.sources import DataOrder, OfflineSource

    features = [{"prompt_ids": [1, 5 + i // 2], "completion_ids": [20 + i, 2], "desirable": i % 2 == 0,
                 "max_length": None} for i in range(8)]
    data = TokenizedDataset(features, lambda f, donors=None: collate_unpaired(f, 0, donors=donors))

    def engine(dp_rank, accumulation):
        e = SimpleNamespace(gradient_accumulation_steps=accumulation, dp_size=2, dp_rank=dp_rank)
        e.micro_batch_positions = lambda step, m, micro: range(
            ((step * accumulation + m) * 2 + dp_rank) * micro, ((step * accumulation + m) * 2 + dp_rank + 1) * micro)
        return e

    for accumulation in (1, 2):
        for rank in (0, 1):
            source = OfflineSource(engine(rank, accumulation), 2, data, DataOrder(8, 0, shuffle=False))
            for batch in source.batches(0):
                prompts = batch["input_ids"][:, 1].tolist()
                assert len(set(prompts)) == 1 and not batch["kl_same_prompt"].any()
                borrowed = batch["kl_input_ids"][:, 2].tolist()  # first completion token = 20 + example index
                assert all((b - 20) // 2 + 5 != prompts[0] for b in borrowed)
