"""``rlhf-lit evaluate``: every reported figure against a plain-Python recomputation from the scores.

* a tiny causal reward-model export (random head, recorded T = 1.7) scores a file of 8 pairs with chosen
  longer, shorter and of equal length; its scores are recomputed independently, pair by pair, with plain
  transformers (``[BOS] prompt response EOS``, the last hidden state through the saved head), and every figure
  of the report (accuracy and SE, both rules, the paired difference, the splits, length-matched accuracy,
  Spearman, NLL and ECE at both temperatures) is recomputed from them with loops;
* a scorer with literal scores (ties included) through the same command, the figures again by hand;
* an encoder export trained on responses alone scores exactly what its training-time module scores;
* the export records its validation pairs' summary, and a file far from it gets a warning (stderr and report);
* user mistakes: one line, exit 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_lit.cli import main as cli_main
from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.data.collate import PreferenceCollator
from rlhf_lit.evaluation import main as evaluate_main
from rlhf_lit.evaluation.scorers import TokenPair, length_sorted_batches
from rlhf_lit.models import BackboneConfig
from rlhf_lit.modules import RewardModule
from tests.conftest import TINY_GPT2

# 8 pairs: chosen longer (0, 1, 4), shorter (2, 3, 7), equal length in bytes (5, 6); pair 6 is also
# length-matched with pair 4 (11 vs 10 bytes + EOS: 12 vs 11 tokens, within 10%)
ROWS = [
    {"prompt": "Hello, how are", "chosen": " you doing on this fine day?", "rejected": " you?"},
    {"prompt": "Name a fruit:", "chosen": " an apple, or a pear", "rejected": " no"},
    {"prompt": "Say yes.", "chosen": " yes", "rejected": " I would rather not say anything"},
    {"prompt": "2+2=", "chosen": " 4", "rejected": " 5, I am quite sure of it"},
    {"prompt": "Greet me", "chosen": " hello there", "rejected": " hi there!"},
    {"prompt": "Pick a colour", "chosen": " red", "rejected": " tan"},
    {"prompt": "Pick a number", "chosen": " seven", "rejected": " eight"},
    {"prompt": "Explain gravity", "chosen": " mass attracts", "rejected": " it is a force that pulls things"},
]


# ---------------------------------------------------------------------------------------- plain Python
def credit(c: float, r: float) -> float:
    return 1.0 if c > r else 0.5 if c == r else 0.0


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n == 1:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var) / math.sqrt(n)


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(a: list[float], b: list[float]) -> float:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    sab = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    saa = sum((x - ma) ** 2 for x in a)
    sbb = sum((y - mb) ** 2 for y in b)
    return 0.0 if saa == 0 or sbb == 0 else sab / math.sqrt(saa * sbb)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def nll(margins: list[float], t: float) -> float:
    return sum(math.log1p(math.exp(-m / t)) for m in margins) / len(margins)


def ece(margins: list[float], t: float, bins: int = 10) -> float:
    """Both orderings of each pair: p = sigmoid(m/T) labelled 1, 1 - p labelled 0; equal-width bins."""
    items = [(sigmoid(m / t), 1) for m in margins] + [(sigmoid(-m / t), 0) for m in margins]
    total = 0.0
    for b in range(bins):
        inside = [(p, y) for p, y in items if min(int(p * bins), bins - 1) == b]
        if inside:
            conf = sum(p for p, _ in inside) / len(inside)
            acc = sum(y for _, y in inside) / len(inside)
            total += len(inside) / len(items) * abs(acc - conf)
    return total


def expected_report(cs: list[float], rs: list[float], lc: list[int], lr: list[int], t_rec: float) -> dict:
    n = len(cs)
    model = [credit(c, r) for c, r in zip(cs, rs)]
    longer = [1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(lc, lr)]
    shorter = [1.0 - x for x in longer]
    better = longer if sum(longer) >= sum(shorter) else shorter
    margins = [c - r for c, r in zip(cs, rs)]
    matched = [i for i in range(n) if abs(lc[i] - lr[i]) <= 0.1 * max(lc[i], lr[i])]
    return {
        "pairs": n,
        "accuracy": mean_se(model),
        "longer": mean_se(longer),
        "shorter": mean_se(shorter),
        "better": "longer_wins" if better is longer else "shorter_wins",
        "diff": mean_se([a - b for a, b in zip(model, better)]),
        "chosen_longer": mean_se([model[i] for i in range(n) if lc[i] > lr[i]]),
        "chosen_shorter": mean_se([model[i] for i in range(n) if lc[i] < lr[i]]),
        "matched": (len(matched), *mean_se([model[i] for i in matched])),
        "spearman": pearson(ranks(cs + rs), ranks([float(x) for x in lc + lr])),
        "recorded": (nll(margins, t_rec), ece(margins, t_rec)),
        "margins": margins,
    }


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def check_report(got: dict, want: dict) -> None:
    assert got["pairs"] == want["pairs"]
    assert close(got["accuracy"], want["accuracy"][0]) and close(got["accuracy_se"], want["accuracy"][1])
    for key, name in (("longer", "longer_wins"), ("shorter", "shorter_wins")):
        assert close(got[name]["accuracy"], want[key][0]) and close(got[name]["accuracy_se"], want[key][1])
    assert got["better_rule"] == want["better"]
    assert close(got["vs_better_rule"]["difference"], want["diff"][0])
    assert close(got["vs_better_rule"]["se"], want["diff"][1])
    for key in ("chosen_longer", "chosen_shorter"):
        assert close(got[key]["accuracy"], want[key][0]) and close(got[key]["accuracy_se"], want[key][1])
    assert got["length_matched"]["pairs"] == want["matched"][0]
    assert close(got["length_matched"]["accuracy"], want["matched"][1])
    assert close(got["length_matched"]["accuracy_se"], want["matched"][2])
    assert close(got["score_length_spearman"], want["spearman"], 1e-4)
    recorded = got["calibration"]["recorded"]
    assert close(recorded["nll"], want["recorded"][0], 1e-4) and close(
        recorded["ece"], want["recorded"][1], 1e-4
    )
    refit = got["calibration"]["refit"]
    t, margins = refit["temperature"], want["margins"]
    # the re-fitted T minimises the NLL over [0.01, 100] (a local minimum in log T, or the bound the NLL still
    # falls towards), and its NLL / ECE are those at T
    neighbours = [x for x in (t * 1.02, t / 1.02) if 0.01 <= x <= 100]
    assert all(nll(margins, t) <= nll(margins, x) + 1e-9 for x in neighbours)
    assert refit["at_bound"] == (t in (0.01, 100.0))
    assert close(refit["nll"], nll(margins, t), 1e-4) and close(refit["ece"], ece(margins, t), 1e-4)


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def causal_export(tmp_path_factory) -> Path:
    torch.manual_seed(3)
    module = RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    with torch.no_grad():
        module.head.linear.weight.normal_(std=0.5)
        module.temperature.fill_(1.7)
    module.eval()
    folder = tmp_path_factory.mktemp("causal") / "rm"
    module.export(str(folder))
    return folder


def _write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _scores_by_hand(folder: Path, rows: list[dict]) -> tuple[list[float], list[float], list[int], list[int]]:
    """Each sequence alone, no padding: ids of prompt (BOS if the tokenizer adds one), response, EOS; the
    trunk's last hidden state at the last token through the head's weight and bias (uncalibrated)."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    head = load_file(str(folder / "reward_head.safetensors"))
    out: dict[str, list] = {"chosen": [], "rejected": [], "len_chosen": [], "len_rejected": []}
    for row in rows:
        for side in ("chosen", "rejected"):
            response = tok(row[side], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = tok(row["prompt"])["input_ids"] + response
            with torch.no_grad():
                hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
            out[side].append(float(hidden @ head["weight"][0] + head["bias"][0]))
            out[f"len_{side}"].append(len(response))
    return out["chosen"], out["rejected"], out["len_chosen"], out["len_rejected"]


# ---------------------------------------------------------------------------------------- tests
def test_every_figure_matches_a_plain_recomputation(causal_export, tmp_path, capsys):
    data = _write_rows(tmp_path / "pairs.jsonl", ROWS)
    out = tmp_path / "out"
    cli_main(["evaluate", "--model", str(causal_export), "--data", data, "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| accuracy (ties count 1/2) |" in printed and "re-fitted on these pairs" in printed

    chosen, rejected, len_c, len_r = _scores_by_hand(causal_export, ROWS)
    assert {a > b for a, b in zip(len_c, len_r)} == {True, False} and len_c[5] == len_r[
        5
    ]  # the file's design
    per_pair = [json.loads(line) for line in (out / "pairs.scores.jsonl").read_text().splitlines()]
    assert [p["chosen_tokens"] for p in per_pair] == len_c and [
        p["rejected_tokens"] for p in per_pair
    ] == len_r
    torch.testing.assert_close(torch.tensor([p["chosen_score"] for p in per_pair]), torch.tensor(chosen))
    torch.testing.assert_close(torch.tensor([p["rejected_score"] for p in per_pair]), torch.tensor(rejected))

    record = json.loads((out / "evaluation.json").read_text())
    got = record["files"]["pairs"]
    # recomputed from the written scores (the figures' inputs, exactly) ...
    cs = [p["chosen_score"] for p in per_pair]
    rs = [p["rejected_score"] for p in per_pair]
    check_report(got, expected_report(cs, rs, len_c, len_r, t_rec=1.7))
    assert got["calibration"]["recorded"]["temperature"] == pytest.approx(1.7)
    assert got["warnings"] == []  # an export saved outside a fit records no validation summary
    assert got["data"].startswith(f"kept {len(ROWS)} of {len(ROWS)} rows from pairs.jsonl")  # not "train: ..."
    assert (out / "evaluation.md").read_text() in printed


def test_ties_count_half_through_the_command(tmp_path):
    """A scorer with literal scores: pairs 1 and 3 are ties (credit 1/2)."""

    class LiteralScorer:
        name, temperature, reference = "literal", 2.0, None
        chosen = [1.0, 0.5, -1.0, 2.0, 0.0, 3.0]
        rejected = [0.0, 0.5, 1.0, 2.0, 1.5, -1.0]
        lengths = [(10, 5), (5, 10), (7, 7), (20, 19), (3, 30), (8, 9)]

        def read_pairs(self, path, format="auto"):
            pairs = [TokenPair([1], [2] * a, [3] * b) for a, b in self.lengths]
            return pairs, "6 pairs"

        def score_pairs(self, pairs):
            return torch.tensor(self.chosen), torch.tensor(self.rejected)

    scorer = LiteralScorer()
    data = _write_rows(tmp_path / "any.jsonl", [{}])
    reports = evaluate_main(
        ["--model", "literal", "--data", data, "--out", str(tmp_path / "o")], scorer=scorer
    )
    got = reports["any"]
    lc, lr = zip(*scorer.lengths)
    want = expected_report(scorer.chosen, scorer.rejected, list(lc), list(lr), t_rec=2.0)
    check_report(got, want)
    # by hand: credits [1, .5, 0, .5, 0, 1] -> 3 / 6; longer rule [1, 0, .5, 1, 0, 0] -> 2.5 / 6
    assert got["accuracy"] == pytest.approx(0.5) and got["ties"] == 2
    assert got["longer_wins"]["accuracy"] == pytest.approx(2.5 / 6)
    assert got["better_rule"] == "shorter_wins"  # 3.5 / 6
    # length-matched: (7, 7), (20, 19) and (8, 9) (1/9 > 0.1: not) -> pairs 2 and 3, credits 0 and .5
    assert got["length_matched"]["pairs"] == 2 and got["length_matched"]["accuracy"] == pytest.approx(0.25)


def test_an_encoder_export_scores_what_its_training_scored(tmp_path):
    """All-MiniLM-style: an encoder trained on responses alone (max_prompt_length 1: [CLS] response [SEP]).
    evaluate reads the recorded input format, so its scores equal the module's own on the data module's batch."""
    from tests.models.encoders import wordpiece_folder
    from tests.models.test_encoder_reward import TINY_BERT

    texts = [r[k] for r in ROWS for k in ("prompt", "chosen", "rejected")]
    vocab = wordpiece_folder(tmp_path / "wp", texts * 3)
    rm = tmp_path / "rm"
    module = RewardModule(BackboneConfig(tiny=TINY_BERT, tokenizer=vocab), export_dir=str(rm))
    data_file = _write_rows(tmp_path / "pairs.jsonl", ROWS)
    data = PreferenceDataModule(
        train_files=[data_file], val_files=[data_file], format="explicit", max_prompt_length=1,
        max_length=64, batch_size=4, val_batch_size=3, tokenizer=module.tokenizer,
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, default_root_dir=str(tmp_path), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, val_check_interval=2,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)  # 2 steps, then calibration on the validation pairs and the export
    module.eval()
    meta = json.loads((rm / "rlhf_lit.json").read_text())
    assert meta["architecture"] == "encoder" and meta["input_format"]["max_prompt_length"] == 1
    results = json.loads((rm / "eval_results.json").read_text())
    batch = PreferenceCollator(module.tokenizer.pad_token_id)(data.val_dataset.examples)
    assert (batch["chosen_input_ids"][:, 0] == module.tokenizer.cls_token_id).all()
    with torch.no_grad():
        trained_c = module.score(batch["chosen_input_ids"], batch["chosen_attention_mask"])
        trained_r = module.score(batch["rejected_input_ids"], batch["rejected_attention_mask"])

    out = tmp_path / "out"
    cli_main(["evaluate", "--model", str(rm), "--data", data_file, "--out", str(out)])
    per_pair = [json.loads(line) for line in (out / "pairs.scores.jsonl").read_text().splitlines()]
    torch.testing.assert_close(torch.tensor([p["chosen_score"] for p in per_pair]), trained_c)
    torch.testing.assert_close(torch.tensor([p["rejected_score"] for p in per_pair]), trained_r)
    assert [p["chosen_tokens"] for p in per_pair] == batch["chosen_response_len"].tolist()
    got = json.loads((out / "evaluation.json").read_text())["files"]["pairs"]
    # the validation pairs are this file: the recorded summary is this file's, so no shift warning
    assert meta["validation_summary"]["pairs"] == len(ROWS) and got["warnings"] == []
    for key in ("response_tokens", "score"):
        for stat in ("mean", "sd"):
            assert got["summary"][key][stat] == pytest.approx(meta["validation_summary"][key][stat], abs=1e-5)
    assert got["calibration"]["recorded"]["temperature"] == pytest.approx(results["temperature"])


def test_a_file_far_from_the_validation_pairs_gets_a_warning(causal_export, tmp_path, capsys):
    """The recorded summary says responses of 5 +- 1 tokens; this file's are ~ 20: d >> 0.5 on length."""
    meta_path = causal_export.parent / "shifted" / "rlhf_lit.json"
    import shutil

    shutil.copytree(causal_export, meta_path.parent)
    meta = json.loads(meta_path.read_text())
    meta["validation_summary"] = {
        "pairs": 100,
        "response_tokens": {"mean": 5.0, "sd": 1.0},
        "score": {"mean": 0.0, "sd": 1000.0},  # so wide that no file's scores sit far from it
    }
    meta_path.write_text(json.dumps(meta))
    data = _write_rows(tmp_path / "long.jsonl", ROWS)
    reports = evaluate_main(["--model", str(meta_path.parent), "--data", data])
    captured = capsys.readouterr()
    warnings = reports["long"]["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("response length (tokens)")
    assert "rlhf-lit: warning: long: response length" in captured.err
    assert "**Warning** (long)" in captured.out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "{tmp}/missing", "--data", "{data}"], "no such folder"),
        (["--model", "{tmp}", "--data", "{data}"], "not an rlhf_lit export"),
        (["--model", "{policy}", "--data", "{data}"], "not a reward model"),
        (["--model", "{rm}", "--data", "{tmp}/nothing.jsonl"], "no such file"),
        (["--model", "{rm}", "--data", "{bad}"], "bad.jsonl"),
        (["--data", "{data}"], "required: --model"),
    ],
)
def test_user_mistakes_give_one_line_and_exit_2(args, message, causal_export, tmp_path, capsys):
    data = _write_rows(tmp_path / "pairs.jsonl", ROWS)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"chosen": "x", "rejected": "y"}\nnot json\n')
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "rlhf_lit.json").write_text(json.dumps({"format": "rlhf_lit", "kind": "policy"}))
    values = {"tmp": tmp_path, "data": data, "rm": causal_export, "policy": policy, "bad": bad}
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["evaluate", *(a.format(**values) for a in args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlhf-lit: error: ") and message in err[0]


def test_length_sorted_batches():
    # lengths [3, 10, 4, 9], 20 tokens: longest first; [1, 3] pads to 2 x 10 = 20, [2, 0] to 2 x 4 = 8
    assert length_sorted_batches([3, 10, 4, 9], 20) == [[1, 3], [2, 0]]
    # a row longer than the budget still gets a batch of its own
    assert length_sorted_batches([50, 1], 20) == [[0], [1]]
    assert sorted(i for b in length_sorted_batches([5] * 7, 12) for i in b) == list(range(7))


def _with_data_record(export: Path, folder: Path, files: list[str]) -> tuple[Path, PreferenceDataModule]:
    """A copy of ``export`` whose rlhf_lit.json records training data as a fit would (``data_record`` of a
    data module over ``files`` with 3 validation pairs per file), and that data module after setup."""
    import shutil

    from rlhf_lit.models.tokenizer import load_tokenizer
    from rlhf_lit.modules.reward_eval import data_record

    shutil.copytree(export, folder)
    data = PreferenceDataModule(train_files=files, val_size=3, seed=5, tokenizer=load_tokenizer(str(folder)))
    data.setup("fit")
    meta = json.loads((folder / "rlhf_lit.json").read_text())
    meta["data"] = data_record(data)
    (folder / "rlhf_lit.json").write_text(json.dumps(meta))
    return folder, data


def test_heldout_scores_exactly_the_pairs_the_run_validated_on(causal_export, tmp_path, capsys):
    """``--heldout`` rebuilds the recorded split: per file, the 3 held-out rows (the same rows, in the same
    order, as the data module's validation set), scored as a file of just those rows would be; plus a pooled
    column whose accuracy is the mean credit of all 6 pairs."""
    files = [
        _write_rows(tmp_path / "first.jsonl", ROWS),
        _write_rows(tmp_path / "second.jsonl", [{**r, "prompt": r["prompt"] + "?"} for r in ROWS]),
    ]
    rm, data = _with_data_record(causal_export, tmp_path / "rm", files)
    out = tmp_path / "out"
    reports = evaluate_main(["--model", str(rm), "--heldout", "--out", str(out)])
    assert list(reports) == ["first_validation", "second_validation", "all"]

    held_rows = {0: [], 1: []}
    for e in data.val_dataset.examples:
        held_rows[e["source"]].append(e["row"])
    assert [len(v) for v in held_rows.values()] == [3, 3]
    for source, name in enumerate(("first", "second")):
        rows = [json.loads(line) for line in Path(files[source]).read_text().splitlines()]
        alone = _write_rows(tmp_path / f"{name}_held.jsonl", [rows[i] for i in held_rows[source]])
        direct = [json.loads(x) for x in _scores_file(evaluate_main, rm, alone, tmp_path / f"o_{name}")]
        heldout = [json.loads(x) for x in (out / f"{name}_validation.scores.jsonl").read_text().splitlines()]
        assert heldout == direct  # scores and lengths, pair by pair
    pooled = [json.loads(x) for x in (out / "all.scores.jsonl").read_text().splitlines()]
    credits = [credit(p["chosen_score"], p["rejected_score"]) for p in pooled]
    assert len(pooled) == 6
    assert reports["all"]["accuracy"] == pytest.approx(sum(credits) / 6)
    assert "first_validation" in capsys.readouterr().out
    assert {p["file"] for p in pooled} == {"first_validation", "second_validation"}

    # a training file beside --heldout: a warning, and its 3 held-out pairs count once in the pooled column
    both = evaluate_main(["--model", str(rm), "--data", files[0], "--heldout", "--out", str(tmp_path / "both")])
    assert "this file holds the pairs" in capsys.readouterr().err
    assert [both[k]["pairs"] for k in ("first", "first_validation", "second_validation", "all")] == [8, 3, 3, 11]
    rows = [json.loads(x) for x in (tmp_path / "both" / "all.scores.jsonl").read_text().splitlines()]
    assert [r["pair"] for r in rows] == list(range(11))
    assert [r["file"] for r in rows] == ["first"] * 8 + ["second_validation"] * 3


def _scores_file(evaluate, rm: Path, data: str, out: Path) -> list[str]:
    evaluate(["--model", str(rm), "--data", data, "--out", str(out)])
    return (out / f"{Path(data).stem}.scores.jsonl").read_text().splitlines()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "{rm}", "--heldout"], "records no validation split"),
        (["--model", "{rm}"], "give --data <file> (repeatable) or --heldout"),
    ],
)
def test_heldout_mistakes_give_one_line_and_exit_2(args, message, causal_export, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["evaluate", *(a.format(rm=causal_export) for a in args)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlhf-lit: error: ") and message in err[0]
