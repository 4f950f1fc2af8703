"""Every scalar the SFT and reward stages write to TensorBoard is a name defined in ``rlhf_lit.metrics``.

The runs are the ``configs/{sft,reward,dpo}/tiny.yaml`` runs of ``tests.tiny_runs`` (2 training steps, one
validation, calibration and export). Lightning's own scalars (``epoch``, ``lr-*``, ``hp_metric``) are
exempt.
"""

from __future__ import annotations

import pytest

from rlhf_lit import metrics as M
from tests.tiny_runs import is_lightning_scalar, run_tiny

STAGES = {
    "configs/sft/tiny.yaml": {M.TRAIN_LOSS, M.VAL_LOSS, M.VAL_PERPLEXITY},
    "configs/reward/tiny.yaml": {
        M.TRAIN_LOSS,
        M.TRAIN_ACCURACY,
        M.VAL_LOSS,
        M.REWARD_ACCURACY,
        M.REWARD_MARGIN,
        M.REWARD_CHOSEN_MEAN,
        M.REWARD_REJECTED_MEAN,
        M.REWARD_ECE,
        M.REWARD_TEMPERATURE,
        M.REWARD_LENGTH_RULE_ACCURACY,
    },
    "configs/dpo/tiny.yaml": {
        M.TRAIN_LOSS,
        M.VAL_LOSS,
        *(
            name.format(split=split)
            for split in M.PREF_SPLITS
            for name in (
                M.PREF_REWARDS_CHOSEN,
                M.PREF_REWARDS_ACCURACIES,
                M.PREF_LOGPS_CHOSEN,
                M.PREF_NLL_LOSS,
            )
        ),
    },
}


@pytest.mark.parametrize("config", sorted(STAGES), ids=str)
def test_every_logged_scalar_is_a_known_metric(config, tmp_path_factory):
    names = set(run_tiny(config, tmp_path_factory).scalars())
    assert STAGES[config] <= names  # the run logged what the stage promises (so the check below has teeth)
    assert any(name.startswith("data/") for name in names)  # the data report is logged too
    unknown = sorted(name for name in names if not is_lightning_scalar(name) and not M.is_known(name))
    assert unknown == []


def test_is_known_rejects_names_outside_the_glossary():
    assert not M.is_known("val/value_loss")  # never val/ for the value head (docs/layout.md)
    assert not M.is_known("reward/acc")
    assert M.is_known("reward/accuracy/hh-rlhf_helpful-base_test")
    assert M.is_known("data/train/skipped_identical_pair")
    assert M.is_known("train/rewards/accuracies") and M.is_known("val/logps/chosen")
    assert not M.is_known("test/rewards/chosen") and not M.is_known("val/rewards/accuracy")
