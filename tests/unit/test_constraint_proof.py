"""``experiments/constraint_proof.py`` (the real-prompt proof of GRPO / PPO with a verifiable constraint): its
pieces by hand, and its whole wiring (prompt files, one fit, before / after evaluation, report) on a tiny
model in seconds."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from tests.conftest import REPO_ROOT

SCRIPTS = REPO_ROOT / "experiments"


def _load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def proof():
    return _load("constraint_proof")


@pytest.fixture(scope="module")
def ev():
    return _load("constraint_eval")


def test_rows_carry_the_limit_in_the_prompt_and_in_the_constraints_field(proof):
    rows = proof.constraint_rows(["Why is the sky blue?", "Name a prime.", "Hi"], [10, 20])
    assert [r["constraints"] for r in rows] == [{"max_words": 10}, {"max_words": 20}, {"max_words": 10}]
    assert rows[1]["prompt"] == "Name a prime.\n\nAnswer in at most 20 words."
    train, heldout = proof.split_rows(rows * 4, 5, seed=0)
    assert len(train) == 7 and len(heldout) == 5
    assert proof.split_rows(rows * 4, 5, seed=0) == (train, heldout)  # seeded
    with pytest.raises(ValueError, match="--heldout"):
        proof.split_rows(rows, 3, seed=0)


def test_a_response_passes_only_when_it_ended_within_the_word_limit(ev):
    assert ev.passes("one two three", True, 3)
    assert not ev.passes("one two three four", True, 3)
    assert not ev.passes("one two", False, 3)  # cut at max_new_tokens: no answer within the limit
    assert ev.passes("", True, 3)


def test_summary_compares_against_three_standard_errors_and_the_kl_budget(ev, tmp_path):
    config = {"model": {"init_args": {"ppo": {"advantage_estimator": "grpo"}, "kl": {"target_kl": 1.0}}}}
    before = dict(pass_rate=0.5, pass_rate_se=0.03, per_prompt_pass=[0.5, 0.5])
    after = dict(pass_rate=0.7, pass_rate_se=0.04, kl=1.5, per_prompt_pass=[1.0, 0.5])
    s = ev.run_summary(config, tmp_path, 60.0, before, after)
    assert s["rise"] == pytest.approx(0.2) and s["rise_se"] == pytest.approx(0.05)
    assert s["rise_in_se"] == pytest.approx(4.0) and s["rise_above_3se"]
    assert s["kl_under_budget"] is False and s["fit_minutes"] == 1.0
    assert s["paired_rise_se"] == pytest.approx(math.sqrt(0.125 / 2))  # diffs [0.5, 0]


def test_no_budget_and_no_change_read_as_such_in_strict_json_and_markdown(ev, tmp_path):
    """A config without ``kl.target_kl`` is "no budget" (not "OVER"); a rise over an SE of 0 (identical before
    and after, per prompt too) is null / "n/a SE", not an infinity that strict JSON cannot hold."""
    config = {"model": {"init_args": {"ppo": {"advantage_estimator": "grpo"}}}}
    same = dict(pass_rate=0.5, pass_rate_se=0.0, kl=0.2, kl_se=0.0, per_prompt_pass=[0.5, 0.5], mean_words=3.0,
                eos_rate=1.0)
    s = ev.run_summary(config, tmp_path, 60.0, same, same)
    assert s["kl_under_budget"] is None and s["rise_in_se"] is None and s["paired_rise_in_se"] is None
    report = dict(n_heldout=2, samples_per_prompt=1, n_train=4, limits=[10], command="c", before=same,
                  runs={"grpo": s})
    json.dumps(report, allow_nan=False)
    md = ev.markdown(report)
    assert "(n/a SE, NOT > 3 SE; paired by prompt n/a SE)" in md and "(no budget)" in md and "OVER" not in md


def test_the_whole_proof_runs_on_a_tiny_model(proof, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"Question number {i}?") + "\n" for i in range(6)))
    out = tmp_path / "proof"
    report = proof.main(
        [
            "--out",
            str(out),
            "--prompts",
            str(prompts),
            "--runs",
            "grpo",
            "--heldout",
            "2",
            "--samples",
            "1",
            "--eval-batch",
            "2",
            "--config",
            f"grpo={REPO_ROOT / 'configs/ppo/tiny_grpo.yaml'}",
            "--set",
            "model.init_args.ppo.total_iterations=1",
            "--set",
            "model.init_args.sampling.max_new_tokens=8",
        ]
    )
    assert [len(open(out / "prompts" / f).readlines()) for f in ("train.jsonl", "heldout.jsonl")] == [4, 2]
    assert report["before"]["kl"] == 0.0 and report["before"]["n"] == 2
    run = report["runs"]["grpo"]
    assert run["estimator"] == "grpo" and run["after"]["n"] == 2
    assert 0.0 <= run["after"]["pass_rate"] <= 1.0 and math.isfinite(run["after"]["kl"])
    assert len(run["history"]) == 1  # one iteration, read back from the CSV log
    assert (out / "grpo" / "hf" / "adapter" / "adapter_config.json").is_file()
    assert json.loads((out / "report.json").read_text())["runs"]["grpo"]["rise"] == pytest.approx(run["rise"])
    assert (out / "curves.png").stat().st_size > 0 and "| grpo |" in (out / "report.md").read_text()


# --- GRPO vs DAPO vs GSPO over seeds (`--runs grpo,dapo,gspo --seeds 0,1`) ---------------------------------------

CONSTRAINT_CONFIGS = REPO_ROOT / "configs" / "ppo"


def _flat(node, prefix=""):
    """``{"a.b.c": leaf}`` of a YAML mapping."""
    if not isinstance(node, dict):
        return {prefix: node}
    out = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _family_changes(name: str) -> dict:
    """The keys of ``smollm2_constraint_<name>.yaml`` that differ from the GRPO constraint config, output paths
    (which name the config) left out."""
    import yaml

    base = _flat(yaml.safe_load((CONSTRAINT_CONFIGS / "smollm2_constraint_grpo.yaml").read_text()))
    other = _flat(yaml.safe_load((CONSTRAINT_CONFIGS / f"smollm2_constraint_{name}.yaml").read_text()))
    return {
        k: other.get(k)
        for k in base.keys() | other.keys()
        if base.get(k) != other.get(k) and f"smollm2_constraint_{name}" not in str(other.get(k))
    }


def test_the_dapo_and_gspo_configs_change_only_their_family_s_keys():
    ppo, reward = "model.init_args.ppo.", "model.init_args.reward."
    assert _family_changes("dapo") == {
        ppo + "clip_range_low": 0.2,  # Yu et al. 2025 s. 3.1
        ppo + "clip_range_high": 0.28,
        ppo + "loss_aggregation": "token_mean",  # s. 3.3
        ppo + "dynamic_sampling": True,  # s. 3.2
        ppo + "dynamic_sampling_max_rounds": 1,  # the cost cap: at most one extra round per iteration
        reward + "overlong_buffer": 8,  # eq. 13: 8 / 40 = 4096 / 20480 = 0.2
        reward + "overlong_penalty": 1.0,
    }
    assert _family_changes("gspo") == {
        ppo + "importance_sampling_level": "sequence",  # Zheng et al. 2025 eq. 5-7
        ppo + "clip_range_low": 3.0e-4,  # s. 5.1
        ppo + "clip_range_high": 4.0e-4,
        ppo + "loss_aggregation": "seq_mean_token_mean",  # written out; GRPO's default (next line)
    }
    from rlhf_lit.rl.settings import PPOConfig

    assert PPOConfig(advantage_estimator="grpo").aggregation() == "seq_mean_token_mean"


def test_seeds_parse_and_plan_whole_seeds_first(proof):
    assert proof.parse_seeds(None) is None and proof.parse_seeds("0,1") == [0, 1]
    for bad in ("0,0", "a,1", ""):
        with pytest.raises(ValueError, match="--seeds"):
            proof.parse_seeds(bad)
    assert proof.run_plan(["grpo", "gae"], None) == [("grpo", "grpo", None), ("gae", "gae", None)]
    assert proof.run_plan(["grpo", "dapo"], [0, 1]) == [
        ("grpo/seed0", "grpo", 0),
        ("dapo/seed0", "dapo", 0),
        ("grpo/seed1", "grpo", 1),
        ("dapo/seed1", "dapo", 1),
    ]


def test_method_summary_takes_the_larger_of_the_seed_and_evaluation_ses(ev):
    before = dict(pass_rate=0.3, pass_rate_se=0.03)

    def run(seed, p, p_se, kl, kl_se):
        after = dict(pass_rate=p, pass_rate_se=p_se, kl=kl, kl_se=kl_se, mean_words=10.0 + seed, eos_rate=0.9)
        return dict(seed=seed, after=after, estimator="grpo", kl_budget=6.0, fit_minutes=10.0 + 2 * seed)

    m = ev.method_summary(before, [run(0, 0.7, 0.03, 3.0, 0.2), run(1, 0.5, 0.04, 2.0, 0.2)])
    assert m["seeds"] == [0, 1] and m["pass_rate"] == pytest.approx(0.6)
    # over seeds: s = sqrt(0.1^2 + 0.1^2) = 0.1414, / sqrt(2) = 0.1; evaluation: sqrt(0.03^2 + 0.04^2) / 2 = 0.025
    assert m["pass_rate_se_seeds"] == pytest.approx(0.1) and m["pass_rate_se_eval"] == pytest.approx(0.025)
    assert m["pass_rate_se"] == pytest.approx(0.1)  # the larger
    # change 0.6 - 0.3 = 0.3 +- sqrt(0.1^2 + 0.03^2) = 0.10440: 2.87 SE, not above 3 SE
    assert m["rise"] == pytest.approx(0.3) and m["rise_se"] == pytest.approx(math.sqrt(0.0109))
    assert m["rise_se_eval"] == pytest.approx(math.sqrt(0.025**2 + 0.03**2))
    assert m["rise_in_se"] == pytest.approx(0.3 / math.sqrt(0.0109)) and not m["rise_above_3se"]
    # KL: mean 2.5, over seeds |3 - 2| / 2 = 0.5, evaluation sqrt(0.2^2 + 0.2^2) / 2 = 0.1414
    assert m["kl"] == pytest.approx(2.5) and m["kl_se"] == pytest.approx(0.5)
    assert m["kl_se_eval"] == pytest.approx(math.sqrt(0.08) / 2) and m["kl_under_budget"]
    assert m["mean_words"] == pytest.approx(10.5) and m["fit_minutes"] == pytest.approx(11.0)
    # two seeds that agree: the evaluation's SE is the floor
    same = ev.method_summary(before, [run(0, 0.8, 0.03, 4.0, 0.3), run(1, 0.8, 0.04, 5.0, 0.4)])
    assert same["pass_rate_se_seeds"] == 0.0 and same["pass_rate_se"] == pytest.approx(0.025)
    # change 0.5 +- sqrt(0.025^2 + 0.03^2) = 0.03905: 12.8 SE
    assert same["rise_se"] == pytest.approx(math.sqrt(0.001525)) and same["rise_above_3se"]
    one = ev.method_summary(before, [run(3, 0.7, 0.03, 3.0, 0.2)])  # one seed: no spread, the evaluation's SE
    assert one["pass_rate_se_seeds"] is None and one["rise_se_seeds"] is None and one["kl_se_seeds"] is None
    assert one["pass_rate_se"] == pytest.approx(0.03) and one["rise_se"] == pytest.approx(math.sqrt(0.0018))


def test_seeded_runs_train_every_run_per_seed_from_one_start_and_report_the_means(proof, tmp_path):
    """The orchestration with the fit and the evaluation injected: which config each seed trains, the report's
    per-seed runs and per-method means, and the difference to the first run (the start's SE cancels)."""
    import yaml

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"Question number {i}?") + "\n" for i in range(6)))
    out = tmp_path / "proof"
    figures = {  # (pass rate, SE, KL, SE) after each (run, seed)
        ("grpo", 0): (0.7, 0.03, 3.0, 0.2),
        ("grpo", 1): (0.5, 0.04, 2.0, 0.2),
        ("dapo", 0): (0.8, 0.03, 4.0, 0.3),
        ("dapo", 1): (0.8, 0.04, 5.0, 0.4),
    }
    fitted, evaluated = [], []

    def fit(config_path, threads, log_file):
        fitted.append(yaml.safe_load(config_path.read_text()))
        return 120.0

    def evaluate(config, adapter_dir, heldout_file, samples, batch_size, seed, threads):
        evaluated.append((adapter_dir, seed))
        if adapter_dir is None:
            p, p_se, kl, kl_se = 0.3, 0.03, 0.0, 0.0
        else:
            p, p_se, kl, kl_se = figures[(adapter_dir.parent.parent.name, config["seed_everything"])]
        return dict(pass_rate=p, pass_rate_se=p_se, kl=kl, kl_se=kl_se, n=2, mean_words=9.0, eos_rate=0.9,
                    examples=[], per_prompt_pass=[p, p])

    argv = ["--out", str(out), "--prompts", str(prompts), "--heldout", "2", "--eval-batch", "2",
            "--runs", "grpo,dapo", "--seeds", "0,1", "--seed", "5", "--set", "seed_everything=7"]
    report = proof.main(argv, fit=fit, evaluate=evaluate)
    # whole seeds first; the real configs; --seeds over --set, in both seed keys
    ppo = [c["model"]["init_args"]["ppo"] for c in fitted]
    assert [c["seed_everything"] for c in fitted] == [0, 0, 1, 1] and [p["seed"] for p in ppo] == [0, 0, 1, 1]
    assert [p.get("clip_range_high") for p in ppo] == [None, 0.28, None, 0.28]
    assert [c["trainer"]["default_root_dir"] for c in fitted] == [
        str(out.resolve() / k) for k in ("grpo/seed0", "dapo/seed0", "grpo/seed1", "dapo/seed1")
    ]
    # the start once; every evaluation with the proof's --seed, not the training seed
    assert evaluated[0][0] is None and len(evaluated) == 5 and {s for _, s in evaluated} == {5}
    assert list(report["runs"]) == ["grpo/seed0", "dapo/seed0", "grpo/seed1", "dapo/seed1"]
    assert report["seeds"] == [0, 1] and report["runs"]["dapo/seed1"]["seed"] == 1
    assert report["runs"]["grpo/seed1"]["rise"] == pytest.approx(0.2)  # 0.5 - 0.3
    grpo, dapo = report["methods"]["grpo"], report["methods"]["dapo"]
    assert grpo["rise"] == pytest.approx(0.3) and grpo["rise_se"] == pytest.approx(math.sqrt(0.0109))
    assert dapo["rise"] == pytest.approx(0.5) and dapo["kl"] == pytest.approx(4.5) and dapo["fit_minutes"] == 2.0
    # dapo - grpo: 0.8 - 0.6 = 0.2 +- sqrt(0.025^2 + 0.1^2) = 0.10308
    assert grpo["vs"] is None and dapo["vs"]["run"] == "grpo"
    assert dapo["vs"]["diff"] == pytest.approx(0.2) and dapo["vs"]["diff_se"] == pytest.approx(math.sqrt(0.010625))
    md = (out / "report.md").read_text()
    assert "## Mean over seeds [0, 1]" in md and "| vs grpo +- SE |" in md
    assert "| dapo | 0.800 +- 0.025 (0.000 / 0.025) | +0.500 +- 0.039 (12.8 SE, > 3 SE) | +0.200 +- 0.103" in md
    assert json.loads((out / "report.json").read_text())["methods"]["dapo"]["vs"]["diff"] == pytest.approx(0.2)


