"""`train.max_tokens_per_micro_batch`: token-budget micro-batches (first-fit decreasing by real tokens) against
fixed ones through the real trainer and DeepSpeed engine: per-update losses, gradient norms and every other
metric within 1e-5 (fp32, CPU) for DPO, KTO, GRPO on offline groups and on rollouts, and SFT, with humanline
clipping and syncing on; one process and two ZeRO-3 processes (`tests/distributed/token_budget_parity.py`).
Also the bin planner, the recipe checks (exit 2 naming the key) and `--plan`."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, assert_same_rows, run_worker
from hl_core.errors import RecipeError
from hl_core.loop.micro_batches import check_budget_fits, collate_bins, fixed_bins, plan_bins, unit_tokens
from launchers.run import main

WORKER = REPO / "tests" / "distributed" / "token_budget_parity.py"
HUMANLINE_GRPO_ONLINE = "objective={name: grpo},humanline.transform=clip"  # rewards from the tiny reward model
SINGLE = [
    "recipes/tiny/humanline_dpo.yaml|train.micro_batch_size=2,train.gradient_accumulation_steps=4|160",
    "recipes/tiny/humanline_kto.yaml|train.micro_batch_size=4,train.gradient_accumulation_steps=4|150",
    "recipes/tiny/humanline_grpo.yaml|train.micro_batch_size=1,train.gradient_accumulation_steps=4,"
    "humanline.sync_every=2|300",
    # the whole update in one micro-batch: GRPO's token mean is over the update's tokens, however it is split
    "recipes/tiny/humanline_grpo.yaml|train.micro_batch_size=1,train.gradient_accumulation_steps=4|100000",
    f"recipes/tiny/online_dpo_rm.yaml|{HUMANLINE_GRPO_ONLINE},humanline.sync_every=1,train.micro_batch_size=1,"
    "train.gradient_accumulation_steps=4|300",
    "recipes/repro/warmup.yaml|train.micro_batch_size=16,train.gradient_accumulation_steps=4|100",
]
ZERO3 = [
    # a budget of 82 gives the ranks 4 and 5 micro-batches in some updates: the one with 4 runs a dummy fifth
    "recipes/tiny/humanline_kto.yaml|engine.zero_stage=3,train.micro_batch_size=4,train.gradient_accumulation_steps=4|82",
    f"recipes/tiny/online_dpo_rm.yaml|engine.zero_stage=3,{HUMANLINE_GRPO_ONLINE},objective.aggregation=dapo,"
    "humanline.sync_every=2,train.micro_batch_size=1,train.gradient_accumulation_steps=4|300",
]


# ------------------------------------------------------------------------------------------ the planner
def test_first_fit_decreasing_is_deterministic_within_budget_and_places_every_unit_once():
    costs = [5, 9, 3, 9, 2, 7, 1, 4]
    bins = plan_bins(costs, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(costs)))
    assert all(sum(costs[i] for i in b) <= 10 for b in bins)
    # largest first, ties by position: 9 (1), 9 (3), 7 (5), 5 (0), 4 (7) joins 5, 3 (2) joins 7, 2 (4) fits
    # nowhere (9 + 2, 9 + 2, 10, 9 + 2): a new bin; 1 (6) joins the first 9
    assert bins == [[1, 6], [3], [2, 5], [0, 7], [4]]
    assert plan_bins(costs, 10) == bins and plan_bins(costs, 100) == [list(range(len(costs)))]
    with pytest.raises(ValueError):
        plan_bins([3, 11], 10)
    assert fixed_bins(5, 2) == [[0, 1], [2, 3], [4]]


def test_unit_tokens_counts_every_row_of_a_unit():
    assert unit_tokens({"chosen_input_ids": [1, 2, 3], "rejected_input_ids": [1, 2]}) == 5
    assert unit_tokens({"input_ids": [[1, 2], [1, 2, 3]], "scores": [0, 1]}) == 5
    assert unit_tokens({"prompt_ids": [1, 2], "completion_ids": [3], "desirable": True}) == 3
    assert unit_tokens({"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]}) == 4


def test_kto_kl_rows_do_not_depend_on_the_split():
    """KL rows pair over the rank's whole update, so each example keeps its KL row however it is binned; an
    online pair's two examples side by side borrow different completions."""
    from hl_core.data.unpaired import collate_unpaired

    features = [{"prompt_ids": [1, 5 + i // 2], "completion_ids": [20 + i, 2], "desirable": i % 2 == 0,
                 "max_length": None} for i in range(6)]

    def collate(f, donors=None, rows=None):
        return collate_unpaired(f, 0, donors=donors, rows=rows)

    def kl_rows(bins):
        out = {}
        for b, batch in zip(bins, collate_bins(collate, features, bins)):
            out.update(zip(b, batch["kl_input_ids"].tolist()))
        return out

    whole = kl_rows([list(range(6))])
    assert kl_rows([[0, 3], [1, 2, 5], [4]]) == whole == kl_rows(fixed_bins(6, 2))
    assert [whole[i][2] for i in range(6)] == [22, 23, 24, 25, 20, 21]


def test_a_group_over_the_budget_is_refused_naming_the_key():
    data = [{"input_ids": [[1] * 10] * 4, "scores": [0, 1, 0, 1]},
            {"input_ids": [[1] * 30] * 4, "scores": [0, 1, 0, 1]}]
    check_budget_fits(120, data, "prompt group")
    with pytest.raises(RecipeError) as info:
        check_budget_fits(100, data, "prompt group")
    assert "`train.max_tokens_per_micro_batch" in str(info.value) and "prompt group 1" in str(info.value)


# ------------------------------------------------------------------------------------------ recipe checks
@pytest.mark.parametrize("recipe, override, floor", [
    ("humanline_dpo.yaml", "train.max_tokens_per_micro_batch=100", "128"),  # 2 x data.max_length 64
    ("online_grpo_math.yaml", "train.max_tokens_per_micro_batch=100", "160"),  # 4 generations x (32 + 8)
])
def test_a_budget_below_the_largest_example_is_refused(capsys, recipe, override, floor):
    assert main([str(REPO / "recipes" / "tiny" / recipe), "--validate", override]) == 2
    err = capsys.readouterr().err
    assert "`train.max_tokens_per_micro_batch" in err and f"max_tokens_per_micro_batch={floor}" in err


def test_megatron_refuses_a_token_budget(capsys):
    recipe = REPO / "recipes" / "tiny" / "megatron_humanline_dpo.yaml"
    assert main([str(recipe), "--validate", "train.max_tokens_per_micro_batch=4096"]) == 2
    err = capsys.readouterr().err
    assert "`train.max_tokens_per_micro_batch" in err and "pipeline" in err


def test_plan_scales_activations_and_logits_with_the_budget():
    from hl_core.config import load_recipe, run_shape
    from hl_core.preflight.plan import memory_plan

    recipe = REPO / "recipes" / "tiny" / "humanline_dpo.yaml"
    fixed = memory_plan(run_shape(load_recipe(recipe, [])))  # 8 pairs = 16 rows of 64 tokens = 1024 tokens
    budget = memory_plan(run_shape(load_recipe(recipe, ["train.max_tokens_per_micro_batch=512"])))
    assert budget["tokens_per_micro_batch"] == 512 and fixed["tokens_per_micro_batch"] == 1024
    assert budget["bytes"]["logits"] < fixed["bytes"]["logits"]
    assert budget["bytes"]["activations_full"] == pytest.approx(fixed["bytes"]["activations_full"] / 2)
    assert any("token budget" in note for note in budget["notes"])


# ------------------------------------------------------------------------------------------ parity
def _run(specs, tmp_path, nproc=1):
    out = tmp_path / "parity.json"
    run_worker(WORKER, [out, *specs], nproc=nproc)
    others = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("parity.json.rank*"))]
    return json.loads(out.read_text()), others


