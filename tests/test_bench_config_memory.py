"""``bench/config_memory.py --table``: what the "fits" line needs for a recorded plan beside the measured peak
RSS, and the ±15 % verdict. Literal lines, no run."""

from __future__ import annotations

from bench.config_memory import table


def _line(label: str, plan_mb: float, peak_mb: float, **more) -> dict:
    return {"label": label, "config": "configs/x.yaml", "steps": 8, "plan_mb": plan_mb, "peak_mb": peak_mb, **more}


def test_table_compares_the_fits_figure_with_the_peak():
    # plan 1,000 MiB -> needs 1,000 x 1.1 + 0.6 x 1,024 = 1,100 + 614.4 = 1,714.4 MiB
    rows = table(
        [_line("exact", 1000.0, 1714.4), _line("low", 1000.0, 2000.0), _line("high", 1000.0, 1400.0)], 0.15
    ).splitlines()[2:]
    assert rows[0].split()[-8:] == ["1,714", "1,714", "1.00", "yes", "-", "-", "-", "-"]
    assert rows[1].split()[-7:-4] == ["2,000", "0.86", "yes"]  # 1,714.4 / 2,000 = 0.857: inside 15 %
    assert rows[2].split()[-7:-4] == ["1,400", "1.22", "NO"]  # 1,714.4 / 1,400 = 1.225: outside


def test_table_gives_the_ratio_for_the_drawn_batch_and_flatness():
    # drawn plan 500 MiB -> needs 500 x 1.1 + 614.4 = 1,164.4 MiB; / 1,714.4 = 0.68
    row = table([_line("drawn", 1000.0, 1714.4, plan_widest_drawn_mb=500.0, flat=False)], 0.15).splitlines()[2]
    assert row.split()[-6:] == ["1.00", "yes", "0.68", "-", "-", "no"]


def test_table_gives_the_tensors_against_the_peak_less_the_floor():
    # drawn plan 500 MiB against 1,714.4 - 1,214.4 = 500 MiB: 1.00; no drawn plan: 1,000 / (2,000 - 520) = 0.68
    rows = table(
        [_line("drawn", 1000.0, 1714.4, plan_widest_drawn_mb=500.0, floor_mb=1214.4), _line("plan", 1000.0, 2000.0, floor_mb=520.0)],
        0.15,
    ).splitlines()[2:]
    assert rows[0].split()[-3:-1] == ["1.00", "yes"]
    assert rows[1].split()[-3:-1] == ["0.68", "NO"]


def test_table_uses_the_plans_it_is_given_and_keeps_the_recorded_where_planning_fails():
    def plan_of(line):
        if line["label"] == "gone":
            raise ValueError("cannot read the config of '/tmp/x' offline\nsecond line")
        return 500.0, 250.0

    rows = table([_line("new", 1000.0, 1164.4, floor_mb=914.4), _line("gone", 1000.0, 1714.4)], 0.15, plan_of).splitlines()
    # 500 x 1.1 + 614.4 = 1,164.4 -> 1.00; drawn 250 x 1.1 + 614.4 = 889.4 / 1,164.4 = 0.76; tensors 250 / 250
    assert rows[2].split()[3:] == ["500", "1,164", "1,164", "1.00", "yes", "0.76", "1.00", "yes", "-"]
    assert rows[3].split()[3:8] == ["1,000", "1,714", "1,714", "1.00", "yes"]
    assert rows[-1] == "  gone: recorded plan kept (cannot read the config of '/tmp/x' offline)"


def test_table_within_is_the_tolerance():
    # 1,714.4 / 2,000 = 0.857: outside 10 %
    assert table([_line("low", 1000.0, 2000.0)], 0.10).splitlines()[2].split()[-5] == "NO"


