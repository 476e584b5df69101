"""The Python API's doors (``hl_core.humanline``, ``.functional``, ``hl_core.mcore``), given what a new user and an
attacker gave them (issue 53), one case of each kind:

* bad arguments end as a ``HumanlineUsageError`` whose one paragraph names the call, the argument and the fix;
* masked positions are exactly 0 whatever the log-probs hold there (a NaN in padding gives the loss and the gradients
  of a 0 there, bit for bit), and a non-finite value at a counted position is refused (or, with
  ``check_finite=False``, makes the metrics NaN: never counted as clipped);
* one sync per reference: a second ``ReferenceSync`` is refused until the first is closed, a tensor paired with itself
  is refused, and a reference whose parameters were replaced (``load_state_dict(assign=True)``) is refused instead of
  reported synced;
* ``ReferenceSync.load_state_dict`` refuses a damaged or foreign state (NaN/inf shards, another dtype, extra or
  missing shards, flipped bytes, a missing key, a wrong type) and changes nothing when it does;
* ``load_checkpoint_file`` refuses a pickle that would run code, in one paragraph, and nothing runs.
"""

from __future__ import annotations

import copy
import json
import math
import threading

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, RunsACommand, run_fresh
from hl_core.humanline import (
    ClipTransform,
    HumanlineStateError,
    HumanlineUsageError,
    NonFiniteLogRatioError,
    NoTransform,
    ParameterPairs,
    ReferenceSync,
    SampleTransform,
    SyncSchedule,
    SyncUsageError,
    functional,
    load_checkpoint_file,
    mask_from_labels,
    pair_parameters,
    prefix_token_logps,
    weights_only_checkpoints,
)
from hl_core.humanline.hooks import shard_checksum, state_checksum

NAN, INF = float("nan"), float("inf")


def _paragraph(info, *words) -> str:
    text = str(info.value)
    assert "\n" not in text and "Fix:" in text, text
    for word in words:
        assert word in text, (word, text)
    return text


def _models():
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.5)
    return policy, reference


