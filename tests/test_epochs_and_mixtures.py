"""`train.epochs` (updates derived from the data) and `data.train` mixtures (a seeded weighted interleave of per-source
orders): the arithmetic, the order's properties, the data line and summary, the checks, `--validate` and `--plan`.
Through the real trainer with a kill and a resume: tests/test_resume.py."""

import json
import random

import pytest

from helpers import REPO, run_worker
from hl_core.config import data_plan, load_recipe, reference_cache_fields
from hl_core.data.build import DataStats, SourcePart, TokenizedDataset, build_datasets, data_summary_fields
from hl_core.errors import DataError, RecipeError
from hl_core.loop.sources import DataOrder, MixtureOrder, block_quotas, data_order, epoch_steps, updates_for_epochs
from hl_core.models.loading import load_tokenizer
from hl_core.reference.cache import fingerprint
from launchers.run import main

TINY = REPO / "recipes" / "tiny"
PREFS = REPO / "tests" / "fixtures" / "tiny" / "prefs"


def test_block_quotas_are_the_weights_rounded_to_whole_draws():
    assert block_quotas([0.7, 0.3]) == [7000, 3000]
    assert block_quotas([1, 1, 1]) == [3334, 3333, 3333]  # largest remainder, ties to the earlier source
    assert block_quotas([2, 1], block=10) == [7, 3]
    assert sum(block_quotas([0.123, 4.5, 0.0101])) == 10_000
    with pytest.raises(RecipeError, match=r"`data.train\[1\].weight`"):
        block_quotas([1.0, 1e-9])


@pytest.mark.parametrize("shuffle", [True, False])
def test_mixture_order_shares_coverage_and_purity(shuffle):
    sizes, weights, block = [50, 13, 7], [0.5, 0.3, 0.2], 100
    starts = [0, 50, 63]
    order = MixtureOrder(list(zip(starts, sizes)), weights, seed=3, shuffle=shuffle, block=block)
    stream = [order(p) for p in range(3 * block)]
    source = [0 if i < 50 else 1 if i < 63 else 2 for i in stream]
    for b in range(3):  # every block holds each source exactly its share
        assert [source[b * block:(b + 1) * block].count(s) for s in range(3)] == [50, 30, 20]
    for s, (start, size) in enumerate(zip(starts, sizes)):
        drawn = [i - start for i, k in zip(stream, source) if k == s]
        for first in range(0, len(drawn) - size + 1, size):  # each pass over a source is a permutation of it
            assert sorted(drawn[first:first + size]) == list(range(size))
        if not shuffle:
            assert drawn[:size] == list(range(size))
    fresh = MixtureOrder(list(zip(starts, sizes)), weights, seed=3, shuffle=shuffle, block=block)
    positions = list(range(3 * block))
    random.Random(0).shuffle(positions)  # a resumed run asks for positions out of the blue
    assert all(fresh(p) == stream[p] for p in positions)
    if shuffle:
        other = MixtureOrder(list(zip(starts, sizes)), weights, seed=4, shuffle=shuffle, block=block)
        assert [other(p) for p in range(block)] != stream[:block]
    else:  # evenly spread: the sources take turns, none runs in a long streak
        assert max(len(run) for run in "".join(map(str, source)).replace("1", " ").replace("2", " ").split()) <= 2


def test_one_source_mixture_is_the_one_source_order():
    single = DataOrder(37, seed=5, shuffle=True)
    mixture = MixtureOrder([(0, 37)], [1.0], seed=5, shuffle=True, block=16)
    assert [mixture(p) for p in range(200)] == [single(p) for p in range(200)]
    parts = [SourcePart("a", 1.0, 0, DataStats(examples=37))]
    assert isinstance(data_order(TokenizedDataset([{}] * 37, None), 5, True), DataOrder)
    assert isinstance(data_order(TokenizedDataset([{}] * 37, None, parts=parts), 5, True), MixtureOrder)


def test_updates_for_epochs_round_up_exactly():
    assert updates_for_epochs(2, 160, 8) == 40
    assert updates_for_epochs(0.1, 30, 3) == 1  # 0.1 x 30 is 3, not 3.0000000000000004
    assert updates_for_epochs(1.5, 20, 8) == 4  # 30 examples: the last update takes 2 from the next pass
    assert updates_for_epochs(0.001, 10, 8) == 1
    train = load_recipe(TINY / "epochs_dpo.yaml").train
    steps, line = epoch_steps(train, 150, dp_size=2, accumulation=3)
    assert steps == 7 and "ceil(2 x 150 examples / 48 per update" in line and "takes 36 example(s)" in line


@pytest.mark.parametrize("overrides, needles", [
    (["train.epochs=2"], ["both are set", "`train.epochs=2 train.max_steps=null`"]),
    (["train.max_steps=null"], ["neither is set"]),
    (["train.epochs=0", "train.max_steps=null"], ["`train.epochs` is invalid"]),
    (["data.train=[{path: a.jsonl, weight: 0}]"], ["`data.train[0].weight` is invalid"]),
    (["data.train=[{path: a.jsonl}]"], ["`data.train[0].weight`", "Missing"]),
    (["data.train=[{path: a.jsonl, wieght: 1}]"], ["`data.train[0].wieght`", "Did you mean `weight`"]),
    (["data.train.weight=0.5"], ["`data.train.weight`", "A weight belongs to a source of a mixture"]),
    (["data.train=[{path: a.jsonl, weight: 1}, {path: b.jsonl, weight: 0.00001}]"],
     ["`data.train[1].weight`", "1/10000"]),
    (["data.train=[]"], ["needs at least one source"]),
])
def test_bad_epochs_and_mixture_keys_name_the_key(overrides, needles):
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY / "humanline_dpo.yaml", overrides)
    assert all(n in str(info.value) for n in needles), str(info.value)


