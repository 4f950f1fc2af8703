"""Length-controlled reward training: the pure terms by hand, and the module's loss assembled from them.

Functional (``rlhf_lit.functional.length_control``): balance weights, Pearson correlation, head orthogonality;
``LengthControl.terms`` on literal tensors (decorrelation, ODIN's length head and orthogonality); the
``shift`` helpers evaluate uses (``mean_and_sd``, Cohen's d) and ``pair_credit``. Module: a tiny reward
model's ``training_step`` loss equals the weighted pairwise loss plus the penalty recomputed from its own
scores; ODIN's length head trains but is neither used for validation nor exported.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.data.collate import PreferenceCollator
from rlhf_lit.functional.length_bias import pair_credit
from rlhf_lit.functional.length_control import head_orthogonality, length_balance_weights, pearson_correlation
from rlhf_lit.functional.shift import mean_and_sd, standardized_mean_difference
from rlhf_lit.models import BackboneConfig
from rlhf_lit.models.heads import ScalarHead
from rlhf_lit.modules import RewardModule
from rlhf_lit.modules.reward_length import LengthControl
from tests.conftest import TINY_GPT2
from tests.evaluation.test_evaluate import ROWS


# ---------------------------------------------------------------------------------------------- functional
def test_length_balance_weights_by_hand():
    # (10, 5), (8, 4), (6, 3) chosen longer (n_L = 3); (2, 9) shorter (n_S = 1); (5, 5) equal
    # longer: (3 + 1) / (2 * 3) = 2/3; shorter: 4 / (2 * 1) = 2; equal: 1. Each group then weighs 2.
    w = length_balance_weights(torch.tensor([10, 8, 6, 2, 5]), torch.tensor([5, 4, 3, 9, 5]))
    torch.testing.assert_close(w, torch.tensor([2 / 3, 2 / 3, 2 / 3, 2.0, 1.0]))
    # edge: no chosen-shorter pair, nothing to balance
    torch.testing.assert_close(
        length_balance_weights(torch.tensor([3, 4]), torch.tensor([1, 2])), torch.ones(2)
    )


def test_pearson_correlation_by_hand_and_against_corrcoef():
    # dx = [-1, 0, 1], dy = [-7/3, -1/3, 8/3]: sum dx dy = 5; sum dx^2 = 2; sum dy^2 = 38/3 -> 5 / sqrt(76/3)
    got = pearson_correlation(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 7.0]))
    torch.testing.assert_close(got, torch.tensor(5 / math.sqrt(76 / 3)))
    # edge: a constant side gives 0 and a zero (not nan) gradient
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    zero = pearson_correlation(x, torch.tensor([4.0, 4.0, 4.0]))
    zero.backward()
    assert float(zero.detach()) == 0.0 and torch.equal(x.grad, torch.zeros(3))
    # property: equals torch.corrcoef, and is invariant to a positive affine map of either side
    a, b = torch.randn(9), torch.randn(9)
    torch.testing.assert_close(pearson_correlation(a, b), torch.corrcoef(torch.stack([a, b]))[0, 1])
    torch.testing.assert_close(pearson_correlation(3 * a + 2, b), pearson_correlation(a, b))


def test_head_orthogonality_by_hand():
    assert float(head_orthogonality(torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[2.0, -1.0, 5.0]]))) == 0.0
    assert float(head_orthogonality(torch.tensor([1.0, 2.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]))) == 3.0


def test_pair_credit_and_shift_helpers_by_hand():
    torch.testing.assert_close(
        pair_credit(torch.tensor([0.3, 0.0, -1.0])), torch.tensor([1.0, 0.5, 0.0]).double()
    )
    mean, sd = mean_and_sd(torch.tensor([1.0, 2.0, 3.0, 6.0]))  # 3, sqrt((4 + 1 + 0 + 9) / 3)
    assert mean == pytest.approx(3.0) and sd == pytest.approx(math.sqrt(14 / 3))
    # 30 / sqrt((900 + 1600) / 2) = 30 / 35.3553 = 0.848528
    assert standardized_mean_difference((100, 30), (130, 40)) == pytest.approx(0.848528, abs=1e-6)
    assert standardized_mean_difference((5, 0), (5, 0)) == 0.0
    assert standardized_mean_difference((5, 0), (6, 0)) == math.inf
    with pytest.raises(ValueError, match=">= 0"):
        standardized_mean_difference((0, -1), (0, 1))


# ------------------------------------------------------------------------------------------ LengthControl
LENGTHS = {"chosen_response_len": torch.tensor([4, 6]), "rejected_response_len": torch.tensor([2, 8])}
CHOSEN, REJECTED = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 0.0])


def test_decorrelation_penalty_by_hand():
    # scores [1, 3, 2, 0] (mean 1.5): d = [-.5, 1.5, .5, -1.5]; lengths [4, 6, 2, 8] (mean 5): d = [-1, 1, -3, 3]
    # sum dx dy = .5 + 1.5 - 1.5 - 4.5 = -4; sum dx^2 = 5; sum dy^2 = 20 -> rho = -4 / 10 = -0.4; 0.5 * 0.4 = 0.2
    r_c, r_r, weights, penalty = LengthControl(decorrelation_coef=0.5).terms(CHOSEN, REJECTED, dict(LENGTHS))
    torch.testing.assert_close(penalty, torch.tensor(0.2))
    assert weights is None and r_c is CHOSEN and r_r is REJECTED
    # balance: one chosen-longer (4 > 2) and one chosen-shorter (6 < 8) pair: weights 1 each, times pair_weight
    batch = {**LENGTHS, "pair_weight": torch.tensor([0.5, 1.0])}
    _, _, weights, _ = LengthControl(balance=True).terms(CHOSEN, REJECTED, batch)
    torch.testing.assert_close(weights, torch.tensor([0.5, 1.0]))
    # all off: nothing read from the batch, nothing added
    _, _, weights, penalty = LengthControl().terms(CHOSEN, REJECTED, {})
    assert weights is None and float(penalty) == 0.0


def test_odin_terms_by_hand():
    # pooled ("last") states of chosen 1, chosen 2, rejected 1, rejected 2: [1, 0], [0, 1], [1, 1], [2, 0]
    last = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    hidden = torch.stack([torch.zeros_like(last), last], dim=1)  # (4, T=2, H=2)
    mask = torch.ones(2, 2, dtype=torch.long)
    quality, length = ScalarHead(2), ScalarHead(2)
    with torch.no_grad():
        quality.linear.weight.copy_(torch.tensor([[1.0, 2.0]]))
        length.linear.weight.copy_(torch.tensor([[0.5, -1.0]]))
        length.linear.bias.zero_()
    batch = {**LENGTHS, "chosen_attention_mask": mask, "rejected_attention_mask": mask}
    control = LengthControl(odin_length_coef=1.0, odin_orthogonality_coef=0.1)
    r_c, r_r, _, penalty = control.terms(CHOSEN, REJECTED, batch, hidden, (quality, length), "last")
    # length scores: [0.5, -1, -0.5, 1] (mean 0); with length deviations [-1, 1, -3, 3]:
    # sum = -0.5 - 1 + 1.5 + 3 = 3; sum dx^2 = 2.5; sum dy^2 = 20 -> rho_L = 3 / sqrt(50) = 0.424264
    # |rho_Q| = 0.4 (test above); orthogonality |1 * 0.5 + 2 * -1| = 1.5
    # penalty = 1.0 * (0.4 - 0.424264) + 0.1 * 1.5 = 0.125736
    torch.testing.assert_close(penalty, torch.tensor(0.4 - 3 / math.sqrt(50) + 0.15))
    torch.testing.assert_close(r_c, torch.tensor([1.5, 2.0]))  # [1, 3] + [0.5, -1]
    torch.testing.assert_close(r_r, torch.tensor([1.5, 1.0]))  # [2, 0] + [-0.5, 1]


def test_invalid_settings():
    with pytest.raises(ValueError, match="decorrelation_coef"):
        LengthControl(decorrelation_coef=-1.0)
    with pytest.raises(ValueError, match="odin_length_coef"):
        LengthControl(odin_orthogonality_coef=0.1)


# ------------------------------------------------------------------------------------------------ module
def _batch(tokenizer, tmp_path) -> dict:
    """The first 7 pairs of the evaluate test: 3 chosen longer, 2 shorter, 2 of equal length."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:7]))
    data = PreferenceDataModule(train_files=[str(path)], val_size=0, format="explicit", tokenizer=tokenizer)
    data.setup("fit")
    return PreferenceCollator(tokenizer.pad_token_id)(data.train_dataset.examples)


