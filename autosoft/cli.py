"""The command line: argument parsing and printing only; the work happens in the other modules."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

from ._version import __version__
from .cache import Cache, default_cache_path
from .errors import UserError
from .families import families, get_family
from .families.base import Family, Problem, Target, build_variant, option_flag, params_from_text, point_space, space_of
from .selector import MAX_CONFIGS
from .worker import Watchdog


def user_path(text: str) -> Path:
    """An argparse type for file paths: `~` expanded, since the shell leaves `--cache=~/x` as it is."""
    return Path(text).expanduser()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise UserError(f"{message} (see `{self.prog} --help`)")


def family_summary(family: Family) -> str:
    """What a family computes, for --help: the first paragraph of its class docstring on one line
    (its first line alone cut the sentence short, e.g. "... or y = log_softmax(x) with the")."""
    doc = (type(family).__doc__ or family.name).strip()
    return " ".join(doc.split("\n\n")[0].split())


def build_parser() -> argparse.ArgumentParser:
    """The command line. tune, export and render take a family word, and each family brings its
    own --shape form, --dtype choices and default, and problem options (e.g. attention --causal)."""
    parser = _Parser(prog="autosoft", description="Autotuned GPU softmax and attention kernels.")
    parser.add_argument("--version", action="version", version=f"autosoft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def cache_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cache", type=user_path, default=None,
                       help="cache file (default: $AUTOSOFT_CACHE_DIR/kernels.sqlite or the user cache dir)")

    def per_family(command: argparse.ArgumentParser, add_args) -> None:
        """One sub-command per registered family under `command`, each with its own arguments."""
        by_family = command.add_subparsers(dest="family", required=True, metavar="FAMILY",
                                           parser_class=_Parser, title="families")
        for family in families().values():
            doc = family_summary(family)
            p = by_family.add_parser(family.name, help=doc, description=textwrap.fill(doc, 80),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
            problem_args(p, family)
            add_args(p, family)

    tune = sub.add_parser(
        "tune", help="search for the fastest correct variant of one or many problems and store each",
        description="Tune one problem (a family word, --shape, --dtype), many (repeat --shape/--dtype: they "
                    "are crossed), or every problem of a problems file (--problems FILE, no family word). "
                    "Options may come before or after the family word.",
        usage="autosoft tune [options] {FAMILY --shape S [--shape S ...] [--dtype D ...] | --problems FILE}")

    def tune_args(p: argparse.ArgumentParser, family: Family | None = None) -> None:
        # on the family's parser too, where a value given overrides the one before the family word
        d = (lambda value: argparse.SUPPRESS) if family is not None else (lambda value: value)
        p.add_argument("--trials", type=int, default=d(60), help="variants to evaluate per problem (default 60)")
        p.add_argument("--seed", type=int, default=d(0), help="seed of the search and of the test inputs")
        p.add_argument("--resume", action="store_true", default=d(False),
                       help="continue the interrupted tune (its studies, and a batch's finished problems) "
                            "instead of starting afresh; a --storage URL is always continued")
        p.add_argument("--timeout-multiple", type=float, default=d(Watchdog.multiple),
                       help="watchdog: an evaluation may take this many times the default variant's kernel "
                            f"time per launch (default {Watchdog.multiple:g})")
        p.add_argument("--timeout-floor", type=float, default=d(Watchdog.floor_s),
                       help=f"watchdog: never less than this many seconds (default {Watchdog.floor_s:g})")
        p.add_argument("--timeout-cap", type=float, default=d(Watchdog.cap_s),
                       help=f"watchdog: never more than this many seconds (default {Watchdog.cap_s:g})")
        p.add_argument("--storage", default=d(None), metavar="URL",
                       help="Optuna storage shared by every worker of the batch: journal:///FILE (several "
                            "processes of one host), postgresql://USER@HOST/DB (many hosts: start the same "
                            "command on each); default: <cache stem>-studies.sqlite beside the cache for one "
                            "process, <cache stem>-studies.log for --gpus/--ray")
        p.add_argument("--gpus", default=d(None), metavar="all|LIST",
                       help="one worker process per GPU, each pinned with CUDA_VISIBLE_DEVICES: all, or indices "
                            "such as 0,1,3 (default: one worker in this process, on the current GPU)")
        p.add_argument("--ray", nargs="?", const="", default=d(None), metavar="ADDRESS",
                       help="one worker per GPU of the Ray cluster at ADDRESS (default: RAY_ADDRESS or a local "
                            "cluster); needs pip install 'autosoft[ray]'")
        p.add_argument("--replay", type=user_path, default=d(None), metavar="FILE",
                       help="simulation: answer every trial from the trials recorded in this cache file instead "
                            "of the GPU (no GPU needed; for trying a batch or a cluster set-up)")
        p.add_argument("--replay-delay", type=float, default=d(0.0), metavar="SECONDS",
                       help="with --replay: how long each simulated evaluation takes (default 0)")
        p.add_argument("--cache", type=user_path, default=d(None),
                       help="cache file (default: $AUTOSOFT_CACHE_DIR/kernels.sqlite or the user cache dir)")
        if family is None:
            p.add_argument("--problems", type=user_path, default=None, metavar="FILE",
                           help="tune every problem of this YAML file (format: README, 'Many problems'; "
                                "AUTOSOFT_RECORD=FILE writes one from a program's calls)")

    tune_args(tune)
    by_family = tune.add_subparsers(dest="family", required=False, metavar="FAMILY", parser_class=_Parser,
                                    title="families")
    for family in families().values():
        doc = family_summary(family)
        p = by_family.add_parser(family.name, help=doc, description=textwrap.fill(doc, 80),
                                 prog=f"autosoft tune {family.name}", formatter_class=argparse.RawDescriptionHelpFormatter)
        problem_args(p, family, many=True)
        tune_args(p, family)

    generalize = sub.add_parser(
        "generalize", help="fit a family's selector for shapes nobody tuned, from its tuned shapes on this GPU",
        description="From the family's entries and recorded trials in the cache on this GPU: choose a few "
                    "configurations (a greedy cover of the tuned shapes), time each on every tuned shape, and fit a "
                    "decision tree over the shape's features. Dispatch uses it for a shape with no exact entry, "
                    "verified before first use. Needs the GPU and at least 3 tuned shapes of the family.")
    generalize.add_argument("family", choices=list(families()), metavar="FAMILY",
                            help="one of " + ", ".join(families()))
    generalize.add_argument("--max-configs", type=int, default=MAX_CONFIGS,
                            help="at most this many configurations to choose between; fewer when they already "
                                 f"cover every tuned shape (default {MAX_CONFIGS})")
    cache_arg(generalize)

    lst = sub.add_parser("list", help="show the entries of a cache file, or the results in a study storage")
    lst.add_argument("--storage", default=None, metavar="URL",
                     help="show the results a batch tune wrote in this storage (with the host that tuned each)")
    cache_arg(lst)

    collect = sub.add_parser("collect", help="write the results of a batch tune's storage into a cache file")
    collect.add_argument("--storage", required=True, metavar="URL", help="the storage the workers shared")
    cache_arg(collect)

    export = sub.add_parser("export", help="write the tuned variant as a standalone .cu file")

    def export_args(p: argparse.ArgumentParser, family: Family) -> None:
        p.add_argument("-o", "--output", type=user_path, required=True,
                       help="file to write (replaced whole, never left half-written)")
        cache_arg(p)

    per_family(export, export_args)

    render = sub.add_parser("render", help="print a variant's CUDA source (no GPU needed)")

    def render_args(p: argparse.ArgumentParser, family: Family) -> None:
        p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                       help="set a parameter (repeatable); the rest come from the heuristic default")
        p.add_argument("--arch", default=family.archs[-1], type=_arch,
                       help=f"compute capability to lay out for: {', '.join(family.archs)} "
                            f"(or sm_90 style; default {family.archs[-1]})")
        p.epilog = "parameters (--param NAME=VALUE):\n" + "\n".join(
            f"  {q.name:12} {', '.join(map(str, q.values))}" + (f"\n  {'':12} {q.doc}" if q.doc else "")
            for q in space_of(family).parameters)

    per_family(render, render_args)

    report = sub.add_parser("report", help="plots of what tuning runs found (from stored data; no GPU needed)",
                            description="Write DIR/index.html (self-contained) and a PNG per figure from a tuned "
                                        "cache and/or an Optuna storage. For live viewing of a study: "
                                        "optuna-dashboard sqlite:///<cache stem>-studies.sqlite")
    cache_arg(report)
    report.add_argument("--storage", default=None, metavar="URL",
                        help="Optuna storage for per-trial data: sqlite:///FILE (the cache's entries are read from "
                             "the <stem>.sqlite beside a <stem>-studies.sqlite unless --cache says otherwise), "
                             "postgresql://..., or a journal file (journal:///FILE or a path ending .log)")
    report.add_argument("--family", action="append", default=[], help="only this family (repeatable)")
    report.add_argument("--shape", action="append", default=[], help="only this shape, as `autosoft list` "
                                                                      "writes it (repeatable)")
    report.add_argument("--dtype", action="append", default=[], help="only this dtype (repeatable)")
    report.add_argument("--bench", action="append", default=[], type=user_path, metavar="FILE",
                        help="benchmark JSON (benchmarks/results/*.json) whose torch/Triton figures join the charts")
    report.add_argument("-o", "--output", type=user_path, required=True, metavar="DIR",
                        help="folder to write index.html and the PNGs into (created)")
    report.add_argument("--open", action="store_true", help="print the path of index.html (starts nothing)")
    native = sub.add_parser("native", help="build the compiled torch operator kernels (torch, a C++ compiler, ninja)",
                            description="Build autosoft/native_ops.cpp for this torch: from then on, "
                                        "torch.ops.autosoft.softmax and log_softmax launch tuned kernels from "
                                        "C++ on CUDA tensors, with no Python in a call (see autosoft/native.py). "
                                        "Built once per torch version, into the folder beside the kernel cache.")
    native.add_argument("--force", action="store_true", help="build again even where a build exists")
    native.add_argument("--verbose", action="store_true", help="show the compiler's output")
    return parser


def problem_args(p: argparse.ArgumentParser, family: Family, many: bool = False) -> None:
    """--shape, --dtype (repeatable for `tune`: crossed) and the family's problem options."""
    if many:
        p.add_argument("--shape", required=True, action="append",
                       help=f"problem shape: {family.shape_help} (repeatable)")
        p.add_argument("--dtype", action="append", default=None,
                       help=f"one of {', '.join(family.dtypes)}, default {family.default_dtype} (repeatable)")
    else:
        p.add_argument("--shape", required=True, help=f"problem shape: {family.shape_help}")
        p.add_argument("--dtype", default=family.default_dtype,
                       help=f"one of {', '.join(family.dtypes)} (default {family.default_dtype})")
    for option in family.options:
        flag = option_flag(option.name)
        if option.kind == "flag":
            p.add_argument(flag, dest=f"option_{option.name}", action="store_true", help=option.help)
        else:
            p.add_argument(flag, dest=f"option_{option.name}", default=None, metavar=option.kind.upper(),
                           type={"int": int, "float": float}[option.kind], help=option.help)


