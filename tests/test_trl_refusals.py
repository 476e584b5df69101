"""The TRL settings the humanline adapter cannot honour are refused in one paragraph naming the setting and the fix,
before any model is touched: Liger's fused loss where TRL computes the loss inside it (trl 1.14), TRL's precomputed
reference log-probs and TRL's own reference sync. (The releases and internals: ``test_trl_internals.py``; every
other kind of bad input: ``test_trl_doors.py``.)"""

import pytest

trl = pytest.importorskip("trl")

from hl_core.errors import UserError  # noqa: E402
from hl_core.humanline import NoTransform  # noqa: E402
from hl_core.integrations.trl import (  # noqa: E402
    HumanlineDPOTrainer,
    HumanlineGRPOTrainer,
    HumanlineKTOTrainer,
    HumanlineTrlSettingError,
)


def test_liger_is_refused_where_trl_computes_the_loss_inside_its_kernel(monkeypatch, tmp_path):
    """trl 1.14 (no fused LM head): Liger's fused loss. From 1.15 on, ``use_liger_kernel`` swaps layer kernels only."""
    from trl import GRPOConfig

    from hl_core.integrations.trl import compat

    monkeypatch.setattr(compat, "fused_head_available", lambda: False)
    config = GRPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, report_to=[], bf16=False)
    with pytest.raises(HumanlineTrlSettingError, match=r"use_liger_kernel=True.*fused kernel.*per-token"):
        HumanlineGRPOTrainer("unused-model", reward_funcs=[], args=config, train_dataset=None,
                             transform=NoTransform())


@pytest.mark.parametrize("cls, config_name", [(HumanlineDPOTrainer, "DPOConfig"), (HumanlineKTOTrainer, "KTOConfig")])
@pytest.mark.parametrize("setting, match", [
    ({"precompute_ref_log_probs": True}, "precompute_ref_log_probs=True"),
    ({"sync_ref_model": True}, "on_step_end"),
])
def test_settings_it_does_not_compute_are_refused(cls, config_name, tmp_path, setting, match):
    config = getattr(trl, config_name)(output_dir=str(tmp_path), report_to=[], bf16=False, **setting)
    with pytest.raises(HumanlineTrlSettingError, match=match) as info:
        cls("unused-model", args=config, train_dataset=None, transform=NoTransform())
    assert isinstance(info.value, UserError) and "\n" not in str(info.value) and "Fix:" in str(info.value)


def test_grpo_with_trls_own_reference_sync_is_refused(tmp_path):
    from trl import GRPOConfig

    config = GRPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, sync_ref_model=True)
    with pytest.raises(HumanlineTrlSettingError, match="on_step_end"):
        HumanlineGRPOTrainer("unused-model", reward_funcs=[], args=config, train_dataset=None)


def test_trls_own_settings_are_not_refused_with_humanline_off(tmp_path):
    """``humanline=False`` is TRL's own trainer: what TRL allows is not refused (TRL then loads the model)."""
    from hl_core.integrations.trl import HumanlineDPOConfig

    config = HumanlineDPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, precompute_ref_log_probs=True)
    with pytest.raises(Exception) as info:  # past the adapter's checks: TRL's own loading of "unused-model" fails
        HumanlineDPOTrainer("unused-model", args=config, train_dataset=None)
    assert not isinstance(info.value, HumanlineTrlSettingError)
