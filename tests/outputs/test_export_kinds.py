"""An export's recorded kind (``rlhf_lit.json``) is checked where it is loaded, both ways, before any model
loads: a reward-model export as a policy base, a policy export as the reward model (and critic init)."""

from __future__ import annotations

import json

import pytest

from rlhf_lit.cli import main
from rlhf_lit.models.export import ExportKindError, check_export_kind
from tests.tiny_runs import REPO_ROOT, in_repo_root


def fake_export(folder, kind: str | None):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    meta = {"format": "rlhf_lit", "version": 1, "weights": "merged"}
    if kind is not None:
        meta["kind"] = kind
    (folder / "rlhf_lit.json").write_text(json.dumps(meta))
    return str(folder)


def test_check_export_kind(tmp_path):
    rm = fake_export(tmp_path / "rm", "reward_model")
    policy = fake_export(tmp_path / "sft", "policy")
    old = fake_export(tmp_path / "old", None)  # the first exports recorded no kind: policies
    check_export_kind(policy, "policy", "k")
    check_export_kind(old, "policy", "k")
    check_export_kind(str(tmp_path), "policy", "k")  # not an export: a plain folder passes
    with pytest.raises(ExportKindError, match="'reward_model' export .* but a 'policy' export is expected"):
        check_export_kind(rm, "policy", "model.init_args.backbone.name_or_path")


def run(args, capsys):
    with in_repo_root(), pytest.raises(SystemExit) as exit_:
        main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return exit_.value.code, err


def test_reward_model_export_as_sft_policy_base_is_refused(tmp_path, capsys):
    rm = fake_export(tmp_path / "rm", "reward_model")
    text = (REPO_ROOT / "configs" / "sft" / "tiny.yaml").read_text()
    tiny = (
        "tiny: {model_type: gpt2, n_layer: 2, n_embd: 64, n_head: 2, n_positions: 512}\n      tokenizer: byte"
    )
    assert tiny in text
    config = tmp_path / "sft_from_rm.yaml"
    config.write_text(text.replace(tiny, f"name_or_path: {rm}"))
    code, err = run(
        [
            "fit",
            "--config",
            str(config),
            f"--trainer.default_root_dir={tmp_path}/run",
            f"--model.init_args.export_dir={tmp_path}/hf",
        ],
        capsys,
    )
    assert code == 2 and 1 <= len(err) <= 3 and "Traceback" not in "\n".join(err), err
    assert rm in err[0] and "'reward_model' export" in err[0] and "not a 'policy' export" in err[0], err
