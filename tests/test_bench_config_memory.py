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
    assert rows[0].split()[-6:] == ["1,714", "1,714", "1.00", "yes", "-", "-"]
    assert rows[1].split()[-5:-2] == ["2,000", "0.86", "yes"]  # 1,714.4 / 2,000 = 0.857: inside 15 %
    assert rows[2].split()[-5:-2] == ["1,400", "1.22", "NO"]  # 1,714.4 / 1,400 = 1.225: outside


def test_table_gives_the_ratio_for_the_widest_drawn_batch_and_flatness():
    # widest plan 500 MiB -> needs 500 x 1.1 + 614.4 = 1,164.4 MiB; / 1,714.4 = 0.68
    row = table([_line("drawn", 1000.0, 1714.4, plan_widest_drawn_mb=500.0, flat=False)], 0.15).splitlines()[2]
    assert row.split()[-4:] == ["1.00", "yes", "0.68", "no"]


def test_table_within_is_the_tolerance():
    # 1,714.4 / 2,000 = 0.857: outside 10 %
    assert table([_line("low", 1000.0, 2000.0)], 0.10).splitlines()[2].split()[-3] == "NO"
