"""`autosoft report`: what a tuning run found, as plots, from stored data alone (no GPU).

build_report reads the stores (loading.py), analyses each tuned problem (analysis.py), and writes
DIR/index.html (page.py) and one PNG per figure kind (figures.py)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..cache import Cache, default_cache_path
from ..errors import UserError, one_line
from .analysis import Analysis, analyse
from .figures import PNG_KINDS, png_bandwidth, png_per_problem, png_tflops
from .loading import load_runs, read_bench
from .page import render_page, summary_rows

__all__ = ["PNG_KINDS", "ReportResult", "analyse", "build_report", "load_runs", "read_bench", "selector_lines",
           "summary_rows"]


INSTALL_HINT = "pip install 'autosoft[report]'"


@dataclass(frozen=True)
class ReportResult:
    index: Path
    pngs: tuple[Path, ...]
    problems: int
    seconds: float


def _require_libraries() -> None:
    try:
        import matplotlib  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as exc:
        raise UserError(f"autosoft report needs matplotlib and plotly ({exc.name} is missing): {INSTALL_HINT}") from None


def check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: is a file; give a folder to write the report into")
    for above in out.parents:
        if above.exists():
            if not above.is_dir():
                raise UserError(f"-o {out}: {above} is a file, not a folder")
            break


def build_report(out: Path, *, cache_path: Path | None = None, storage_url: str | None = None,
                 families: Sequence[str] = (), shapes: Sequence[str] = (), dtypes: Sequence[str] = (),
                 bench: Sequence[Path] = ()) -> ReportResult:
    """Write DIR/index.html and the PNGs. Every check runs before anything is written: a bad store,
    filter or output path raises UserError and leaves the disk as it was."""
    start = time.perf_counter()
    _require_libraries()
    out = Path(out).expanduser()
    check_output_dir(out)
    refs = read_bench(bench)
    runs = load_runs(cache_path, storage_url, families=families, shapes=shapes, dtypes=dtypes)
    selectors = selector_lines(cache_path if cache_path is not None or storage_url is not None
                               else default_cache_path(), families)
    analyses = [analyse(r, refs) for r in runs]
    source = " + ".join(x for x in (f"cache {cache_path}" if cache_path else "",
                                    f"storage {storage_url}" if storage_url else "") if x) or \
        f"cache {default_cache_path()}"

    import matplotlib
    matplotlib.use("Agg", force=True)  # files only: never a display

    try:
        return _write_report(out, analyses, source, start, selectors)
    except OSError as exc:  # an unwritable place (/proc, a read-only folder) or a full disk
        raise UserError(f"-o {out}: cannot write the report there ({exc.strerror or one_line(exc)}"
                        f"{': ' + str(exc.filename) if exc.filename else ''})") from None


def selector_lines(cache_path: Path | None, families: Sequence[str] = ()) -> list[str]:
    """One line per selector in the cache (autosoft generalize): its family, GPU, NVRTC major,
    configurations, shapes fitted and tree depth; none without a cache file."""
    if cache_path is None or not Path(cache_path).is_file():
        return []
    return [s.summary() for s in Cache(cache_path, create=False).selectors() if not families or s.family in families]


def _write_report(out: Path, analyses: Sequence[Analysis], source: str, start: float,
                  selectors: Sequence[str] = ()) -> ReportResult:
    """The PNGs and the page, each written whole (a temporary file, then a rename)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names: list[str] = []
    memory = [a for a in analyses if a.memory_bound and a.nbytes]
    jobs: list[tuple[str, Any]] = []
    if memory:
        jobs.append(("bandwidth.png", lambda p: png_bandwidth(memory, p)))
    compute = [a for a in analyses if not a.memory_bound]
    if compute:
        jobs.append(("tflops.png", lambda p: png_tflops(compute, p)))
    for kind in PNG_KINDS:
        jobs.append((f"{kind}.png", lambda p, kind=kind: png_per_problem(kind, analyses, p)))
    for name, draw in jobs:
        path = out / name
        tmp = out / f".{name}.{os.getpid()}.png"
        try:
            draw(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(path)
        names.append(name)
    page = render_page(analyses, source, names, selectors)
    tmp = out / f".index.{os.getpid()}.html"  # open() honours the umask, as the PNGs do
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out / "index.html")
    finally:
        tmp.unlink(missing_ok=True)
    return ReportResult(out / "index.html", tuple(written), len(analyses), time.perf_counter() - start)
