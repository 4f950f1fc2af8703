"""The held-out-RM experiment (``experiments.heldout_rm``) end to end on tiny models, and its report's arithmetic.

Two tiny BERT-style reward models (a WordPiece tokenizer: a cross-tokenizer pairing with the byte-level
policy) are trained by the reward stage on the two halves (``train_part``) of HH-style pairs; ``main`` then
checks they share one validation split, writes the prompt files, runs 2 PPO iterations of a tiny GPT-2
against RM-A through ``rlhf-lit fit``'s own parser, and evaluates before and after with both.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import yaml

from experiments.heldout_rm import check_disjoint, main, summarize, verdict
from rlhf_lit import metrics as M
from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.models import BackboneConfig
from rlhf_lit.modules import RewardModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.models.encoders import wordpiece_folder
from tests.tiny_runs import one_thread

TINY_BERT = {
    "model_type": "bert",
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
TOPICS = ["bread", "cats", "rain", "maps", "tea", "bikes", "clocks", "boats", "songs", "stars"]


def _hh_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        prompt = f"\n\nHuman: Tell me about {TOPICS[i % 10]} number {i}.\n\nAssistant:"
        rows.append(
            {"chosen": prompt + f" Here is a short note on {TOPICS[i % 10]}.", "rejected": prompt + " No."}
        )
    return rows


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    rows = _hh_rows(40)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = wordpiece_folder(root / "wordpiece", [r["chosen"] for r in rows] + [" no"])
    exports = []
    with one_thread():
        for part in (0, 1):
            L.seed_everything(part, verbose=False)
            export = root / f"rm_{part}"
            module = RewardModule(
                BackboneConfig(tiny=TINY_BERT, tokenizer=tok, seed=part),
                optimizer=OptimizerConfig(lr=1e-3),
                export_dir=str(export),
            )
            data = PreferenceDataModule(
                train_files=str(pairs),
                format="hh",
                val_size=8,
                train_part=[part, 2],
                max_prompt_length=1,
                batch_size=4,
                tokenizer=module.tokenizer,
            )
            L.Trainer(
                accelerator="cpu",
                max_steps=2,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=str(root),
            ).fit(module, datamodule=data)
            exports.append(str(export))
        spec = yaml.safe_load(Path("configs/ppo/tiny.yaml").read_text())
        init = spec["model"]["init_args"]
        init["reward_model"] = {"path": exports[0], "mode": "separate"}
        init["ppo"].update(total_iterations=2, ppo_minibatch_size=2, micro_batch_size=2)
        init["sampling"]["max_new_tokens"] = 8
        init["monitor"] = {"heldout": [M.HELDOUT_RM_SCORE], "window": 3}
        # HH prompts rendered as chats for the policy; the encoder RMs get them back as HH text
        spec["data"]["init_args"].update(
            format="hh", chat_template=True, batch_size=2, train_files=["placeholder.jsonl"]
        )
        config = root / "ppo.yaml"
        config.write_text(yaml.safe_dump(spec))
        out = root / "out"
        report = main(
            [
                "--rm-a",
                exports[0],
                "--rm-b",
                exports[1],
                "--config",
                str(config),
                "--out",
                str(out),
                "--eval-prompts",
                "6",
                "--eval-batch-size",
                "3",
            ]
        )
    return {"rows": rows, "exports": exports, "out": out, "report": report, "config": config}


def test_the_evaluation_prompts_are_the_validation_pairs_and_ppo_never_trains_on_them(experiment):
    out = experiment["out"]
    train = [json.loads(line)["chosen"] for line in (out / "prompts_train.jsonl").read_text().splitlines()]
    held = [json.loads(line)["chosen"] for line in (out / "prompts_eval.jsonl").read_text().splitlines()]
    assert len(train) == 32 and len(held) == 6  # 40 pairs: 8 validation, 32 training (both halves)
    assert not set(train) & set(held) and set(train) | set(held) <= {r["chosen"] for r in experiment["rows"]}
    meta = json.loads((Path(experiment["exports"][1]) / "rlhf_lit.json").read_text())
    assert meta["data"]["train_part"] == [1, 2] and meta["data"]["val_size"] == 8


def test_the_report_holds_both_reward_models_kl_and_length_before_and_after(experiment):
    report = experiment["report"]
    assert report["prompts"] == 6 and report["iterations"] == 2
    m = report["metrics"]
    assert set(m) == {"rm_a", "rm_b", "kl_k1", "kl_k3", "length", "stopped"}
    # before any update the actor is the reference: KL is exactly 0 (LoRA's B starts at 0)
    assert m["kl_k1"]["before"] == [0.0, 0.0] and m["kl_k3"]["before"] == [0.0, 0.0]
    assert m["kl_k3"]["after"][0] > 0.0  # two PPO iterations at lr 1e-3 moved the actor
    for key in m:
        mean, se = m[key]["change"]
        assert mean == pytest.approx(m[key]["after"][0] - m[key]["before"][0], abs=1e-9)  # paired by prompt
    assert set(report["length_control"]) == {"rm_a", "rm_b"} and report["verdict"].startswith("RM-B")
    # every iteration's rollout was scored by RM-B too, and the monitor read it
    assert [h["iteration"] for h in report["history"]] == [1, 2]
    assert all(isinstance(h["rm_b"], float) for h in report["history"])
    assert report["samples"] and "response" in report["samples"][0]["after"]
    assert (experiment["out"] / "heldout_report.md").read_text().count("|") > 20


def test_reward_models_on_the_same_half_are_refused(experiment, capsys):
    a = experiment["exports"][0]
    with pytest.raises(SystemExit) as exit_info:
        main(["--rm-a", a, "--rm-b", a, "--config", str(experiment["config"]), "--out", "unused"])
    assert exit_info.value.code == 2 and "different parts" in capsys.readouterr().err


def test_check_disjoint_names_what_differs():
    record = {"train_files": ["f"], "val_size": 8, "seed": 0, "train_part": [0, 2], "max_length": 512}
    check_disjoint(record, {**record, "train_part": [1, 2]})
    with pytest.raises(ValueError, match="seed"):
        check_disjoint(record, {**record, "seed": 1, "train_part": [1, 2]})
    with pytest.raises(ValueError, match="different parts"):
        check_disjoint(record, {**record, "train_part": None})


def _evaluation(rm_b: list[float], length: list[float]) -> dict[str, list[float]]:
    zeros = [0.0] * len(rm_b)
    return {"rm_a": rm_b, "rm_b": rm_b, "kl_k1": zeros, "kl_k3": zeros, "length": length, "stopped": zeros}


def test_a_gain_that_is_only_length_is_reported_as_such():
    # after PPO every response is 10 tokens longer; within each policy the score rises ~0.1 per token:
    # S_xy = 49 + 49, S_xx = 500 + 500 -> slope 0.098. Paired changes [1.1, 0.8, 1.1, 1.0]: mean 1.0, SE
    # sqrt(0.02 / 4) = 0.0707, far above 0; the length change explains 0.098 * 10 = 0.98 of it, leaving 0.02
    # (same SE): only a length gain
    before = _evaluation([1.0, 2.1, 2.9, 4.0], [10, 20, 30, 40])
    after = _evaluation([2.1, 2.9, 4.0, 5.0], [20, 30, 40, 50])
    report = summarize(before, after)
    ctl = report["length_control"]["rm_b"]
    assert ctl["slope"] == pytest.approx(0.098)
    assert ctl["change"] == pytest.approx(1.0) and ctl["change_se"] == pytest.approx(0.0707107, rel=1e-5)
    assert ctl["length_part"] == pytest.approx(0.98) and ctl["adjusted_change"] == pytest.approx(0.02)
    assert "only a length gain" in report["verdict"]
    # the same gain at unchanged lengths is a gain beyond length
    better = summarize(
        _evaluation([1.0, 2.1, 2.9, 4.0], [10, 20, 30, 40]),
        _evaluation([2.1, 3.0, 3.8, 5.1], [10, 20, 30, 40]),
    )
    assert "beyond length" in better["verdict"]
    # no change at all, and a drop
    assert "no significant change" in verdict(
        {"change": 0.01, "change_se": 0.1, "adjusted_change": 0.0, "adjusted_change_se": 0.1}
    )
    assert "LOWER" in verdict(
        {"change": -0.5, "change_se": 0.1, "adjusted_change": -0.5, "adjusted_change_se": 0.1}
    )


@pytest.fixture(scope="module")
def arms(experiment):
    """The DPO arm on RM-A's pairs (a tiny GPT-2 on PPO's base), then the judge of the reference, DPO and PPO."""
    from experiments.heldout_rm import dpo, judge

    root, out, exports = experiment["out"].parent, experiment["out"], experiment["exports"]
    ppo_spec = yaml.safe_load(experiment["config"].read_text())
    spec = yaml.safe_load(Path("configs/dpo/tiny.yaml").read_text())
    spec["model"]["init_args"]["backbone"] = ppo_spec["model"]["init_args"]["backbone"]  # the same base
    spec["data"]["init_args"].update(
        chat_template=True, val_size=2, batch_size=4, max_train_samples_per_file=None
    )
    spec["trainer"].update(max_steps=2, enable_checkpointing=False)
    config = root / "dpo.yaml"
    config.write_text(yaml.safe_dump(spec))
    with one_thread():
        run = dpo.main(
            ["--rm-a", exports[0], "--rm-b", exports[1], "--config", str(config), "--out", str(out)]
        )
        args = [
            "--rm-a",
            exports[0],
            "--rm-b",
            exports[1],
            "--config",
            str(experiment["config"]),
            "--out",
            str(out),
        ]
        args += [
            "--prompts",
            str(out / "prompts_eval.jsonl"),
            "--eval-prompts",
            "6",
            "--eval-batch-size",
            "3",
        ]
        report = judge.main([*args, "--policy", f"dpo={out}/dpo/hf", "--policy", f"ppo={out}/ppo/hf"])
    return {"run": run, "report": report}


def test_dpo_trains_only_on_rm_a_pairs_whose_prompts_are_not_evaluated(experiment, arms):
    out, rows = experiment["out"], experiment["rows"]
    pairs = [json.loads(line) for line in (out / "pairs_train.jsonl").read_text().splitlines()]
    # 40 pairs: 8 validation, 32 training in two halves of 16; RM-A's half is what DPO trains on
    assert arms["run"]["pairs"]["train_pairs"] == 16 and len(pairs) == 16
    assert all(p in rows for p in pairs)
    held = {line for line in (out / "prompts_eval.jsonl").read_text().splitlines()}
    assert not {json.dumps({"chosen": p["chosen"]}) for p in pairs} & held
    # RM-B's half is disjoint from DPO's pairs: the two halves partition the 32 training pairs
    train_all = {
        json.loads(line)["chosen"] for line in (out / "prompts_train.jsonl").read_text().splitlines()
    }
    assert {p["chosen"] for p in pairs} < train_all and len(train_all) == 32
    assert (out / "dpo" / "hf" / "config.json").exists()


def test_a_training_pair_that_shares_an_evaluation_prompt_is_dropped(experiment, tmp_path):
    from experiments.heldout_rm.dpo import write_pair_file

    pairs = [json.loads(line) for line in (experiment["out"] / "pairs_train.jsonl").read_text().splitlines()]
    # an evaluation transcript with pair 3's prompt and another reply (HH files repeat prompts this way)
    shared = pairs[3]["chosen"].replace("Here is a short note", "Another reply")
    assert shared != pairs[3]["chosen"]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"chosen": shared}) + "\n")
    counts = write_pair_file(experiment["exports"][0], str(eval_file), str(tmp_path), None)
    written = [json.loads(line) for line in (tmp_path / "pairs_train.jsonl").read_text().splitlines()]
    assert counts["dropped_shared_prompt"] == 1 and counts["written"] == 15 == len(written)
    assert pairs[3] not in written and all(p in pairs for p in written)
    counts = write_pair_file(experiment["exports"][0], str(eval_file), str(tmp_path), 5)
    sample = [json.loads(line) for line in (tmp_path / "pairs_train.jsonl").read_text().splitlines()]
    assert counts["written"] == 5 == len(sample) and all(p in written for p in sample)


def test_the_judge_reproduces_the_ppo_runs_before_evaluation_and_sees_both_policies_move(experiment, arms):
    report, ppo = arms["report"], experiment["report"]
    ref = report["evaluations"]["reference"]
    assert report["prompts"] == 6 and set(report["summaries"]) == {"dpo", "ppo"}
    # the reference sampled with the PPO callback's seeds and settings: its "before" figures, which were the
    # actor's before any update (LoRA's B = 0: the reference exactly)
    for key in ("rm_a", "rm_b", "length"):
        assert sum(ref[key]) / 6 == pytest.approx(ppo["metrics"][key]["before"][0], abs=1e-5)
    assert ref["kl_k1"] == [0.0] * 6 and ref["kl_k3"] == [0.0] * 6
    for name in ("dpo", "ppo"):
        m = report["summaries"][name]["metrics"]
        assert m["kl_k3"]["after"][0] > 0.0  # both trained policies left the reference
        ev = report["evaluations"][name]
        assert m["rm_b"]["change"][0] == pytest.approx(sum(ev["rm_b"]) / 6 - sum(ref["rm_b"]) / 6, abs=1e-9)
    md = (experiment["out"] / "judge_report.md").read_text()
    assert "| dpo |" in md and "| ppo |" in md and "| reference |" in md


def test_the_judge_refuses_what_is_not_an_export_before_loading(experiment, capsys):
    from experiments.heldout_rm import judge

    a, b = experiment["exports"]
    for policy in ("dpo", f"dpo={experiment['out']}"):  # no '=', or a folder that is no export
        with pytest.raises(SystemExit) as exit_info:
            judge.main(["--rm-a", a, "--rm-b", b, "--policy", policy])
        assert exit_info.value.code == 2 and "NAME=FOLDER" in capsys.readouterr().err
    # a reward model that is not an export is refused before anything loads
    with pytest.raises(SystemExit) as exit_info:
        judge.main(["--rm-a", str(experiment["out"]), "--rm-b", b])
    assert exit_info.value.code == 2 and "--rm-a" in capsys.readouterr().err