def _arch(text: str) -> str:
    """"90", "sm_90" or "sm_90a" -> "90"."""
    arch = text.strip().lower().removeprefix("sm_").removesuffix("a")
    if not arch.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability such as 90 or sm_90")
    return arch


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with warnings.catch_warnings():  # restores the global hooks when main() is called in-process
            warnings.showwarning = _show_warning
            args, extra = build_parser().parse_known_args(argv)
            if extra:  # argparse would blame the top-level parser; name the command that was meant
                where = " ".join(w for w in ("autosoft", args.command, getattr(args, "family", None)) if w)
                raise UserError(f"unrecognized arguments: {' '.join(extra)} (see `{where} --help`)")
            # every command, whether or not it reads the cache (render, list --storage) or finds the GPU
            # first (tune): an AUTOSOFT_CACHE_DIR naming a file is a mistake to hear of at once
            default_cache_path()
            code = {"tune": cmd_tune, "list": cmd_list, "export": cmd_export, "render": cmd_render,
                    "report": cmd_report, "collect": cmd_collect, "native": cmd_native,
                    "generalize": cmd_generalize}[args.command](args)
            if sys.stdout is not None:
                sys.stdout.flush()  # a reader that went away shows here, where it is caught, not at exit
            return code
    except UserError as exc:
        print(f"autosoft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autosoft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `autosoft list | head -2`: the reader has what it wanted; stop quietly, like other Unix tools.
        # stdout still holds unwritten bytes: point it at /dev/null so the interpreter's last flush succeeds.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (AttributeError, OSError, ValueError):  # stdout is not a file (e.g. replaced in-process)
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a writer the pipe closed on


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: object = None, line: str | None = None) -> None:
    """Warnings (e.g. a skipped cache row) on one line each, like the errors, without source lines."""
    try:
        print(f"autosoft: warning: {' '.join(str(message).split())}", file=sys.stderr)
    except (OSError, ValueError):  # stderr closed: nowhere to say it
        pass


