"""The TRL adapter refuses, in one paragraph naming the setting and the fix, what it cannot honour: a TRL release
outside the supported range, or one lacking an internal it wraps (never a silent fall back to TRL's plain
objective), Liger kernels with clipping, and the TRL settings that conflict with a moving reference. Each refusal
comes before any model is touched."""

import pytest

trl = pytest.importorskip("trl")

from hl_core.errors import UserError  # noqa: E402
from hl_core.humanline import NoTransform  # noqa: E402
from hl_core.integrations.trl import (  # noqa: E402
    HumanlineDPOTrainer,
    HumanlineGRPOTrainer,
    HumanlineKTOTrainer,
    HumanlineTrlSettingError,
    UnsupportedTrlError,
    check_trl,
)
from hl_core.integrations.trl.compat import fused_head_available, supported_release  # noqa: E402


def test_the_installed_trl_is_supported_and_passes_the_check():
    assert supported_release(trl.__version__)
    for trainer in ("DPOTrainer", "KTOTrainer", "GRPOTrainer"):
        check_trl(trainer)


def test_dpo_and_kto_without_the_fused_head_need_trls_log_prob_functions(monkeypatch):
    """Without the fused LM head (trl 1.14; here also by removing it) the adapter hands DPO's and KTO's losses the
    transformed log-probs through ``selective_log_softmax*`` in the trainer's module: a TRL lacking them is refused."""
    import sys

    from trl.trainer import utils as trl_utils

    if fused_head_available():
        monkeypatch.delattr(trl_utils, "add_fused_lm_head")
    for cls, trainer in ((HumanlineDPOTrainer, "DPOTrainer"), (HumanlineKTOTrainer, "KTOTrainer")):
        module = sys.modules[getattr(trl, trainer).__module__]
        monkeypatch.delattr(module, "selective_log_softmax_and_entropy", raising=False)
        with pytest.raises(UnsupportedTrlError, match=r"selective_log_softmax_and_entropy\(logits, index"):
            cls("unused-model", args=None, train_dataset=None)


def test_the_supported_releases_are_1_14_to_1_16():
    assert [supported_release(v) for v in ("1.13.2", "1.14.0", "1.15.1", "1.16.0", "1.16.1.dev0", "1.17.0")] == \
        [False, True, True, True, True, False]


@pytest.mark.parametrize("version", ["1.13.0", "1.17.0"])
def test_a_release_outside_the_range_is_refused_even_with_every_internal(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    with pytest.raises(UnsupportedTrlError) as info:
        HumanlineDPOTrainer("unused-model", args=None, train_dataset=None)
    message = str(info.value)
    assert "\n" not in message and f"trl {version} is outside" in message and "trl>=1.14,<1.17" in message


@pytest.mark.parametrize("cls, trainer, method", [
    (HumanlineDPOTrainer, "DPOTrainer", "_compute_loss"),
    (HumanlineKTOTrainer, "KTOTrainer", "_prepare_dataset"),
    (HumanlineGRPOTrainer, "GRPOTrainer", "_get_per_token_logps_and_entropies"),
])
def test_another_trl_without_an_internal_is_refused_naming_the_version_and_what_is_missing(monkeypatch, cls,
                                                                                         trainer, method):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delattr(getattr(trl, trainer), method)
    with pytest.raises(UnsupportedTrlError) as info:
        cls("unused-model", args=None, train_dataset=None)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert "trl 1.17.0" in message and f"{trainer}.{method}(" in message and "pip install -e .[trl]" in message


def test_liger_is_refused_where_trl_computes_the_loss_inside_its_kernel(monkeypatch, tmp_path):
    """trl 1.14 (no fused LM head): Liger's fused loss. From 1.15 on, ``use_liger_kernel`` swaps layer kernels only."""
    from trl import GRPOConfig

    from hl_core.integrations.trl import compat

    monkeypatch.setattr(compat, "fused_head_available", lambda: False)
    config = GRPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, report_to=[], bf16=False)
    with pytest.raises(HumanlineTrlSettingError, match=r"use_liger_kernel=True.*fused kernel.*per-token"):
        HumanlineGRPOTrainer("unused-model", reward_funcs=[], args=config, train_dataset=None,
                             transform=NoTransform())


@pytest.mark.parametrize("setting, match", [
    ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True"),
    ({"sync_ref_model": True}, "on_step_end"),
])
def test_dpo_settings_it_does_not_compute_are_refused(tmp_path, setting, match):
    from trl import DPOConfig

    config = DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **setting)
    with pytest.raises(HumanlineTrlSettingError, match=match):
        HumanlineDPOTrainer("unused-model", args=config, train_dataset=None, transform=NoTransform())


def test_grpo_with_trls_own_reference_sync_is_refused(tmp_path):
    from trl import GRPOConfig

    config = GRPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, sync_ref_model=True)
    with pytest.raises(HumanlineTrlSettingError, match="on_step_end"):
        HumanlineGRPOTrainer("unused-model", reward_funcs=[], args=config, train_dataset=None)
