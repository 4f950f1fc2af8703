"""Fixed and adaptive KL controllers (Ziegler et al. 2019, section 2.2; the formula in docs/pitfalls.md: adaptive KL)."""

import io

import pytest
import torch

from rlhf_lit.rl.kl_control import AdaptiveKLController, FixedKLController, build_kl_controller


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=512)
    assert ctl.value == 0.05
    assert ctl.state_dict() == {"value": 0.05}


def test_adaptive_controller_hand_numbers():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    # KL 9: 9/6 - 1 = 0.5 -> clipped to 0.2; beta = 0.1 * (1 + 0.2 * 256/10000) = 0.100512
    ctl.update(current_kl=9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    # KL 5.4: 5.4/6 - 1 = -0.1 (inside the clip); beta = 0.100512 * (1 - 0.1 * 0.0256) = 0.10025468928
    ctl.update(current_kl=5.4, n_steps=256)
    assert ctl.value == pytest.approx(0.10025468928, rel=1e-12)


def test_adaptive_controller_clips_below_and_holds_at_target():
    ctl = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    ctl.update(0.0, 256)  # 0/6 - 1 = -1 -> -0.2: beta = 0.1 * (1 - 0.2 * 0.0256) = 0.099488
    assert ctl.value == pytest.approx(0.099488, rel=1e-12)
    ctl.update(6.0, 256)  # at the target: error 0, no change
    assert ctl.value == pytest.approx(0.099488, rel=1e-12)
    ctl.update(torch.tensor(12.0), 0)  # no samples: no change; a 0-dim tensor is accepted
    assert ctl.value == pytest.approx(0.099488, rel=1e-12)


def test_adaptive_property_direction_follows_kl():
    values = []
    for kl in (3.0, 5.0, 6.0, 7.0, 9.0):
        ctl = AdaptiveKLController(0.2, target_kl=6.0, horizon=1000)
        ctl.update(kl, 100)
        values.append(ctl.value)
    assert values == sorted(values) and values[2] == 0.2


def test_state_dict_round_trip_through_torch_save():
    ctl = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    for kl in (9.0, 1.0, 7.3):
        ctl.update(kl, 64)
    buffer = io.BytesIO()
    torch.save(ctl.state_dict(), buffer)
    buffer.seek(0)
    restored = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    restored.load_state_dict(torch.load(buffer))
    assert restored.value == ctl.value  # bit-for-bit
    ctl.update(8.0, 64)
    restored.update(8.0, 64)
    assert restored.value == ctl.value


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=100)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target_kl=1.0, horizon=0)
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="finite"):
        AdaptiveKLController(0.1, 1.0, 100).update(float("nan"), 10)


def test_build_kl_controller():
    assert isinstance(
        build_kl_controller(0.05, adaptive=False, target_kl=None, horizon=10000), FixedKLController
    )
    ctl = build_kl_controller(0.05, adaptive=True, target_kl=6.0, horizon=10000)
    assert isinstance(ctl, AdaptiveKLController) and ctl.value == 0.05 and ctl.target_kl == 6.0
    with pytest.raises(ValueError, match="adaptive KL control needs target_kl"):
        build_kl_controller(0.05, adaptive=True, target_kl=None, horizon=10000)