def test_batch_dims_count_response_tokens_from_lengths_or_from_labels():
    import torch

    from bench.config_memory import batch_dims

    pair = {  # a paired batch: 2 rows of chosen, 2 of rejected, width 4 and 3
        "chosen_attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        "rejected_attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        "chosen_response_len": torch.tensor([2, 3]),
        "rejected_response_len": torch.tensor([1, 0]),
        "chosen_labels": torch.full((2, 4), 7),  # ignored: the lengths are there
    }
    assert batch_dims(pair) == {"rows": 4, "width": 4, "tokens": 10, "response_tokens": 6}
    unpaired = {  # KTO: no *response_len, the labels mark the response (-100 elsewhere)
        "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "labels": torch.tensor([[-100, 5, 6], [-100, 9, -100]]),
    }
    assert batch_dims(unpaired) == {"rows": 2, "width": 3, "tokens": 5, "response_tokens": 3}
    assert batch_dims([torch.ones(2)]) == {}


def test_drawn_overrides_plan_the_widest_batch_and_dpo_the_most_response_tokens_per_row():
    from bench.config_memory import drawn_overrides

    steps = [
        {"rows": 16, "width": 300, "tokens": 2000, "response_tokens": 800},  # 50 per row
        {"rows": 16, "width": 499, "tokens": 3000, "response_tokens": 939},  # 58.7 -> 59
    ]
    assert drawn_overrides(steps, "dpo") == ["--data.init_args.max_length=499", "--response-len=59"]
    assert drawn_overrides(steps, "sft") == ["--data.init_args.max_length=499"]  # SFT/reward: every position
    assert drawn_overrides([{"rows": 4, "width": 66, "tokens": 186}], "ppo") == [
        "--data.init_args.max_prompt_length=66"
    ]
    # a row cannot hold more response tokens than its width - 1 (plan refuses more)
    assert drawn_overrides([{"rows": 1, "width": 10, "tokens": 10, "response_tokens": 10}], "dpo")[1] == (
        "--response-len=9"
    )
    assert drawn_overrides([{"rows": 2}], "dpo") == []
    # packed, a batch holds its tokens: 2,000 / 16 = 125, 3,000 / 16 = 187.5 -> 188 token slots a row
    assert drawn_overrides(steps, "dpo", packed=True) == ["--data.init_args.max_length=188", "--response-len=59"]


def test_median_step_seconds_leaves_out_the_first_step():
    from bench.config_memory import median_step_seconds

    # trace times: loaded at 0 s, steps end at 30 (first step, warm-up: left out), 40, 51, 60 -> gaps 10, 11, 9
    assert median_step_seconds([0.0, 30.0, 40.0, 51.0, 60.0]) == 10.0
    assert median_step_seconds([0.0, 30.0, 40.0, 52.0]) == 11.0  # gaps 10, 12: their mean
    assert median_step_seconds([0.0, 30.0]) is None  # no step after the first


def test_replanned_plans_the_line_and_its_drawn_batch_with_todays_planner():
    from bench.config_memory import replanned
    from rlhf_lit import planner
    from rlhf_lit.planner.formulas import MiB
    from tests.tiny_runs import in_repo_root

    line = {"config": "configs/dpo/tiny.yaml", "overrides": ["data.init_args.max_length=48"]}
    with in_repo_root():
        whole = planner.plan(["configs/dpo/tiny.yaml"], cli_overrides=["--data.init_args.max_length=48"]).peak / MiB
        drawn = planner.plan(
            ["configs/dpo/tiny.yaml"], cli_overrides=["--data.init_args.max_length=48", "--data.init_args.max_length=24"],
            response_len=6,
        ).peak / MiB
    assert drawn < whole
    assert replanned(line) == (whole, None)
    assert replanned({**line, "drawn_overrides": ["--data.init_args.max_length=24", "--response-len=6"]}) == (whole, drawn)
    # lines before 2026-12-06 name their drawn width in "widest_override"
    assert replanned({**line, "widest_override": "--data.init_args.max_length=24"})[1] < whole