def _logps(rows=4, steps=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    policy = -torch.rand(rows, steps, generator=gen) * 3
    reference = policy + 0.4 * torch.randn(rows, steps, generator=gen)
    mask = torch.ones(rows, steps)
    mask[:, 0], mask[:, -2:] = 0, 0
    return policy, reference, mask


# ------------------------------------------------------------------------------------------- bad arguments
def _vocab_logits():
    return torch.randn(2, 3, 5), torch.tensor([[1, 2, 7], [0, 1, 2]])


BAD_CALLS = [
    # (case, the call, words its paragraph holds)
    ("SyncSchedule(every=1.5)", lambda: SyncSchedule(every=1.5), ["`every`", "whole number"]),
    ('SyncSchedule(every="2")', lambda: SyncSchedule(every="2"), ["`every`", "'2'"]),
    ("SyncSchedule(offset=0.5)", lambda: SyncSchedule(every=2, offset=0.5), ["`offset`"]),
    ("SyncSchedule(offset=k)", lambda: SyncSchedule(every=2, offset=2), ["`offset`", "[0, 1]"]),
    ("SyncSchedule(every=True)", lambda: SyncSchedule(every=True), ["`every`"]),
    ("SyncSchedule(mix=nan)", lambda: SyncSchedule(mix=NAN), ["`mix`", "finite"]),
    ("SyncSchedule(mix=0)", lambda: SyncSchedule(mix=0.0), ["`mix`"]),
    ("ReferenceSync(pairs, 2)", lambda: ReferenceSync(pair_parameters(*_models()), 2), ["`schedule`", "SyncSchedule("]),
    ("ReferenceSync(pairs, SyncSchedule)", lambda: ReferenceSync(pair_parameters(*_models()), SyncSchedule),
     ["the class `SyncSchedule`"]),
    ("ReferenceSync(a list)", lambda: ReferenceSync(list(pair_parameters(*_models()))), ["`pairs`", "pair_parameters"]),
    ("ReferenceSync(updates_done=-1)", lambda: ReferenceSync(pair_parameters(*_models()), updates_done=-1),
     ["`updates_done`"]),
    ("before_optimizer_step('3')", lambda: ReferenceSync(pair_parameters(*_models())).before_optimizer_step("3"),
     ["`updates_done`"]),
    ("attach(a module)", lambda: ReferenceSync(pair_parameters(*_models())).attach(torch.nn.Linear(2, 2)),
     ["`target`", "torch optimizer"]),
    ("SampleTransform(beta_R=inf)", lambda: SampleTransform(beta_R=INF), ["`beta_R`", "finite"]),
    ("SampleTransform(gamma_P=0)", lambda: SampleTransform(gamma_P=0.0), ["`gamma_P`"]),
    ("SampleTransform(seed=-1)", lambda: SampleTransform(seed=-1), ["`seed`"]),
    ("NoTransform(0.5, 1)", lambda: NoTransform(0.5, 1.0), ["NoTransform()", "`log_eps_P`"]),
    ("ClipTransform(-1, nan)", lambda: ClipTransform(-1.0, NAN), ["`log_eps_R`"]),
    ("ClipTransform(check_finite=1)", lambda: ClipTransform(check_finite=1), ["`check_finite`"]),
    ("[B, 1] reference log-probs", lambda: ClipTransform()(_logps()[0], _logps()[1][:, :1], _logps()[2]),
     ["`ref_logps`", "no broadcasting"]),
    ("[B, 1] mask", lambda: ClipTransform()(_logps()[0], _logps()[1], _logps()[2][:, :1]), ["`mask`", "[4, 6]"]),
    ("a mask of another shape", lambda: NoTransform()(_logps()[0], _logps()[1], torch.ones(4, 5)), ["`mask`"]),
    ("1-D log-probs", lambda: SampleTransform()(_logps()[0][0], _logps()[1][0], _logps()[2][0]),
     ["`policy_logps`", "2-D"]),
    ("integer log-probs", lambda: ClipTransform()(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3),
                                                  torch.ones(2, 3)), ["`policy_logps`", "floating-point"]),
    ("a 0.5 in the mask", lambda: ClipTransform()(*_logps()[:2], _logps()[2] * 0.5), ["`mask`", "0 or 1"]),
    ("1-D labels", lambda: mask_from_labels(torch.tensor([5, 6, -100])), ["`labels`", "labels[None]"]),
    ("float labels", lambda: mask_from_labels(torch.zeros(2, 3)), ["`labels`", "integer"]),
    ("mask dtype int", lambda: mask_from_labels(torch.zeros(2, 3, dtype=torch.long), dtype=torch.long), ["`dtype`"]),
    ("an id outside the vocabulary", lambda: prefix_token_logps(*_vocab_logits()),
     ["`input_ids`", "[0, 5)", "id 7 at [0, 2]", "tensor parallel"]),
    ("ids of another shape", lambda: prefix_token_logps(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)),
     ["`input_ids`"]),
    ("temperature 0", lambda: prefix_token_logps(torch.randn(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 8, 0.0),
     ["`temperature`"]),
    ("pair_parameters(p, p)", lambda: (lambda model: pair_parameters(model, model))(_models()[0]),
     ["separate model"]),
    ("a shallow copy sharing parameters", lambda: pair_parameters(*(lambda m: (m, copy.copy(m)))(_models()[0])),
     ["separate model"]),
    ("ParameterPairs((w, t, t))", lambda: ParameterPairs([("w", *[torch.ones(2)] * 2)]), ["tensor with itself"]),
    ("pair_parameters(a tensor)", lambda: pair_parameters(torch.ones(2), torch.ones(2)), ["`policy`", "nn.Module"]),
    ("mix_into other dtypes", lambda: functional.mix_into(torch.ones(2), torch.ones(2, dtype=torch.float64), 0.5),
     ["`policy`", "dtype"]),
    ("log_beta_sample(a=inf)", lambda: functional.log_beta_sample((3,), INF, 1.0), ["`a`"]),
    ("log_beta_sample(shape=3)", lambda: functional.log_beta_sample(3, 1.0, 1.0), ["`shape`"]),
    ("clip_log_ratio(bounds)", lambda: functional.clip_log_ratio(torch.zeros(2), 0.1, 1.0), ["`log_eps_P`"]),
    ("unclamped_fraction(shapes)", lambda: functional.unclamped_fraction(torch.zeros(2, 3), torch.ones(2, 1), -1, 1),
     ["`mask`"]),
    ("weights_only_checkpoints(a module)", lambda: weights_only_checkpoints(torch.nn.Linear(2, 2)),
     ["`model_engine`", "DeepSpeed engine"]),
    ("load_checkpoint_file(3)", lambda: load_checkpoint_file(3), ["`path`"]),
]


