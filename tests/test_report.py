"""CPU tier: `autosoft report` from the committed H200 sweep and from a replayed tune.

The sweep (benchmarks/results/softmax_h200.sqlite: 48 softmax problems, 40 trials each, one
launch failure) with its benchmark JSONs gives every across-problem and per-problem figure;
a replayed tune gives a cache and an Optuna storage written by this autosoft. Expected numbers
are read from the file with sqlite3 here, not through the module under test. Where a Chromium
and Playwright's Python package are installed, the page is opened in it headless.
"""
from __future__ import annotations

import json
import re
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the report needs matplotlib (the test extra installs it)")
pytest.importorskip("plotly", reason="the report needs plotly (the test extra installs it)")

from autosoft.cache import Cache  # noqa: E402
from autosoft.errors import UserError  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import space_of  # noqa: E402
from autosoft.report import PNG_KINDS, analyse, build_report, load_runs, read_bench, summary_rows  # noqa: E402
from autosoft.runners import ReplayRunner  # noqa: E402
from autosoft.tune import study_storage, tune  # noqa: E402

from helpers import run_cli, run_cli_read_only_honoured  # noqa: E402

# one worker runs the whole module under `pytest -n 2 --dist loadgroup`: its module fixtures are built once
pytestmark = pytest.mark.xdist_group("report")

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SWEEP = RESULTS / "softmax_h200.sqlite"
BENCH = [RESULTS / "softmax_h200_float32.json", RESULTS / "softmax_h200_16bit.json"]
BENCH_ARGS = [a for b in BENCH for a in ("--bench", str(b))]
FIGURES = ("convergence", "wall", "outcomes", "importance", "params", "timing")  # per-problem div ids
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SOFTMAX = get_family("softmax")


def sections(page: str) -> int:
    return page.count("<details class=problem")


def check_pngs(folder: Path, names) -> None:
    for name in names:
        data = (folder / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, name


def check_self_contained(page: str) -> None:
    from plotly.offline import get_plotlyjs

    assert re.search(r"<script[^>]*\bsrc\s*=", page) is None  # nothing fetched: every script inline
    assert page.count(get_plotlyjs()[:300]) == 1  # plotly.js inlined exactly once


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory):
    """The whole sweep, all 48 problems, in-process."""
    out = tmp_path_factory.mktemp("sweep") / "report"
    result = build_report(out, cache_path=SWEEP, bench=BENCH)
    return result, out


def test_sweep_report_holds_every_figure(sweep_report):
    result, out = sweep_report
    assert result.problems == 48 and result.index == out / "index.html"
    page = result.index.read_text()
    check_self_contained(page)
    assert sections(page) == 48
    runs = load_runs(SWEEP)
    for run in runs:
        for fig in FIGURES:
            assert f'id="{run.slug}-{fig}"' in page, (run.label, fig)
    for dtype in ("float32", "float16", "bfloat16"):
        assert f'id="bandwidth-{dtype}"' in page
    assert "<table id=summary>" in page and "tflops" not in {p.stem for p in result.pngs}  # softmax only
    assert {p.name for p in result.pngs} == {"bandwidth.png", *(f"{k}.png" for k in PNG_KINDS)}
    check_pngs(out, [p.name for p in result.pngs])
    # the one launch failure of the sweep is shown with its message
    assert "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE" in page
    assert "records no compile/evaluate split" in page


def test_summary_agrees_with_the_cache_entries():
    with sqlite3.connect(SWEEP) as conn:
        conn.row_factory = sqlite3.Row
        entries = {(r["dtype"], r["shape"]): dict(r) for r in conn.execute("SELECT * FROM entries")}
        counts = dict(conn.execute("SELECT dtype || ' ' || shape, count(*) FROM trials GROUP BY dtype, shape"))
    runs = load_runs(SWEEP, shapes=["4096x8192"], dtypes=["float32"])
    analyses = [analyse(r, read_bench(BENCH)) for r in runs]
    (row,) = summary_rows(analyses)
    e = entries[("float32", "4096x8192")]
    assert row["time_us"] == e["time_us"] and row["variant"] == e["variant_name"]
    assert row["pct_copy"] == pytest.approx(100 * e["copy_time_us"] / e["time_us"])
    nbytes = SOFTMAX.bytes_moved(SOFTMAX.problem("4096x8192", "float32"))
    assert row["gbps"] == pytest.approx(nbytes / e["time_us"] / 1e3)
    assert row["trials"] == counts["float32 4096x8192"] == 40
    assert row["default_us"] == pytest.approx(e["default_time_us"], rel=0.05)  # single timing vs the entry's
    bench = next(r for r in json.loads(BENCH[0].read_text())["rows"] if r["shape"] == "4096x8192")
    assert analyses[0].references["torch"] == bench["torch_gbps"]