def test_without_seeds_the_report_has_no_means(proof, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"Q{i}?") + "\n" for i in range(4)))

    def evaluate(config, adapter_dir, **kwargs):
        return dict(pass_rate=0.5, pass_rate_se=0.1, kl=0.0, kl_se=0.0, n=2, mean_words=9.0, eos_rate=0.9,
                    examples=[], per_prompt_pass=[0.5, 0.5])

    argv = ["--out", str(tmp_path / "o"), "--prompts", str(prompts), "--heldout", "2", "--runs", "gspo"]
    report = proof.main(argv, fit=lambda *a: 60.0, evaluate=evaluate)
    assert list(report["runs"]) == ["gspo"] and "seeds" not in report and "methods" not in report
    assert "seed" not in report["runs"]["gspo"] and "Mean over seeds" not in (tmp_path / "o/report.md").read_text()
    with pytest.raises(SystemExit, match="--seeds"):
        proof.main([*argv, "--seeds", "1,1"], fit=lambda *a: 60.0, evaluate=evaluate)


def test_seeded_dapo_runs_on_a_tiny_model(proof, tmp_path):
    """The whole wiring of a seeded run with DAPO's keys (taken from the SmolLM2 config) on the tiny GRPO model:
    one seed, one iteration, in seconds."""
    import yaml

    tiny = yaml.safe_load((CONSTRAINT_CONFIGS / "tiny_grpo.yaml").read_text())
    for key, value in _family_changes("dapo").items():
        proof.set_key(tiny, key, value)
    config = tmp_path / "tiny_dapo.yaml"
    config.write_text(yaml.safe_dump(tiny))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"Question number {i}?") + "\n" for i in range(6)))
    out = tmp_path / "proof"
    report = proof.main(
        ["--out", str(out), "--prompts", str(prompts), "--runs", "dapo", "--seeds", "3", "--heldout", "2",
         "--samples", "1", "--eval-batch", "2", "--config", f"dapo={config}",
         "--set", "model.init_args.ppo.total_iterations=1", "--set", "model.init_args.sampling.max_new_tokens=8"]
    )
    effective = yaml.safe_load((out / "dapo" / "seed3" / "config.yaml").read_text())
    assert effective["seed_everything"] == 3 and effective["model"]["init_args"]["ppo"]["seed"] == 3
    run = report["runs"]["dapo/seed3"]
    assert run["seed"] == 3 and run["after"]["n"] == 2 and math.isfinite(run["after"]["kl"])
    (row,) = run["history"]  # one iteration; dynamic sampling's counts read back from the CSV log
    assert {"rollout/filtered_groups", "rollout/dynamic_sampling_rounds"} <= row.keys()
    assert (out / "dapo" / "seed3" / "hf" / "adapter" / "adapter_config.json").is_file()
    m = report["methods"]["dapo"]
    assert m["seeds"] == [3] and m["pass_rate_se_seeds"] is None and m["vs"] is None
    assert m["rise"] == pytest.approx(run["rise"]) and "| dapo |" in (out / "report.md").read_text()