@pytest.mark.parametrize("case, call, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_bad_argument_is_one_paragraph_naming_it(case, call, words):
    with pytest.raises(HumanlineUsageError) as info:
        call()
    _paragraph(info, *words)
    assert isinstance(info.value, ValueError)


def test_an_infinite_beta_is_refused_before_any_draw_and_never_hangs():
    outcome = []

    def build_and_draw():
        try:
            SampleTransform(beta_R=INF)(*_logps())
        except HumanlineUsageError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=build_and_draw, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive() and outcome, "SampleTransform(beta_R=inf) hung"


# ------------------------------------------------------------------------------------------- masked positions
TRANSFORMS = [lambda: NoTransform(), lambda: ClipTransform(-0.1, 0.1), lambda: SampleTransform(seed=3)]


def _dpo_loss(log_ratios):
    half = log_ratios.shape[0] // 2
    return -F.logsigmoid(0.1 * (log_ratios[:half].sum(-1) - log_ratios[half:].sum(-1))).mean()


@pytest.mark.parametrize("make", TRANSFORMS, ids=["none", "clip", "sample"])
@pytest.mark.parametrize("poison", [NAN, INF, -INF])
def test_anything_at_a_masked_position_gives_the_loss_of_a_zero_there_bit_for_bit(make, poison):
    policy, reference, mask = _logps()
    results = []
    for value in (0.0, poison):
        pol, ref = policy.clone(), reference.clone()
        pol[mask == 0], ref[:, -1] = value, value  # the policy's padding and the reference's last column
        pol.requires_grad_(True)
        log_ratios, metrics = make()(pol, ref, mask)
        loss = _dpo_loss(log_ratios)
        loss.backward()
        results.append((log_ratios.detach(), loss.detach(), pol.grad, {k: float(v) for k, v in metrics.items()}))
    (ratios0, loss0, grad0, metrics0), (ratios1, loss1, grad1, metrics1) = results
    assert torch.equal(ratios0, ratios1) and bool((ratios1[mask == 0] == 0).all())
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1) and metrics0 == metrics1


