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
    assert s["cold_median_trials"] == 8 and s["warm_median_trials"] == 4  # of (10, 4, 8) and (5, 4, 2)


def test_where_dispatch_raced_the_winner_of_its_race_is_what_served():
    records = {"a": _record(10.0, 20.0, selector=10.0, served="selector"),
               "b": _record(10.0, 10.0, selector=12.5, served="nearest"),  # the race kept the nearest entry
               "c": _record(10.0, 11.0, selector=10.5, served="nearest")}  # a race lost to noise shows as such
    s = bench.summary("softmax", records)
    assert s["served_geomean"] == pytest.approx((1.0 * 1.0 * 10 / 11) ** (1 / 3))
    assert s["served_worst"] == (pytest.approx(10 / 11), "c")
    assert s["served_vs_nearest_worst"] == (pytest.approx(1.0), "b")


def test_where_the_default_won_its_race_it_is_what_served():
    default = _record(10.0, 40.0, served="default")  # no configuration of the selector fitted the shape
    default["dispatch"]["default"] = {"time_us": 10.5}
    s = bench.summary("softmax", {"a": _record(10.0, 10.0, selector=10.0, served="selector"), "b": default})
    assert s["served_worst"] == (pytest.approx(10 / 10.5), "b")
    assert s["served_vs_nearest_worst"] == (pytest.approx(1.0), "a")
    assert s["shapes_without_selector_pick"] == 1 and s["selector_worst"] == (pytest.approx(1.0), "a")
    assert s["default_worst"] == (pytest.approx(10 / 10.5), "b") and s["default_geomean"] == pytest.approx(10 / 10.5)


def test_files_of_one_process_per_gpu_merge_into_one_summary():
    a = {"gpu": "NVIDIA H100 80GB HBM3", "nvrtc": "13.0", "commit": "abc",
         "families": {"softmax": {"x": _record(10.0, 20.0, selector=10.0, served="selector")}}}
    b = {"gpu": "NVIDIA H100 80GB HBM3", "nvrtc": "13.0", "commit": "abc",
         "families": {"softmax": {"y": _record(10.0, 12.5, served="nearest")}}}
    out = bench.merged([a, b])
    assert set(out["families"]["softmax"]) == {"x", "y"} and out["commits"] == ["abc"]
    assert out["summary"]["softmax"]["served_worst"] == (pytest.approx(0.8), "y")
    with pytest.raises(ValueError, match="in two of the files"):
        bench.merged([a, a])
    with pytest.raises(ValueError, match="different gpus"):
        bench.merged([a, {**b, "gpu": "NVIDIA H200"}])


def test_merge_from_the_command_line_writes_the_union(tmp_path):
    import json
    import subprocess

    part = {"gpu": "g", "nvrtc": "13.0", "commit": "abc", "families": {"softmax": {"x": _record(10.0, 10.0)}}}
    (tmp_path / "a.json").write_text(json.dumps(part))
    (tmp_path / "b.json").write_text(json.dumps({**part, "families": {"softmax": {"y": _record(10.0, 20.0)}}}))
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "generalize.py"
    done = subprocess.run([sys.executable, str(script), "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                           "--out", str(tmp_path / "gen.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert set(json.loads((tmp_path / "gen.json").read_text())["families"]["softmax"]) == {"x", "y"}
    again = subprocess.run([sys.executable, str(script), "--merge", str(tmp_path / "a.json"), str(tmp_path / "a.json"),
                            "--out", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
    assert again.returncode != 0 and "in two of the files" in again.stderr and not (tmp_path / "bad.json").exists()