def _problem(args: argparse.Namespace) -> tuple[Family, Problem]:
    family = get_family(args.family)
    options = {o.name: getattr(args, f"option_{o.name}") for o in family.options}
    return family, family.problem(args.shape, args.dtype, {k: v for k, v in options.items() if v is not None})


def _options(args: argparse.Namespace, family: Family) -> dict:
    options = {o.name: getattr(args, f"option_{o.name}") for o in family.options}
    return {k: v for k, v in options.items() if v is not None and v is not False}


def cmd_tune(args: argparse.Namespace) -> int:
    from .problems import problems_from_args, read_problems

    if args.problems is not None and args.family:
        raise UserError("give either a family word with --shape, or --problems FILE, not both")
    if args.problems is not None:
        problems = read_problems(args.problems)
    elif args.family:
        family = get_family(args.family)
        problems = problems_from_args(family, args.shape, args.dtype or [], _options(args, family))
    else:
        raise UserError("name a family (" + ", ".join(families()) + ") with --shape, or --problems FILE "
                        "(see `autosoft tune --help`)")
    if args.trials < 1:
        raise UserError(f"--trials must be at least 1, got {args.trials}")
    if not 0 < args.timeout_floor <= args.timeout_cap or args.timeout_multiple <= 0:
        raise UserError("watchdog: need 0 < --timeout-floor <= --timeout-cap and --timeout-multiple > 0")
    if args.replay_delay < 0 or (args.replay_delay and args.replay is None):
        raise UserError("--replay-delay needs --replay and a number of seconds >= 0")
    if args.gpus is not None and args.ray is not None:
        raise UserError("--gpus places workers on this host, --ray on a Ray cluster: give one of them")
    watchdog = Watchdog(args.timeout_multiple, args.timeout_floor, args.timeout_cap)
    batch = (len(problems) > 1 or args.storage is not None or args.gpus is not None or args.ray is not None
             or args.replay is not None)
    if batch:
        return _tune_batch(args, problems, watchdog)
    return _tune_one(args, problems[0], watchdog)