@pytest.mark.parametrize("objective", ["dpo", "kto", "grpo"])
def test_the_trainers_objectives_give_the_loss_and_metrics_of_a_zero_at_a_masked_nan(objective):
    """Through the transform our trainer builds (``check_finite=False``) and the objective's loss and metrics."""
    from types import SimpleNamespace

    from hl_core.config.sections import DPOObjective, GRPOObjective, KTOObjective
    from hl_core.humanline.recipe import build_transform
    from hl_core.objectives import OBJECTIVES, ObjectiveInputs

    cfg = {"dpo": DPOObjective, "kto": KTOObjective, "grpo": GRPOObjective}[objective](name=objective)
    transform = build_transform(SimpleNamespace(transform="clip", log_eps_P=-0.1, log_eps_R=0.1))
    policy, reference, mask = _logps()
    batch = {"scores": torch.tensor([1.0, 0.0, 0.5, 0.2]), "group_ids": torch.tensor([0, 0, 1, 1]),
             "desirable": torch.tensor([1, 0, 1, 0]), "kl_input_ids": torch.zeros(4, 6, dtype=torch.long),
             "kl_attention_mask": torch.ones(4, 6, dtype=torch.long), "kl_completion_mask": mask.long()}
    results = []
    for value in (0.0, NAN):
        pol = policy.clone()
        pol[mask == 0] = value
        log_ratios, _ = transform(pol, reference, mask)
        inputs = ObjectiveInputs(batch=batch, policy_logps=pol, ref_logps=reference, mask=mask, log_ratios=log_ratios,
                                 transform=transform, token_logps=lambda b, model, t=1.0: reference,
                                 humanline_active=True)
        loss, metrics = OBJECTIVES[objective].batch_loss(cfg, inputs)
        results.append((loss, {k: float(v) for k, v in metrics.items()}))
    assert torch.equal(results[0][0], results[1][0]) and math.isfinite(float(results[1][0]))
    assert results[0][1] == results[1][1], (results[0][1], results[1][1])


@pytest.mark.parametrize("make", TRANSFORMS, ids=["none", "clip", "sample"])
@pytest.mark.parametrize("poison", [NAN, INF, -INF])
def test_a_non_finite_counted_log_prob_refuses_the_update_and_is_never_counted_clipped(make, poison):
    policy, reference, mask = _logps()
    reference[1, 2] = poison
    with pytest.raises(NonFiniteLogRatioError) as info:
        make()(policy, reference, mask)
    _paragraph(info, "`ref_logps`", "[1, 2]", "refused")
    transform = make()
    transform.check_finite = False  # a loop whose guard reads the metrics (our trainer's)
    log_ratios, metrics = transform(policy, reference, mask)
    assert all(math.isnan(float(v)) for v in metrics.values()), metrics
    assert not math.isfinite(float(log_ratios[1, 2])) or isinstance(transform, ClipTransform)
    assert float(log_ratios[0, 2]) == float(log_ratios[0, 2])  # the other positions are untouched


@pytest.mark.parametrize("make", TRANSFORMS, ids=["none", "clip", "sample"])
def test_an_empty_batch_gives_an_empty_result(make):
    log_ratios, metrics = make()(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5))
    assert log_ratios.shape == (0, 5) and float(metrics["unclamped_frac"]) == 1.0
    assert float(metrics.get("rejected_frac", 0.0)) == 0.0


# ------------------------------------------------------------------------------------------- one sync per reference
def test_a_second_sync_on_one_reference_is_refused_until_the_first_is_closed():
    policy, reference = _models()
    first = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(mix=0.5))
    with pytest.raises(SyncUsageError) as info:
        ReferenceSync(pair_parameters(policy, reference), SyncSchedule(mix=0.5))
    _paragraph(info, "already driven", "close()")
    before = [r.detach().clone() for r in reference.parameters()]
    first.before_optimizer_step(0)  # one sync per update: half way, not three quarters
    for r, b, p in zip(reference.parameters(), before, policy.parameters()):
        assert torch.equal(r, torch.lerp(b, p, 0.5))
    first.close()
    second = ReferenceSync(pair_parameters(policy, reference))
    with pytest.raises(SyncUsageError):
        first.before_optimizer_step(1)
    assert second.before_optimizer_step(1).synced


@pytest.mark.parametrize("attached", [False, True])
def test_replaced_reference_parameters_are_refused_not_reported_synced(attached):
    policy, reference = _models()
    sync = ReferenceSync(pair_parameters(policy, reference))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    if attached:
        sync.attach(optimizer)
    reference.load_state_dict({k: v.clone() for k, v in policy.state_dict().items()}, assign=True)
    with pytest.raises(SyncUsageError) as info:
        optimizer.step() if attached else sync.before_optimizer_step(0)
    _paragraph(info, "were replaced since pair_parameters", "assign=True")
    assert sync.num_syncs == 0 and sync.last_record is None


