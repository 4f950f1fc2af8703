"""``bench/config_memory.py --table``: what the "fits" line needs for a recorded plan beside the measured peak
RSS, and the ±15 % verdict. Literal lines, no run."""

from __future__ import annotations

from bench.config_memory import table


def _line(label: str, plan_mb: float, peak_mb: float) -> dict:
    return {"label": label, "config": "configs/x.yaml", "steps": 8, "plan_mb": plan_mb, "peak_mb": peak_mb}


def test_table_compares_the_fits_figure_with_the_peak():
    # plan 1,000 MiB -> needs 1,000 x 1.1 + 0.6 x 1,024 = 1,100 + 614.4 = 1,714.4 MiB
    rows = table(
        [_line("exact", 1000.0, 1714.4), _line("low", 1000.0, 2000.0), _line("high", 1000.0, 1400.0)], 0.15
    ).splitlines()[2:]
    assert rows[0].split()[-4:] == ["1,714", "1,714", "1.00", "yes"]
    assert rows[1].split()[-3:] == ["2,000", "0.86", "yes"]  # 1,714.4 / 2,000 = 0.857: inside 15 %
    assert rows[2].split()[-3:] == ["1,400", "1.22", "NO"]  # 1,714.4 / 1,400 = 1.225: outside


def test_table_within_is_the_tolerance():
    # 1,714.4 / 2,000 = 0.857: outside 10 %
    assert table([_line("low", 1000.0, 2000.0)], 0.10).splitlines()[2].split()[-1] == "NO"