def test_proofs_run_apart_per_seed_merge_into_the_report_of_one_seeded_run(proof, tmp_path):
    """Two processes, one seed each, merged (``--merge``): the same per-method means as one process running both
    seeds (the figures of the test above, by hand); a start evaluated differently is refused."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(f"Question number {i}?") + "\n" for i in range(6)))
    figures = {("grpo", 0): 0.7, ("grpo", 1): 0.5, ("dapo", 0): 0.8, ("dapo", 1): 0.8}
    start = {"pass_rate": 0.3}

    def fit(config_path, threads, log_file):
        return 120.0

    def evaluate(config, adapter_dir, heldout_file, samples, batch_size, seed, threads):
        if adapter_dir is None:
            p, se = start["pass_rate"], 0.03
        else:
            p, se = figures[(adapter_dir.parent.parent.name, config["seed_everything"])], 0.03
        return dict(pass_rate=p, pass_rate_se=se, kl=1.0, kl_se=0.1, n=2, mean_words=9.0, eos_rate=0.9,
                    examples=[], per_prompt_pass=[p, p])

    def run(seed, out):
        argv = ["--out", str(out), "--prompts", str(prompts), "--heldout", "2", "--eval-batch", "2",
                "--runs", "grpo,dapo", "--seeds", seed]
        return proof.main(argv, fit=fit, evaluate=evaluate)

    run("0", tmp_path / "s0")
    run("1", tmp_path / "s1")
    merged = proof.main(["--merge", f"{tmp_path / 's0'},{tmp_path / 's1'}", "--out", str(tmp_path / "all")])
    assert list(merged["runs"]) == ["grpo/seed0", "dapo/seed0", "grpo/seed1", "dapo/seed1"]
    assert merged["seeds"] == [0, 1]
    grpo, dapo = merged["methods"]["grpo"], merged["methods"]["dapo"]
    # grpo: mean 0.6, SE over seeds 0.1 (> the evaluation's 0.03/sqrt(2)); rise 0.3 +- sqrt(0.1^2 + 0.03^2)
    assert grpo["pass_rate"] == pytest.approx(0.6) and grpo["rise_se"] == pytest.approx(math.sqrt(0.0109))
    # dapo: both seeds 0.8, so the evaluation's SE 0.03/sqrt(2) is the floor; 0.2 above grpo
    assert dapo["pass_rate_se"] == pytest.approx(0.03 / math.sqrt(2))
    assert dapo["vs"]["diff"] == pytest.approx(0.2)
    on_disk = json.loads((tmp_path / "all" / "report.json").read_text())
    assert on_disk["methods"]["dapo"]["vs"]["diff"] == pytest.approx(0.2)
    assert "--seeds 0" in on_disk["command"] and "--seeds 1" in on_disk["command"] and "--merge" in on_disk["command"]
    assert "## Mean over seeds [0, 1]" in (tmp_path / "all" / "report.md").read_text()

    with pytest.raises(SystemExit, match="cannot merge.*run grpo/seed0 is in more than one report"):
        proof.main(["--merge", f"{tmp_path / 's0'},{tmp_path / 's0'}", "--out", str(tmp_path / "twice")])
    with pytest.raises(SystemExit, match="no report to merge"):
        proof.main(["--merge", ",", "--out", str(tmp_path / "none")])
    start["pass_rate"] = 0.4  # a start evaluated on another machine or thread count
    run("1", tmp_path / "other")
    with pytest.raises(SystemExit, match="evaluated the start policy differently"):
        proof.main(["--merge", f"{tmp_path / 's0'},{tmp_path / 'other'}", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