# ------------------------------------------------------------------------------------------- verified loads
def _saved_state():
    policy, reference = _models()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    sync.before_optimizer_step(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    sync.before_optimizer_step(1)
    return sync.state_dict()


RESTAMPED = ("a NaN shard", "an inf shard", "another dtype", "an extra shard", "a missing shard", "another schedule")


def _poisoned(case, change):
    """The saved state, changed; for a change state_dict() itself could have written (a diverged run's NaN, another
    layout's shards), with its checksum written again, so that the check behind the checksum is what refuses."""
    state = _saved_state()
    change(state)
    if case in RESTAMPED:
        state["checksum"] = state_checksum(state)
        state["shard_checksums"] = {name: shard_checksum(t) for name, t in state["reference_shards"].items()}
    return state


def _set_shard(state, value):
    state["reference_shards"]["0.weight"][0, 0] = value


def _flip_bytes(state):
    state["reference_shards"]["1.bias"].view(torch.uint8)[1] ^= 0x10


STATES = [
    ("a NaN shard", lambda s: _set_shard(s, NAN), ["NaN or infinite"]),
    ("an inf shard", lambda s: _set_shard(s, INF), ["NaN or infinite"]),
    ("another dtype", lambda s: s["reference_shards"].update({"0.bias": s["reference_shards"]["0.bias"].double()}),
     ["torch.float64", "torch.float32"]),
    ("an extra shard", lambda s: s["reference_shards"].update({"2.weight": torch.zeros(1)}),
     ["not paired here ['2.weight']"]),
    ("a missing shard", lambda s: s["reference_shards"].pop("1.weight"), ["missing ['1.weight']"]),
    ("flipped bytes", _flip_bytes, ["checksum does not match", "`1.bias`"]),
    ("a damaged count", lambda s: s.update(updates_seen=3), ["checksum does not match", "the counts and schedule"]),
    ("a missing key", lambda s: s.pop("num_syncs"), ["lacks ['num_syncs']"]),
    ("no checksum", lambda s: s.pop("checksum"), ["lacks ['checksum']", "before checksums"]),
    ("an unknown key", lambda s: s.update(extra=1), ["unknown keys ['extra']"]),
    ("a count of the wrong type", lambda s: s.update(updates_seen="2"), ["`updates_seen`"]),
    ("a schedule of the wrong type", lambda s: s.update(schedule=[2, 0, 1.0]), ["`schedule`"]),
    ("shards of the wrong type", lambda s: s.update(reference_shards=[1, 2]), ["`reference_shards`"]),
    ("another schedule", lambda s: s["schedule"].update(every=3), ["SyncSchedule(every=3", "SyncSchedule(every=2"]),
    ("not a dict", lambda s: None, ["`state`"]),
]


@pytest.mark.parametrize("case, change, words", STATES, ids=[c[0] for c in STATES])
def test_a_damaged_or_foreign_sync_state_is_refused_and_changes_nothing(case, change, words):
    state = "a string" if case == "not a dict" else _poisoned(case, change)
    policy, reference = _models()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    before = [r.detach().clone() for r in reference.parameters()]
    with pytest.raises(HumanlineStateError) as info:
        sync.load_state_dict(state)
    _paragraph(info, "load_state_dict", "Nothing was loaded", *words)
    assert all(torch.equal(r, b) for r, b in zip(reference.parameters(), before))
    assert (sync.updates_seen, sync.num_syncs) == (0, 0)


def test_an_intact_state_round_trips_through_a_file_and_a_damaged_file_is_refused(tmp_path):
    state = _saved_state()
    path = tmp_path / "sync.pt"
    torch.save(state, path)
    policy, reference = _models()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    sync.load_state_dict(load_checkpoint_file(path))
    assert (sync.updates_seen, sync.num_syncs) == (2, 1)
    assert all(torch.equal(r, state["reference_shards"][n]) for n, r in reference.named_parameters())
    data = bytes(path.read_bytes())
    weights = data.find(state["reference_shards"]["0.weight"].numpy().tobytes())
    assert weights > 0 and data.find(b"reference_shards") > 0
    for at in (weights + 5, data.find(b"reference_shards") + 3):  # in a tensor's bytes, in the pickle's keys
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        path.write_bytes(bytes(flipped))
        with pytest.raises(HumanlineStateError) as info:
            sync.load_state_dict(load_checkpoint_file(path))
        assert "\n" not in str(info.value) and "Fix:" in str(info.value)


def test_a_sampling_state_of_the_wrong_kind_is_refused_and_changes_nothing():
    transform = SampleTransform(seed=1)
    transform(*_logps())
    saved = transform.state_dict()
    for bad in ({"cpu": torch.zeros(3, dtype=torch.uint8)}, {"nowhere": saved["cpu"]}, ["cpu"]):
        with pytest.raises(HumanlineStateError):
            transform.load_state_dict(bad)
        assert torch.equal(transform.state_dict()["cpu"], saved["cpu"])
    with pytest.raises(HumanlineStateError):
        ClipTransform().load_state_dict(saved)
    fresh = SampleTransform(seed=1)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh(*_logps())[0], transform(*_logps())[0])  # the same next draws