def _gpu_list(text: str, replay: bool) -> list[str]:
    if text.strip() == "all":
        if replay:
            raise UserError("--gpus all: a replay has no GPUs to count; list them, e.g. --gpus 0,1,2,3")
        from .runtime import cupy_module

        return [str(i) for i in range(cupy_module().cuda.runtime.getDeviceCount())]
    gpus = [g.strip() for g in text.split(",")]  # an empty item (0,,1) is a typo, not a separator
    if not all(g.isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
        raise UserError(f"--gpus {text!r}: expected all, or distinct GPU indices such as 0,1,3")
    return gpus


@contextlib.contextmanager
def _no_empty_files_left(cache_path: Path, storage_url: str) -> Iterator[list[int]]:
    """A tune that fails (an error, or exit 1 with nothing tuned) removes the cache file, the study
    storage file and the folders it created for them when they hold nothing: no entry, no trial.
    A file or folder that existed before is never touched, nor one a --resume could continue.
    The caller puts its exit code in the list it is given."""
    from .storage import holds_no_trial, local_file

    studies = local_file(storage_url)
    files = [p for p in (cache_path, studies) if p is not None and not p.exists()]
    folders = [f for p in files for f in (p.parent, *p.parent.parents) if not f.exists()]
    code: list[int] = []
    failed = True
    try:
        yield code
        failed = bool(code and code[0] != 0)
    finally:
        if failed:
            if cache_path in files and cache_path.is_file() and Cache.holds_nothing(cache_path):
                cache_path.unlink()
            if studies in files and studies.is_file() and holds_no_trial(storage_url):
                studies.unlink()
            for folder in sorted(set(folders), key=lambda f: len(f.parts), reverse=True):
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when empty


def _check_gpus_present(gpus: Sequence[str]) -> None:
    """One line, before any file or worker process, when --gpus names a GPU this machine lacks (no
    GPU at all: the workers each failed, and the batch said so in three lines). Counts the devices
    without making a CUDA context here; with CUDA_VISIBLE_DEVICES set the workers' indices are the
    machine's, which the count here cannot check."""
    from .runtime import cupy_module

    count = cupy_module().cuda.runtime.getDeviceCount()
    missing = [g for g in gpus if int(g) >= count]
    if missing and "CUDA_VISIBLE_DEVICES" not in os.environ:
        raise UserError(f"--gpus {','.join(gpus)}: this machine has {count} GPU{'' if count == 1 else 's'} "
                        f"(indices 0 to {count - 1}); no GPU {','.join(missing)}")


def _tune_batch(args: argparse.Namespace, problems: list[Problem], watchdog: Watchdog) -> int:
    from .batch import BatchSpec, run_batch
    from .storage import check_url, default_storage_url, describe

    if args.storage is not None:
        check_url(args.storage)  # a mistyped URL or a missing driver, before the GPU and any file
    gpus = _gpu_list(args.gpus, args.replay is not None) if args.gpus is not None else None
    # --gpus runs its workers in processes of their own beside this one (which draws the progress
    # from the storage), even for one GPU: a journal file, as the storage table of README says
    several = args.ray is not None or gpus is not None
    if args.replay is None and args.ray is None:
        if gpus is None:
            from .runtime import device_info

            device_info()  # fails with a clear message before any file is touched
        else:
            _check_gpus_present(gpus)
    if args.replay is not None and not args.replay.is_file():
        raise UserError(f"--replay {args.replay}: no such file")
    if args.ray is not None:
        from .ray_workers import check_reachable

        check_reachable(args.ray or None)  # before any file: ray.init retries an unreachable one for minutes
    cache_path = args.cache or default_cache_path()
    storage = args.storage or default_storage_url(cache_path, 2 if several else 1)
    spec = BatchSpec(problems=tuple(problems), trials=args.trials, cache=str(cache_path), storage=storage,
                     seed=args.seed, fresh=args.storage is None and not args.resume,
                     replay=str(args.replay) if args.replay else None, replay_delay_s=args.replay_delay,
                     watchdog=watchdog)
    where = ("on Ray" if args.ray is not None else f"on GPUs {','.join(gpus)}" if gpus else "in this process")
    count = f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
    print(f"tuning {count}, {args.trials} trials each, {where}"
          f"{' (replaying ' + str(args.replay) + ')' if args.replay else ''}; storage {describe(storage)}",
          file=sys.stderr)
    with _no_empty_files_left(cache_path, storage) as code, _sigterm_as_interrupt():
        # (SIGTERM: `kill` or a scheduler's stop: workers give their problems back)
        result = run_batch(spec, gpus=gpus, ray_address=args.ray or None, use_ray=args.ray is not None)
        failed = [r for r in result.results if not r.get("entry")]
        code.append(1 if result.missing or failed else 0)  # a dead worker whose problem another finished is no failure
    print_results(result.results)
    print(f"{len(result.results)} of {len(problems)} problems tuned in {result.seconds:.1f} s; "
          f"entries in {cache_path}" + (f" and in {describe(storage)}" if args.storage else ""))
    for p in result.missing:
        print(f"not finished: {p.family} {p.shape_text} {p.dtype}")
    return code[0]


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread while the block runs, so a batch
    stopped by `kill` (or Slurm, Kubernetes) cleans up as after Ctrl-C: its worker processes are
    interrupted and give their problems back, instead of being left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def print_results(results: list) -> None:
    """The batch summary: one row per problem, as the board holds it."""
    from .batch import result_summary

    if not results:
        return
    print(f"{'family':9} {'dtype':9} {'shape':18} {'time (us)':>10} {'vs default':>10} {'rate':>14} "
          f"{'trials':>6} {'host':16} variant")
    for r in results:
        problem, row = r["problem"], result_summary(r)
        family = get_family(problem["family"]) if problem["family"] in families() else None
        t = row["time_us"]
        if t is None:
            print(f"{problem['family']:9} {problem['dtype']:9} {problem['shape']:18} {'no correct variant':>36}"
                  f" {row['trials']:6} {row['host'][:16]:16}")
            continue
        speedup = f"{row['default_time_us'] / t:9.2f}x" if row["default_time_us"] else f"{'-':>10}"
        rate = "-"
        if family is not None:
            parsed = family.parse_problem(problem["shape"], problem["dtype"])
            flops = family.flops(parsed)
            if flops:
                rate = f"{flops / (t * 1e-6) / 1e12:.1f} TF/s"
            elif row["copy_time_us"]:
                rate = f"{100 * row['copy_time_us'] / t:.1f}% copy"
        print(f"{problem['family']:9} {problem['dtype']:9} {problem['shape']:18} {t:10.2f} {speedup} {rate:>14} "
              f"{row['trials']:6} {row['host'][:16]:16} {row['variant']}")


def _tune_one(args: argparse.Namespace, problem: Problem, watchdog: Watchdog) -> int:
    """One problem in this process: the detailed report (best, default, copy)."""
    from .runtime import device_info
    from .storage import default_storage_url
    from .tune import params_text, print_progress, tune

    family = get_family(problem.family)
    device = device_info()  # fails with a clear message before any file is touched
    cache_path = args.cache or default_cache_path()
    with _no_empty_files_left(cache_path, default_storage_url(cache_path, 1)) as code:
        cache = Cache(cache_path)
        print(f"tuning {family.name} {problem.shape_text} {problem.dtype} on {device.name} "
              f"(sm_{device.compute_capability}, NVRTC {device.cuda_version}), {args.trials} trials",
              file=sys.stderr)
        report = tune(family, problem, args.trials, cache, seed=args.seed, progress=print_progress(),
                      resume=args.resume, watchdog=watchdog)
        code.append(0 if report.best is not None else 1)
    nbytes = family.bytes_moved(problem)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report.counts().items()))
    resumed = f", {report.resumed} from the interrupted run" if report.resumed else ""
    restarts = f", GPU worker restarted {report.worker_restarts}x" if report.worker_restarts else ""
    print(f"\n{family.name} {problem.shape_text} {problem.dtype} on {device.name}: {len(report.trials)} trials"
          f"{resumed} in {report.seconds:.1f} s ({report.trials_per_minute:.0f} trials/min); {counts}{restarts}")
    rows = []
    if report.best:
        rows.append(("best", report.best.variant.name, report.best.outcome.time_us))
    d = report.default.outcome
    rows.append(("default", report.default.variant.name, d.time_us if d.ok else None))
    rows.append(("copy", "device-to-device copy of the same bytes", report.copy_time_us))
    flops = family.flops(problem)
    peak = report.peak_tflops
    if flops:  # compute-bound: the rate, not the bandwidth, is what matters
        rows = rows[:-1]
        if peak:
            print(f"peak: a dense float16 matrix product on this GPU runs at {peak:.0f} TFLOP/s")
    print(f"{'':8} {'variant':58} {'time (us)':>10} "
          + (f"{'TFLOP/s':>9} {'% of peak':>10}" if flops else f"{'GB/s':>9} {'% of copy':>10}"))
    for label, name, t in rows:
        if t is None:
            print(f"{label:8} {name:58} {'failed: ' + d.status.value:>31}")
        elif flops:
            rate = flops / (t * 1e-6) / 1e12
            print(f"{label:8} {name:58} {t:10.2f} {rate:9.1f} " + (f"{100 * rate / peak:9.1f}%" if peak else f"{'-':>10}"))
        else:
            gbps = nbytes / (t * 1e-6) / 1e9
            print(f"{label:8} {name:58} {t:10.2f} {gbps:9.1f} {100 * report.copy_time_us / t:9.1f}%")
    if report.best is None:
        print("no correct variant found; nothing was stored")
        return 1
    print(f"best params: {params_text(report.best.variant.params)}")
    where = cache.path
    print(f"stored in {where}" if report.stored else f"a faster entry was already stored in {where}; kept it")
    return 0