def _plain_rho(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))


def test_module_loss_is_the_balanced_pairwise_loss_plus_the_penalty(tmp_path, monkeypatch):
    rm = RewardModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"),
        length_control={"balance": True, "decorrelation_coef": 0.5},
    )
    rm.eval()  # dropout off, so the loss and the scores below see the same forward
    monkeypatch.setattr(rm, "log", lambda *a, **k: None)  # no trainer to log to
    batch = _batch(rm.tokenizer, tmp_path)
    with torch.no_grad():
        loss = float(rm.training_step(batch, 0))
        chosen, rejected, _ = rm._score_pairs(batch)
    cs, rs = chosen.tolist(), rejected.tolist()
    lc, lr = batch["chosen_response_len"].tolist(), batch["rejected_response_len"].tolist()
    n_longer = sum(a > b for a, b in zip(lc, lr))
    n_shorter = sum(a < b for a, b in zip(lc, lr))
    both = n_longer + n_shorter
    w = [both / (2 * n_longer) if a > b else both / (2 * n_shorter) if a < b else 1.0 for a, b in zip(lc, lr)]
    pair_losses = [math.log1p(math.exp(-(c - r))) for c, r in zip(cs, rs)]
    expected = sum(wi * li for wi, li in zip(w, pair_losses)) / sum(w)
    expected += 0.5 * abs(_plain_rho(cs + rs, [float(x) for x in lc + lr]))
    assert n_longer != n_shorter  # so the balance moves the loss
    assert loss == pytest.approx(expected, abs=1e-5)


def test_odin_trains_its_length_head_but_exports_and_validates_the_quality_head(tmp_path, monkeypatch):
    rm = RewardModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), length_control={"odin_length_coef": 1.0}
    )
    monkeypatch.setattr(rm, "log", lambda *a, **k: None)
    batch = _batch(rm.tokenizer, tmp_path)
    rm.training_step(batch, 0).backward()
    assert rm.length_head is not None and rm.length_head.linear.weight.grad.abs().sum() > 0
    assert rm.head.linear.weight.grad.abs().sum() > 0
    rm.eval()
    with torch.no_grad():
        chosen, _, _ = rm._score_pairs(batch)  # validation and calibration score with the quality head alone
        alone = rm.score(batch["chosen_input_ids"], batch["chosen_attention_mask"])
    torch.testing.assert_close(chosen, alone)
    rm.export(str(tmp_path / "rm"))  # the exported head is the quality head
    exported = load_file(str(tmp_path / "rm" / "reward_head.safetensors"))
    torch.testing.assert_close(exported["weight"], rm.head.linear.weight.detach())
