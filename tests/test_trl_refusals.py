"""The TRL adapter refuses, in one paragraph naming the setting and the fix, what it cannot honour: a TRL whose
internals differ from the tested version's (never a silent fall back to TRL's plain objective), Liger kernels with
clipping, and TRL settings whose objective it does not compute. Each refusal comes before any model is touched."""

import pytest

trl = pytest.importorskip("trl")

from hl_core.errors import UserError  # noqa: E402
from hl_core.humanline import NoTransform  # noqa: E402
from hl_core.integrations.trl import (  # noqa: E402
    TESTED_TRL,
    HumanlineDPOTrainer,
    HumanlineGRPOTrainer,
    HumanlineKTOTrainer,
    HumanlineTrlSettingError,
    UnsupportedTrlError,
    check_trl,
)


def test_the_installed_trl_is_the_tested_one_and_passes_the_check():
    assert trl.__version__ == TESTED_TRL
    for trainer in ("DPOTrainer", "KTOTrainer", "GRPOTrainer"):
        check_trl(trainer)


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


def test_liger_with_clipping_is_refused_and_says_why(tmp_path):
    from trl import DPOConfig

    config = DPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, report_to=[], bf16=False)
    with pytest.raises(HumanlineTrlSettingError, match=r"use_liger_kernel=True.*fused kernel.*per-token"):
        HumanlineDPOTrainer("unused-model", args=config, train_dataset=None)


@pytest.mark.parametrize("setting, match", [
    ({"loss_type": ["ipo"]}, "loss_type"),
    ({"ld_alpha": 0.5}, "ld_alpha"),
    ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True"),
    ({"sync_ref_model": True}, "on_step_end"),
])
def test_dpo_settings_it_does_not_compute_are_refused(tmp_path, setting, match):
    from trl import DPOConfig

    config = DPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **setting)
    with pytest.raises(HumanlineTrlSettingError, match=match):
        HumanlineDPOTrainer("unused-model", args=config, train_dataset=None, transform=NoTransform())


def test_kto_and_grpo_losses_it_does_not_compute_are_refused(tmp_path):
    from trl import GRPOConfig, KTOConfig

    with pytest.raises(HumanlineTrlSettingError, match="apo_zero_unpaired"):
        HumanlineKTOTrainer("unused-model", args=KTOConfig(output_dir=str(tmp_path), report_to=[], bf16=False,
                                                            loss_type="apo_zero_unpaired"), train_dataset=None)
    with pytest.raises(HumanlineTrlSettingError, match="cispo"):
        HumanlineGRPOTrainer("unused-model", reward_funcs=None, args=GRPOConfig(
            output_dir=str(tmp_path), report_to=[], bf16=False, loss_type="cispo"), train_dataset=None)