def test_importance_ranks_the_space_parameters():
    (run,) = load_runs(SWEEP, shapes=["4096x50257"], dtypes=["float32"])
    a = analyse(run)
    assert a.importances, a.importance_note
    assert set(a.importances) <= set(space_of(SOFTMAX).names)
    values = list(a.importances.values())
    assert values == sorted(values, reverse=True) and sum(values) == pytest.approx(1.0)


def test_cli_filtered_report_and_open(tmp_path):
    out = tmp_path / "r"
    proc = run_cli(["report", "--cache", str(SWEEP), *BENCH_ARGS, "--shape", "4096x8192", "--shape", "1x1048576",
                    "-o", str(out), "--open"], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str((out / "index.html").resolve())
    page = (out / "index.html").read_text()
    assert sections(page) == 6  # two shapes x three dtypes
    check_self_contained(page)


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """A 20-trial replay of one recorded problem, tuned into a fresh cache (and its study storage)."""
    cache = Cache(tmp_path_factory.mktemp("replay") / "k.sqlite")
    problem = SOFTMAX.problem("4096x16384", "float32")
    report = tune(SOFTMAX, problem, 20, cache, runner=ReplayRunner(SWEEP, problem), seed=0)
    return cache, report


@pytest.mark.parametrize("source", ["cache", "storage"])
def test_report_of_a_replayed_tune(replayed, tmp_path, source):
    cache, tuned = replayed
    args = ["--cache", str(cache.path)] if source == "cache" else ["--storage", study_storage(cache)]
    out = tmp_path / "r"
    proc = run_cli(["report", *args, "-o", str(out)], tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    page = (out / "index.html").read_text()
    assert sections(page) == 1 and "4096x16384 float32" in page
    (run,) = load_runs(cache.path) if source == "cache" else load_runs(storage_url=study_storage(cache))
    assert len(run.trials) == len(tuned.trials) == 20
    assert run.entry is not None and run.entry.time_us == tuned.best.outcome.time_us  # the storage finds the cache
    check_pngs(out, [f"{k}.png" for k in PNG_KINDS] + ["bandwidth.png"])


def _one_line_error(proc, out: Path, needle: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autosoft: error:") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_bad_stores_give_one_line_and_write_nothing(tmp_path):
    out = tmp_path / "r"
    corrupt = tmp_path / "corrupt.sqlite"
    corrupt.write_bytes(b"this is not sqlite at all" * 100)
    empty_file = tmp_path / "empty.sqlite"
    empty_file.write_bytes(b"")
    empty_cache = Cache(tmp_path / "nothing.sqlite").path
    cases = [(["--cache", str(corrupt)], "corrupt.sqlite"),
             (["--cache", str(empty_file)], "empty.sqlite"),
             (["--cache", str(empty_cache)], "holds no tuned problem"),
             (["--cache", str(tmp_path / "missing.sqlite")], "no such file"),
             (["--cache", str(SWEEP), "--shape", "3x3"], "no tuned problem matches --shape 3x3"),
             (["--storage", f"sqlite:///{tmp_path / 'none-studies.sqlite'}"], "no such file"),
             (["--storage", f"sqlite:///{corrupt}"], "storage"),
             (["--storage", f"sqlite:///{empty_cache}"], "not an Optuna storage"),
             (["--cache", str(SWEEP), "--bench", str(corrupt)], "--bench")]
    for args, needle in cases:
        _one_line_error(run_cli(["report", *args, "-o", str(out)], tmp_path / "cache"), out, needle)
    assert not (tmp_path / "none-studies.sqlite").exists()  # Optuna was not let to create it
    assert empty_file.read_bytes() == b""
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    proc = run_cli(["report", "--cache", str(SWEEP), "-o", str(a_file)], tmp_path / "cache")
    assert proc.returncode == 2 and "is a file" in proc.stderr and a_file.read_text() == "keep"


def test_an_unwritable_output_is_one_line_and_leaves_nothing(tmp_path):
    """-o in /proc, or under a read-only folder, printed a traceback."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "keep").write_text("keep")
    locked.chmod(0o555)
    try:
        for out in (Path("/proc/rep"), locked / "rep", locked):  # of one problem: the figures are not the point
            proc = run_cli_read_only_honoured(["report", "--cache", str(SWEEP), "--shape", "4096x8192", "-o", str(out)],
                                              tmp_path / "cache")
            assert proc.returncode == 2, proc.stderr
            (line,) = proc.stderr.splitlines()
            assert line.startswith(f"autosoft: error: -o {out}: cannot write the report there (") and proc.stdout == ""
        assert not Path("/proc/rep").exists()
        assert sorted(p.name for p in locked.iterdir()) == ["keep"], "no PNG, page or temporary file is left"
    finally:
        locked.chmod(0o755)


def test_every_package_folder_ships():
    """report became a package (loading, analysis, figures, page): a non-editable install ships only
    the packages pyproject.toml lists, and would have lost it."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "autosoft").rglob("__init__.py")}
    assert "autosoft.report" in folders and folders <= listed


def test_missing_libraries_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly now raises ImportError
    with pytest.raises(UserError, match=r"pip install 'autosoft\[report\]'"):
        build_report(tmp_path / "r", cache_path=SWEEP)
    assert not (tmp_path / "r").exists()


# --- the page in a browser -------------------------------------------------------------------------

def chromium_path() -> str | None:
    for name in ("/usr/bin/chromium", "chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def test_page_renders_in_headless_chromium(tmp_path):
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium installed (Debian: apt-get install -y chromium); the page was not opened")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")
    out = tmp_path / "r"
    result = build_report(out, cache_path=SWEEP, bench=BENCH, shapes=["4096x8192", "8x262144"])
    expected = result.index.read_text().count('class="plotly-graph-div"')
    assert expected == 3 + 6 * 6  # three bandwidth charts, six figures for each of six problems
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
            page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
            page.on("request", lambda req: errors.append(f"request: {req.url}")
                    if not req.url.startswith(("file:", "data:", "blob:", "about:")) else None)
            page.goto(result.index.as_uri(), wait_until="load")
            page.wait_for_function(
                "() => [...document.querySelectorAll('.plotly-graph-div')].every(d => d._fullLayout)", timeout=30_000)
            rendered = page.evaluate(
                "() => [...document.querySelectorAll('.plotly-graph-div')]"
                ".filter(d => d._fullLayout && d.querySelector('.main-svg')).length")
        finally:
            browser.close()
    assert errors == []
    assert rendered == expected


def test_attention_gets_a_tflops_chart(tmp_path):
    """A compute-bound family is charted in TFLOP/s against the datasheet peak, not in GB/s."""
    from autosoft.cache import CacheKey, Entry
    from autosoft.families.base import Target

    attention = get_family("attention")
    problem = attention.problem("1,32,8192,64", "bfloat16", {"causal": True})
    target = Target.for_arch("90")
    points = [attention.default_params(problem, target), *attention.seed_params(problem, target)][:5]
    cache = Cache(tmp_path / "a.sqlite")
    key = CacheKey("attention", "bfloat16", problem.shape_text, "NVIDIA H200", "90", "13.0", "t" * 64, "s" * 64)
    cache.record_trials([{"family": "attention", "dtype": "bfloat16", "shape": problem.shape_text,
                          "gpu_name": "NVIDIA H200", "variant_name": attention.variant_name(problem, p), "params": p,
                          "status": "ok", "time_us": 900.0 - 10 * i, "message": ""} for i, p in enumerate(points)])
    cache.put(Entry(key, "attention_best", points[-1], "ab" * 32, 850.0, 900.0, None, "-", "0.1.0", 1.0))
    result = build_report(tmp_path / "r", cache_path=cache.path, bench=[RESULTS / "issue18_df2a9f9" / "attention_tuned_bf16.json"])
    page = result.index.read_text()
    assert 'id="tflops"' in page and 'id="bandwidth-' not in page and "datasheet peak" in page
    check_pngs(tmp_path / "r", ["tflops.png"])
    (row,) = summary_rows([analyse(load_runs(cache.path)[0])])
    assert row["tflops"] == pytest.approx(attention.flops(problem) / 850.0 / 1e6) and row["pct_copy"] is None
    refs = analyse(load_runs(cache.path)[0], read_bench([RESULTS / "issue18_df2a9f9" / "attention_tuned_bf16.json"])).references
    assert {"flash", "cudnn", "efficient"} <= set(refs)  # matched with the benchmark's causal row


def test_a_tune_keeps_its_measured_peak_and_the_report_draws_it(tmp_path):
    """A compute-bound tune measures the GPU's tensor-core rate (the runner's peak_tflops) and
    keeps it with its study, with each trial's compile and evaluate seconds; the report, read
    from that storage, draws the measured peak instead of the datasheet's and the time split."""
    from autosoft.evaluate import Outcome, Status
    from autosoft.families.base import Target
    from autosoft.runners import Runner
    from autosoft.runtime import DeviceInfo

    class Measured(Runner):
        device = DeviceInfo(0, Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024), "13.0")

        def evaluate(self, family, variant, seed, timeout_s):
            time_us = 900.0 + (sum(map(ord, variant.name)) % 97)
            return Outcome(Status.OK, time_us, compile_s=0.8, evaluate_s=0.3)

        def time_side_by_side(self, family, variants, timeout_s):
            return None

        def time_copy(self, nbytes_each_way):
            return 100.0

        def peak_tflops(self):
            return 777.0

    attention = get_family("attention")
    problem = attention.problem("1,32,4096,64", "bfloat16", {"causal": True})
    cache = Cache(tmp_path / "k.sqlite")
    report = tune(attention, problem, 6, cache, runner=Measured(), seed=0)
    assert report.peak_tflops == 777.0 and report.stored
    result = build_report(tmp_path / "r", cache_path=cache.path, storage_url=study_storage(cache))
    page = (tmp_path / "r" / "index.html").read_text()
    assert "measured peak" in page and "777" in page and "datasheet peak" not in page
    (run,) = load_runs(cache.path, study_storage(cache))
    assert run.peak_tflops == 777.0
    assert all(t.compile_s == 0.8 and t.evaluate_s == 0.3 for t in run.trials)
    assert "tflops" in {p.stem for p in result.pngs}


def test_report_of_a_journal_file_storage(replayed, tmp_path):
    """The same study copied into Optuna's journal file storage (the storage for several processes
    of one host) reads back the same trials, named either way."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    cache, tuned = replayed
    (summary,) = optuna.get_all_study_summaries(study_storage(cache))
    journal = tmp_path / "studies.log"
    optuna.copy_study(from_study_name=summary.study_name, from_storage=study_storage(cache),
                      to_storage=JournalStorage(JournalFileBackend(str(journal))))
    for url in (f"journal:///{journal}", str(journal)):
        (run,) = load_runs(cache.path, url)
        assert [t.params for t in run.trials] == [dict(m.variant.params) for m in tuned.trials]
    out = tmp_path / "r"
    proc = run_cli(["report", "--cache", str(cache.path), "--storage", str(journal), "-o", str(out)], tmp_path / "c")
    assert proc.returncode == 0, proc.stderr
    assert sections((out / "index.html").read_text()) == 1
    bad = tmp_path / "bad.log"
    bad.write_text("not a journal\n")
    _one_line_error(run_cli(["report", "--storage", str(bad), "-o", str(tmp_path / "r2")], tmp_path / "c"),
                    tmp_path / "r2", "bad.log")