def test_a_mixture_path_that_does_not_exist_is_named(tmp_path):
    from hl_core.config import check_recipe

    recipe = load_recipe(TINY / "mixture_dpo.yaml", [f"output_dir={tmp_path}", "data.train=[{path: %s, weight: 1}, "
                                                     "{path: nope.jsonl, weight: 1}]" % (PREFS / "extra.jsonl")])
    with pytest.raises(RecipeError, match=r"`data.train\[1\].path: nope.jsonl` does not exist"):
        check_recipe(recipe)
    with pytest.raises(RecipeError, match="`eval.data_quality.data=...`"):
        check_recipe(load_recipe(TINY / "mixture_dpo.yaml", [f"output_dir={tmp_path}", "eval.data_quality.enabled=true",
                                                            "eval.after_training=false"]))


def test_mixture_data_line_summary_and_held_out_fraction(tmp_path, capsys):
    bad = tmp_path / "same.jsonl"  # every pair identical after tokenizing: the source is named
    bad.write_text('{"prompt": "p", "chosen": "same", "rejected": "same"}\n')
    recipe = load_recipe(TINY / "mixture_dpo.yaml", [
        "data.train=[{path: %s, weight: 3, limit: 40}, {path: %s, weight: 1}]" % (PREFS / "train.jsonl",
                                                                                 PREFS / "extra.jsonl"),
        "data.eval=null", "data.eval_fraction=0.25", "data.max_length=16", "data.max_prompt_length=8"])
    tokenizer = load_tokenizer(recipe.model)
    train, evaluation = build_datasets(recipe.data, data_plan(recipe), tokenizer, show_progress=True)
    line = capsys.readouterr().out
    assert [(p.label.rsplit("/", 1)[-1], p.weight, p.start, p.stats.examples) for p in train.parts] == [
        ("train.jsonl", 3.0, 0, 30), ("extra.jsonl", 1.0, 30, 96)]  # a quarter of each source held out
    assert len(train) == 126 and len(evaluation) == 10 + 32
    assert "126 train pairs from 2 sources [" in line and "train.jsonl: 30 at weight 0.75, 30 truncated" in line
    assert "extra.jsonl: 96 at weight 0.25, 96 truncated" in line
    fields = data_summary_fields(train, evaluation)
    sources = fields["data/train_sources"]
    assert [s["examples"] for s in sources] == [30, 96] and all(s["truncated"] == s["examples"] for s in sources)
    assert fields["data/train_examples"] == 126 and fields["data/train_truncated"] == 126
    recipe = load_recipe(TINY / "mixture_dpo.yaml", ["data.train=[{path: %s, weight: 1}, {path: %s, weight: 1}]" % (
        PREFS / "extra.jsonl", bad)])
    with pytest.raises(DataError, match=r"`data.train\[1\]` .*same.jsonl"):
        build_datasets(recipe.data, data_plan(recipe), tokenizer, show_progress=False)


def test_validate_and_plan_give_the_update_count(capsys):

    epochs = TINY / "epochs_dpo.yaml"
    assert main([str(epochs), "cluster.gpus_per_node=1", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "`train.epochs: 2` -> `train.max_steps: 40` = ceil(2 x 160 examples / 8 per update" in out
    assert main([str(epochs), "cluster.gpus_per_node=2", "--plan"]) == 0
    assert "updates: at most 20, from 160 training rows before tokenizing" in capsys.readouterr().out
    assert main([str(epochs), "data.train.path=null", "data.train.name=org/set", "--plan"]) == 0
    assert "updates: derived at run time from `train.epochs: 2`" in capsys.readouterr().out
    assert main([str(TINY / "mixture_dpo.yaml"), "cluster.gpus_per_node=1", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "640 train rows (512, 128 per source)" in out and "from 2 sources [" in out


def test_epochs_recipe_derives_its_updates_in_the_real_trainer(tmp_path):
    """`recipes/tiny/epochs_dpo.yaml` on 20 pairs: 2 passes of 8 pairs per update = 5 updates, set on the recipe the
    trainer and engine read (the LR schedule's length: linear decay to 1/3 of the peak at the last update)."""
    report = tmp_path / "report.json"
    run_worker(REPO / "tests/distributed/trainer_runs.py",
               [report, f"epochs|{TINY / 'epochs_dpo.yaml'}|data.train.limit=20,train.warmup_steps=0"])
    run = json.loads(report.read_text())["epochs"]
    assert run["max_steps"] == 5 and [r["step"] for r in run["rows"]] == [0, 1, 2, 3, 4]
    assert [r["lr"] for r in run["rows"]] == pytest.approx([1e-3 * (1 - n / 5) for n in range(5)], rel=1e-9)


def test_a_cached_reference_fingerprints_every_source_of_a_mixture():
    fields = fingerprint(reference_cache_fields(load_recipe(TINY / "mixture_dpo.yaml")), 1, 1, 1)
    assert {"data.train[0] file train.jsonl", "data.train[1] file extra.jsonl"} <= set(fields)
    single = fingerprint(reference_cache_fields(load_recipe(TINY / "humanline_dpo.yaml")), 1, 1, 1)
    assert "data.train file train.jsonl" in single
