"""CPU tier: benchmarks/generalize.py's summary. The timing needs a GPU; the ratios the issue's
targets are read from must count what dispatch served, and the warm start's trials saved."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import generalize as bench  # noqa: E402


def _record(reference: float, nearest: float, selector: float | None = None,
            warm: tuple[int, int] | None = None, served: str | None = None) -> dict:
    dispatch = {"reference": {"time_us": reference}, "nearest": {"time_us": nearest}}
    if served is not None:
        dispatch["served"] = served
    if selector is not None:
        dispatch["selector"] = {"time_us": selector}
    record = {"dispatch": dispatch}
    if warm is not None:
        record["warm"] = {"cold_trials_to_1pct": warm[0], "warm_trials_to_1pct": warm[1]}
    return record


def test_what_dispatch_served_is_the_selector_pick_else_the_nearest_entry():
    records = {"a": _record(10.0, 20.0, selector=10.0, warm=(10, 5)),   # pick as fast as the tune
               "b": _record(10.0, 12.5, warm=(4, 4)),                    # no pick: the nearest served
               "c": _record(10.0, 10.0, selector=12.5, warm=(8, 2))}     # a pick slower than the nearest
    s = bench.summary("softmax", records)
    assert s["selector_geomean"] == pytest.approx(math.sqrt(1.0 * 0.8))
    assert s["served_geomean"] == pytest.approx((1.0 * 0.8 * 0.8) ** (1 / 3))
    assert s["served_worst"] == (pytest.approx(0.8), "b")
    assert s["served_vs_nearest_worst"] == (pytest.approx(0.8), "c")
    assert s["nearest_worst"] == (pytest.approx(0.5), "a")
    assert s["shapes_without_selector_pick"] == 1
    assert s["warm_median_fewer_trials"] == pytest.approx(0.5) and s["warm_worst"] == (0.0, "b")


def test_where_dispatch_raced_the_winner_of_its_race_is_what_served():
    records = {"a": _record(10.0, 20.0, selector=10.0, served="selector"),
               "b": _record(10.0, 10.0, selector=12.5, served="nearest"),  # the race kept the nearest entry
               "c": _record(10.0, 11.0, selector=10.5, served="nearest")}  # a race lost to noise shows as such
    s = bench.summary("softmax", records)
    assert s["served_geomean"] == pytest.approx((1.0 * 1.0 * 10 / 11) ** (1 / 3))
    assert s["served_worst"] == (pytest.approx(10 / 11), "c")
    assert s["served_vs_nearest_worst"] == (pytest.approx(1.0), "b")
