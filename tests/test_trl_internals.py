"""Every TRL and transformers internal the adapter touches is in one table (``internals.INTERNALS``), checked when a
humanline trainer is built: removing any one of them (a method, a helper, a config field, an attribute TRL's
``__init__`` sets) or reordering a method whose order the adapter relies on gives ``UnsupportedTrlError`` naming it,
in one paragraph. The table is what the TRL page shows. TRL calling the reference before the policy (or on other
inputs) is refused on the first update; so is a TRL release that reports no version, or one outside the range."""

import importlib
import sys

import pytest

from helpers import REPO
from trl_common import dpo, grpo, kto

trl = pytest.importorskip("trl")

from hl_core.errors import UserError  # noqa: E402
from hl_core.integrations.trl import (  # noqa: E402
    HumanlineDPOTrainer,
    HumanlineGRPOTrainer,
    HumanlineKTOTrainer,
    UnsupportedTrlError,
    check_trl,
    internals,
)
from hl_core.integrations.trl.compat import fused_head_available, supported_release  # noqa: E402

CLASSES = {"DPOTrainer": HumanlineDPOTrainer, "KTOTrainer": HumanlineKTOTrainer, "GRPOTrainer": HumanlineGRPOTrainer}
BUILDERS = {"DPOTrainer": dpo, "KTOTrainer": kto, "GRPOTrainer": grpo}
APPLICABLE = [(entry, next(t for t in entry.trainers if entry.applies(t, trl.__version__)))
              for entry in internals.INTERNALS if any(entry.applies(t, trl.__version__) for t in entry.trainers)]


def _id(case):
    entry, trainer = case
    return f"{entry.kind}-{entry.owner_path(trainer).split('.')[-1]}.{entry.name}"


def reordered(tmp_path, entry):
    """A method whose body makes ``entry``'s calls in the reverse order (a real file, so its source reads)."""
    body = "\n".join(f"    {needle}" for needle in reversed(entry.needs))
    path = tmp_path / f"reordered_{entry.name.strip('_')}.py"
    path.write_text(f"def method(self):\n    return '''\n{body}\n    '''\n")
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(path.stem).method
    finally:
        sys.path.remove(str(tmp_path))


def remove(monkeypatch, tmp_path, entry, trainer):
    """Take ``entry`` away from the installed TRL/transformers for this test."""
    owner = internals._resolve(entry.owner_path(trainer))
    if entry.kind == "field":
        monkeypatch.delitem(owner.__dataclass_fields__, entry.name)
    elif entry.kind == "order":
        monkeypatch.setattr(owner, entry.name, reordered(tmp_path, entry))
    elif internals.on_instance(entry):  # set by TRL's __init__: taken off the built trainer
        trl_class = getattr(trl, trainer)
        init = trl_class.__init__

        def init_without(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if isinstance(self, owner):
                delattr(self, entry.name)
            else:  # accelerate's, set only under DeepSpeed: a trainer that says it runs under DeepSpeed lacks it
                self.is_deepspeed_enabled = True

        monkeypatch.setattr(trl_class, "__init__", init_without)
    elif entry.kind == "attribute":
        monkeypatch.delattr(owner, entry.name)
    else:
        monkeypatch.setattr(owner, entry.name, None)


@pytest.mark.parametrize("case", APPLICABLE, ids=[_id(c) for c in APPLICABLE])
def test_removing_any_internal_is_refused_naming_it(case, monkeypatch, tmp_path, weights):
    entry, trainer = case
    remove(monkeypatch, tmp_path, entry, trainer)
    with pytest.raises(UnsupportedTrlError) as info:
        if internals.on_instance(entry):
            BUILDERS[trainer](weights, tmp_path)
        else:
            CLASSES[trainer]("unused-model", args=None, train_dataset=None)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message, message
    assert entry.label(trainer) in message and "Fix:" in message, message


def test_the_installed_trl_holds_every_internal():
    assert supported_release(trl.__version__) and len(APPLICABLE) > 30
    for trainer in CLASSES:
        check_trl(trainer)


def test_the_trl_page_shows_the_table():
    page = (REPO / "docs" / "howto" / "trl.md").read_text()
    assert internals.markdown() in page, "docs/howto/trl.md: paste `python3 tools/trl_internals.py` into the page"


@pytest.mark.parametrize("version, says", [("unknown", "`unknown`, which is no release"),
                                           ("1.13.0", "trl 1.13.0 is outside"), ("1.17.0", "trl 1.17.0 is outside")])
def test_a_version_that_is_no_supported_release_is_refused(monkeypatch, version, says):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(UnsupportedTrlError) as info:
        HumanlineDPOTrainer("unused-model", args=None, train_dataset=None)
    message = str(info.value)
    assert "\n" not in message and says in message and "trl>=1.14,<1.17" in message, message


def test_the_supported_releases_are_1_14_to_1_16():
    assert [supported_release(v) for v in ("1.13.2", "1.14.0", "1.15.1", "1.16.0", "1.16.1.dev0", "1.17.0",
                                           "unknown")] == [False, True, True, True, True, False, False]


def _fake_losses(order):
    """A stand-in for TRL's ``DPOTrainer._compute_loss`` that calls the models in ``order`` (its parameters are
    TRL's, so the construction check passes)."""

    def _compute_loss(self, model, inputs, return_outputs=False):
        ids = next(v for v in inputs.values() if hasattr(v, "dim") and v.dim() == 2 and not v.is_floating_point())
        fused = {"fused_lm_head": True, "labels": ids} if fused_head_available() else {}  # as TRL calls them
        for who in order:
            if who == "reference":
                self.ref_model(input_ids=ids, **fused)
            elif who == "reference-other":
                self.ref_model(input_ids=ids.flip(0), **fused)
            else:
                out = model(input_ids=ids, **fused)
        return (out.log_probs if fused else out.logits).float().mean()

    return _compute_loss


@pytest.mark.parametrize("order, says", [(("reference", "policy"), "called the reference model before the policy"),
                                         (("policy", "reference-other"), "on other inputs than the policy's")])
def test_trl_calling_the_reference_first_or_on_other_inputs_is_refused_on_the_first_update(
        order, says, monkeypatch, weights, tmp_path):
    monkeypatch.setattr(trl.DPOTrainer, "_compute_loss", _fake_losses(order))
    trainer = dpo(weights, tmp_path, args={"max_steps": 1})
    with pytest.raises(UnsupportedTrlError) as info:
        trainer.train()
    message = str(info.value)
    assert "\n" not in message and says in message and "_compute_loss" in message, message