def test_a_file_that_would_run_code_is_refused_in_one_paragraph(tmp_path):
    marker, path = tmp_path / "EXECUTED", tmp_path / "humanline_rank0.pt"
    torch.save({"sync": RunsACommand(marker)}, path)
    with pytest.raises(HumanlineStateError) as info:
        load_checkpoint_file(path)
    _paragraph(info, "Nothing from it was run", "weights_only=False")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- hl_core.mcore
MCORE = """
import json, os, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from hl_core.errors import HumanlineUsageError
from hl_core import mcore

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
mcore.use_cpu()
hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[3]))
out = {}

def attempt(case, **kwargs):
    try:
        mcore.gpt_chunk_from_hf(hf, **kwargs)
        out[case] = "built"
    except HumanlineUsageError as exc:
        out[case] = str(exc)

attempt("before the parallel state", tp=1, tp_rank=0)
torch.distributed.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state as ps
ps.initialize_model_parallel(tensor_model_parallel_size=1)
attempt("tp 2 on a tp-1 state", tp=2, tp_rank=0)
attempt("tp_rank outside tp", tp=1, tp_rank=1)
attempt("pp 2 on a pp-1 state", tp=1, tp_rank=0, pp=2, pp_rank=1)
attempt("an integer dtype", tp=1, tp_rank=0, dtype=torch.long)
attempt("tp as a string", tp="1", tp_rank=0)
attempt("the matching ranks", tp=1, tp_rank=0)
try:
    mcore.causal_mask(0)
except HumanlineUsageError as exc:
    out["causal_mask(0)"] = str(exc)
json.dump(out, open(sys.argv[1], "w"))
"""


def test_gpt_chunk_from_hf_refuses_ranks_that_do_not_match_the_parallel_state(tmp_path):
    pytest.importorskip("megatron.core")
    from helpers import free_port

    script, report = tmp_path / "mcore_doors.py", tmp_path / "report.json"
    script.write_text(MCORE)
    proc = run_fresh([script, report, free_port(), REPO / "tests/fixtures/tiny/model"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(report.read_text())
    expected = {"before the parallel state": "initialize_model_parallel", "tp 2 on a tp-1 state": "`tp` must be 1",
                "tp_rank outside tp": "`tp_rank` must be a whole number (int) in [0, 0]",
                "pp 2 on a pp-1 state": "`pp` must be 1", "an integer dtype": "`dtype`",
                "tp as a string": "`tp` must be a whole number",
                "causal_mask(0)": "`seq_len`"}
    for case, words in expected.items():
        assert words in out[case] and "\n" not in out[case] and "Fix:" in out[case], (case, out[case])
    assert out["the matching ranks"] == "built"