def _assert_same(modes, name):
    """Equal metrics, and the budget run really split updates differently (unequal micro-batches, another
    count than the fixed run's) while covering the same units per update."""
    fixed, budget = modes["fixed"], modes["budget"]
    assert all(len(set(sizes)) == 1 for sizes in modes["fixed_micro"]), name
    assert [sum(s) for s in modes["fixed_micro"]] == [sum(s) for s in modes["budget_micro"]], name
    assert any(len(b) != len(f) for f, b in zip(modes["fixed_micro"], modes["budget_micro"])), name
    assert len(fixed) == len(budget) == 3
    assert_same_rows(fixed, budget, name, tol=1e-5)


def test_token_budget_equals_fixed_micro_batches_one_process(tmp_path):
    results, _ = _run(SINGLE, tmp_path)
    assert len(results) == len(SINGLE)
    for name, modes in results.items():
        _assert_same(modes, name)
        losses = [row["loss"] for row in modes["fixed"]]
        assert losses[0] != losses[-1], name  # the runs train: the loss moves


def test_token_budget_equals_fixed_micro_batches_zero3_two_processes(tmp_path):
    results, others = _run(ZERO3, tmp_path, nproc=2)
    for name, modes in results.items():
        _assert_same(modes, name)
    # ranks ran as many micro-batches, some rank padding with a dummy one (0 units) in at least one update
    assert others and all(len(o[name]["budget_micro"][u]) == len(modes["budget_micro"][u])
                          for o in others for name, modes in results.items() for u in range(3))
    assert any(0 in sizes for r in [results, *others] for name in results for sizes in r[name]["budget_micro"])