def cmd_generalize(args: argparse.Namespace) -> int:
    """Fit and store the family's selector. The cache's own checks come before the GPU's, so a
    cache without enough shapes says so on any machine; nothing stored is changed on an error."""
    from .generalize import MIN_SHAPES, family_shapes, fit_selector
    from .runners import GpuRunner
    from .runtime import device_info

    family = get_family(args.family)
    if args.max_configs < 1:
        raise UserError(f"--max-configs must be at least 1, got {args.max_configs}")
    path = args.cache or default_cache_path()
    if not path.exists():
        raise UserError(f"no cache at {path}; tune some {family.name} shapes first (autosoft tune {family.name})")
    cache = Cache(path, create=False)
    shapes = family_shapes(cache, family)
    if len({(d, s) for _, d, s in shapes}) < MIN_SHAPES:
        raise UserError(f"{path}: {len(shapes)} tuned {family.name} shape{'' if len(shapes) == 1 else 's'}; "
                        f"a selector needs at least {MIN_SHAPES} (tune more with `autosoft tune {family.name}`)")
    device = device_info()  # no GPU: one line, before any work

    def show(n: int, total: int, what: str) -> None:
        print(f"timed the configurations on {n}/{total} shapes ({what})", file=sys.stderr)

    with GpuRunner() as runner:
        fitted = fit_selector(family, cache, runner, max_configs=args.max_configs, progress=show)
    ratios = fitted.training_ratios()
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    print(fitted.selector.summary())
    print(f"on the fitted shapes its pick runs at {100 * geomean:.1f}% of the best configuration's speed "
          f"(geometric mean; worst {100 * min(ratios, default=float('nan')):.1f}%)")
    print(f"stored in {path} (on {device.name}); `autosoft list` shows it")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Entries sorted by family, dtype, shape (dimensions as numbers), GPU; each with the NVRTC
    version that tuned it and whether it would serve on this machine: "exact" (this GPU and
    NVRTC), "same major" (another minor version: verified on first use), "no", or "-" without
    a GPU or NVRTC to compare with."""
    from .dispatch import cache_key, nvrtc_match

    if args.storage is not None:
        return _list_storage(args.storage)

    path = args.cache or default_cache_path()
    if not path.exists():
        print(f"no cache at {path} (autosoft tune creates it)")
        return 0
    try:
        from .runtime import device_info

        here = device_info()
    except UserError:  # no GPU, CuPy or NVRTC: nothing to compare an entry with
        here = None

    def shape_order(shape: str) -> tuple:
        dims, _, flags = shape.partition("+")
        try:
            return (0, tuple(int(d) for d in dims.split("x")), flags)
        except ValueError:
            return (1, (), shape)  # not a shape of numbers: after the others, as text

    def serves(e) -> str:
        if here is None:
            return "-"
        try:  # the key this machine would look up for the entry's own problem
            problem = get_family(e.key.family).parse_problem(e.key.shape, e.key.dtype)
            return nvrtc_match(e.key, cache_key(problem, here)) or "no"
        except (UserError, ValueError):  # a family this autosoft does not know, or a malformed shape
            return "no"

    entries = sorted(Cache(path, create=False).entries(),
                     key=lambda e: (e.key.family, e.key.dtype, shape_order(e.key.shape), e.key.gpu_name,
                                    e.key.cuda_version))
    where = f"; here: {here.name}, NVRTC {here.cuda_version}" if here else "; no GPU or NVRTC here to tell what serves"
    print(f"{path}: {len(entries)} entries{where}")
    if entries:
        print(f"{'family':9} {'dtype':9} {'shape':14} {'gpu':22} {'sm':4} {'nvrtc':6} {'serves':10} "
              f"{'time (us)':>10} {'% of copy':>9}  variant")
    for e in entries:
        pct = f"{100 * e.copy_time_us / e.time_us:8.1f}%" if e.copy_time_us else f"{'-':>9}"
        print(f"{e.key.family:9} {e.key.dtype:9} {e.key.shape:14} {e.key.gpu_name[:22]:22} "
              f"{e.key.compute_capability:4} {e.key.cuda_version:6} {serves(e):10} {e.time_us:10.2f} {pct}  "
              f"{e.variant_name}")
    for selector in Cache(path, create=False).selectors():
        print(selector.summary())
    return 0


def _list_storage(url: str) -> int:
    from .batch import stored_results
    from .storage import describe, open_storage

    results = stored_results(open_storage(url))
    print(f"{describe(url)}: {len(results)} results")
    print_results(results)
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    """Every result of the storage into the cache file: an entry is added unless a faster one
    for the same key is there; the file is written as `tune` writes it (atomic per entry)."""
    from .batch import entry_from_record, stored_results
    from .storage import describe, open_storage

    results = stored_results(open_storage(args.storage))
    path = args.cache or default_cache_path()
    cache = Cache(path)
    entries = [entry_from_record(r["entry"]) for r in results if r.get("entry")]
    stored = sum(cache.put(e) for e in entries)
    print(f"{describe(args.storage)}: {len(entries)} entries; {stored} written into {path}, "
          f"{len(entries) - stored} already there as fast or faster")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .dispatch import find_entry
    from .export import check_output, standalone_source, write_atomically

    family, problem = _problem(args)
    path = args.cache or default_cache_path()
    check_output(args.output, path)  # before any work, and before anything is created
    entry, target = find_entry(Cache(path, create=False) if path.exists() else None, problem, path)
    variant = build_variant(family, problem, entry.params, target)
    write_atomically(args.output, standalone_source(variant, entry))
    print(f"wrote {args.output} ({variant.name}, {entry.time_us:.2f} us on {entry.key.gpu_name})")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .report import build_report

    result = build_report(args.output, cache_path=args.cache, storage_url=args.storage, families=args.family,
                          shapes=args.shape, dtypes=args.dtype, bench=args.bench)
    if args.open:
        print(result.index.resolve())
        return 0
    print(f"wrote {result.index} and {len(result.pngs)} PNGs for {result.problems} problems "
          f"in {result.seconds:.1f} s")
    return 0


def cmd_native(args: argparse.Namespace) -> int:
    """Build the compiled operator kernels (autosoft.native) and say where they are."""
    from . import native

    started = time.perf_counter()
    existed = not args.force and _native_built(native)
    try:
        path = native.build(force=args.force, verbose=args.verbose)
    except OSError as exc:  # the folder beside the cache cannot be made or written (read-only, /proc)
        where = f" {exc.filename}" if exc.filename else ""
        raise UserError(f"autosoft native: cannot write the build{where} ({exc.strerror or exc}); "
                        "point AUTOSOFT_CACHE_DIR at a writable folder") from None
    took = "" if existed else f" in {time.perf_counter() - started:.0f} s"
    print(f"{'already built' if existed else 'built'}{took}: {path}")
    print("torch.ops.autosoft.softmax/log_softmax and autosoft.softmax/log_softmax use it from the next "
          "process (AUTOSOFT_NATIVE=0 leaves it unloaded)")
    return 0


def _native_built(native: Any) -> bool:
    try:
        return bool(native.library_path().exists())
    except ImportError:
        return False  # build() says what is missing


def cmd_render(args: argparse.Namespace) -> int:
    family, problem = _problem(args)
    if args.arch not in family.archs:
        raise UserError(f"--arch {args.arch}: {family.name} kernels are built for "
                        f"{', '.join('sm_' + a for a in family.archs)}; choose one of {', '.join(family.archs)}")
    target = Target.for_arch(args.arch)
    params, given = params_from_text(family, problem, target, args.param)
    try:
        variant = build_variant(family, problem, params, target)
    except UserError as exc:
        raise UserError(f"{exc}{_defaults_in_play(family, problem, target, params, given)}") from None
    sys.stdout.write(with_build_lines(variant.source, variant.target.arch))
    return 0


def with_build_lines(source: str, arch: str) -> str:
    """The source with comment lines saying how to build it (compile.build_lines) at the end of its
    leading comment: a Hopper kernel needs its own nvcc target, which plain -arch=sm_90a is not."""
    from .compile import build_lines

    lines = source.split("\n")
    head = next((i for i, line in enumerate(lines) if not line.startswith("//")), len(lines))
    return "\n".join([*lines[:head], *(f"// {line}" for line in build_lines(source, arch)), *lines[head:]])


def _defaults_in_play(family: Family, problem: Problem, target: Target, params: dict, given: set[str]) -> str:
    """For a point that breaks a constraint: the default values (not set by --param) that the
    first broken constraint depends on, so the user sees what their --param conflicts with."""
    space, params = point_space(family, space_of(family).check_values(params))
    values = space.evaluate(params, family.problem_values(problem, target))
    depends = space._parameter_dependencies()
    for c in space.constraints:
        if not c.expression.evaluate(values):
            defaults = [n for n in space.names if n in depends(c.expression) and n not in given]
            if not defaults:
                return ""
            shown = " ".join(f"{n}={params[n]}" for n in defaults)
            return f" (with the default's {shown}; set them with --param)"
    return ""
