"""Metric keys are declared up front (objective, humanline transform, data source, ``loss``), so the trainer
reduces one fixed-size tensor per update at any world size; a metric nobody declared is an error."""

import datetime
import functools
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port
from hl_core.config import HumanlineConfig
from hl_core.humanline.recipe import build_transform, transform_names
from hl_core.loop.metrics import MetricMeans, declared_metric_keys
from hl_core.loop.sources import OfflineSource
from hl_core.objectives import OBJECTIVES, ObjectiveInputs
from hl_core.rollout import RolloutSource


class _OneProcess:
    """The engine's side of a reduction, in one process; records what is reduced."""

    device = torch.device("cpu")

    def __init__(self):
        self.reduced = []

    def all_reduce_sum(self, values):
        self.reduced.append(values.numel())
        return values.clone()


def test_an_undeclared_metric_is_an_error_naming_key_and_objective():
    acc = MetricMeans(("loss", "rewards/margin"), "dpo")
    acc.add({"loss": 1.0, "rewards/margin": 0.5})
    with pytest.raises(RuntimeError) as info:
        acc.add({"loss": 1.0, "rewards/typo": 0.5})
    assert "`rewards/typo`" in str(info.value) and "`dpo`" in str(info.value) and "METRIC_KEYS" in str(info.value)


def test_weighted_means_per_key_and_unreported_keys_left_out():
    engine = _OneProcess()
    acc = MetricMeans(("a", "b", "loss", "never"), "kto")
    acc.add({"loss": 1.0, "a": 2.0})
    acc.add({"loss": 3.0, "b": 4.0}, weight=3.0)
    acc.add({"a": 10.0}, weight=0.0)  # a zero-weight (dummy) example counts for nothing
    assert acc.reduce(engine) == {"a": 2.0, "b": 4.0, "loss": 2.5}
    assert engine.reduced == [8]  # one reduction: a sum and a weight per declared key
    assert MetricMeans(("a", "loss"), "kto").reduce(engine) == {} and engine.reduced == [8, 4]


def _objective_config(name):
    from hl_core.config import OBJECTIVE_CONFIGS

    return OBJECTIVE_CONFIGS[name](name=name)


def _make_inputs(name, transform):
    torch.manual_seed(0)
    rows, length = 4, 6
    policy, reference = torch.randn(rows, length) - 2, torch.randn(rows, length) - 2
    mask = torch.ones(rows, length)
    mask[:, :2] = 0
    batch = {}
    if name == "kto":
        batch = {"kl_input_ids": torch.zeros(rows, length, dtype=torch.long),
                 "kl_attention_mask": torch.ones(rows, length),
                 "kl_completion_mask": mask.clone(), "desirable": torch.tensor([True, False, True, False]),
                 "kl_same_prompt": torch.tensor([False, False, True, False])}
    if name == "grpo":
        batch = {"scores": torch.tensor([1.0, 0.0, 0.5, 0.2]), "group_ids": torch.tensor([0, 0, 1, 1])}
    log_ratios, _ = transform(policy, reference, mask)
    return ObjectiveInputs(
        batch=batch, policy_logps=policy, ref_logps=reference, mask=mask, log_ratios=log_ratios, transform=transform,
        token_logps=lambda b, model: torch.randn(rows, length) - 2, humanline_active=True, has_reference=True,
    )


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_each_objective_reports_exactly_its_declared_keys(name):
    spec = OBJECTIVES[name]
    transform = build_transform(HumanlineConfig(transform="none"))
    _, metrics = spec.batch_loss(_objective_config(name), _make_inputs(name, transform))
    assert set(metrics) == set(spec.metric_keys)  # these inputs make every optional metric appear
    assert len(set(spec.metric_keys)) == len(spec.metric_keys)


@pytest.mark.parametrize("name", transform_names())
def test_each_transform_reports_exactly_its_declared_keys(name):
    transform = build_transform(HumanlineConfig(transform=name), seed=0)
    mask = torch.ones(2, 5)
    _, metrics = transform(torch.randn(2, 5), torch.randn(2, 5), mask)
    assert set(metrics) == set(transform.METRIC_KEYS)


def test_declared_keys_are_loss_objective_transform_and_source_sorted():
    clip = build_transform(HumanlineConfig(transform="clip"))
    keys = declared_metric_keys(OBJECTIVES["grpo"], clip, RolloutSource.METRIC_KEYS)
    assert keys == tuple(sorted(keys)) and "loss" in keys and "unclamped_frac" in keys
    assert {"reward_mean", "ratio/mean", "kl/mean"} <= set(keys)
    assert declared_metric_keys(OBJECTIVES["sft"], clip, OfflineSource.METRIC_KEYS) == (
        "loss", "sft/nll", "sft/ppl", "unclamped_frac")


def _reduce_worker(rank, world_size, port, out_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from hl_core.engines.base import Engine

        def no_gather(*args, **kwargs):
            raise AssertionError("metric names must not be gathered")

        dist.all_gather_object = no_gather
        # the base's reduction alone (the one member MetricMeans uses), on a stand-in with what it reads
        engine = SimpleNamespace(world_size=world_size, device=torch.device("cpu"))
        engine.all_reduce_sum = functools.partial(Engine.all_reduce_sum, engine)
        acc = MetricMeans(("desirable", "loss", "nowhere", "undesirable"), "kto")
        # rank 0 sees only desirable examples, rank 1 only undesirable ones
        acc.add({"loss": 1.0 + rank, ("undesirable" if rank else "desirable"): 10.0 * (rank + 1)})
        result = acc.reduce(engine)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_reporting_different_keys_reduce_in_one_fixed_collective(tmp_path):
    out = tmp_path / "reduced.json"
    mp.spawn(_reduce_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    assert json.loads(out.read_text()) == {"desirable": 10.0, "loss": 1.5, "undesirable": 20.0}
