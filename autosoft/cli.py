"""The command line: argument parsing and printing only; the work happens in the other modules."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

from . import __version__
from .cache import Cache, default_cache_path
from .errors import UserError
from .families import FAMILIES, get_family
from .families.base import DTYPES, Target, build_variant
from .worker import Watchdog


def user_path(text: str) -> Path:
    """An argparse type for file paths: `~` expanded, since the shell leaves `--cache=~/x` as it is."""
    return Path(text).expanduser()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise UserError(f"{message} (see `autosoft {self.prog.split()[-1]} --help`)"
                        if " " in self.prog else f"{message} (see `autosoft --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autosoft", description="Autotuned GPU softmax and attention kernels.")
    parser.add_argument("--version", action="version", version=f"autosoft {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def problem_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("family", help=f"kernel family: {', '.join(sorted(FAMILIES))}")
        p.add_argument("--shape", required=True,
                       help="problem shape: softmax MxN (e.g. 4096x8192), attention B,H,N,D (e.g. 1,32,8192,64)")
        p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)} (default float32)")
        p.add_argument("--causal", action="store_true", help="causal masking (attention only)")

    def cache_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cache", type=user_path, default=None,
                       help="cache file (default: $AUTOSOFT_CACHE_DIR/kernels.sqlite or the user cache dir)")

    tune = sub.add_parser("tune", help="search for the fastest correct variant and store it")
    problem_args(tune)
    tune.add_argument("--trials", type=int, default=60, help="variants to evaluate (default 60)")
    tune.add_argument("--seed", type=int, default=0, help="seed of the search and of the test inputs")
    tune.add_argument("--resume", action="store_true",
                      help="continue the interrupted study for this problem instead of starting afresh")
    tune.add_argument("--timeout-multiple", type=float, default=Watchdog.multiple,
                      help="watchdog: an evaluation may take this many times the default variant's kernel "
                           f"time per launch (default {Watchdog.multiple:g})")
    tune.add_argument("--timeout-floor", type=float, default=Watchdog.floor_s,
                      help=f"watchdog: never less than this many seconds (default {Watchdog.floor_s:g})")
    tune.add_argument("--timeout-cap", type=float, default=Watchdog.cap_s,
                      help=f"watchdog: never more than this many seconds (default {Watchdog.cap_s:g})")
    cache_arg(tune)

    lst = sub.add_parser("list", help="show the entries of a cache file")
    cache_arg(lst)

    export = sub.add_parser("export", help="write the tuned variant as a standalone .cu file")
    problem_args(export)
    export.add_argument("-o", "--output", type=user_path, required=True,
                        help="file to write (replaced whole, never left half-written)")
    cache_arg(export)

    render = sub.add_parser("render", help="print a variant's CUDA source (no GPU needed)")
    problem_args(render)
    render.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="set a parameter (repeatable); the rest come from the heuristic default")
    render.add_argument("--arch", default="90", help="compute capability to lay out for, e.g. 90 or 80")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with warnings.catch_warnings():  # restores the global hooks when main() is called in-process
            warnings.showwarning = _show_warning
            args = build_parser().parse_args(argv)
            code = {"tune": cmd_tune, "list": cmd_list, "export": cmd_export, "render": cmd_render}[args.command](args)
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


def _problem(args: argparse.Namespace):
    family = get_family(args.family)
    return family, family.problem(args.shape, args.dtype, ("causal",) if args.causal else ())


def cmd_tune(args: argparse.Namespace) -> int:
    from .runtime import device_info
    from .tune import params_text, print_progress, tune

    family, problem = _problem(args)
    if args.trials < 1:
        raise UserError(f"--trials must be at least 1, got {args.trials}")
    if not 0 < args.timeout_floor <= args.timeout_cap or args.timeout_multiple <= 0:
        raise UserError("watchdog: need 0 < --timeout-floor <= --timeout-cap and --timeout-multiple > 0")
    device = device_info()  # fails with a clear message before any file is touched
    cache = Cache(args.cache or default_cache_path())
    print(f"tuning {family.name} {problem.shape_text} {problem.dtype} on {device.name} "
          f"(sm_{device.compute_capability}, NVRTC {device.cuda_version}), {args.trials} trials", file=sys.stderr)
    watchdog = Watchdog(args.timeout_multiple, args.timeout_floor, args.timeout_cap)
    report = tune(family, problem, args.trials, cache, seed=args.seed, progress=print_progress(),
                  resume=args.resume, watchdog=watchdog)
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
    if flops:  # compute-bound: the rate, not the bandwidth, is what matters
        rows = rows[:-1]
    print(f"{'':8} {'variant':58} {'time (us)':>10} " + (f"{'TFLOP/s':>9}" if flops else f"{'GB/s':>9} {'% of copy':>10}"))
    for label, name, t in rows:
        if t is None:
            print(f"{label:8} {name:58} {'failed: ' + d.status.value:>31}")
        elif flops:
            print(f"{label:8} {name:58} {t:10.2f} {flops / (t * 1e-6) / 1e12:9.1f}")
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


def cmd_list(args: argparse.Namespace) -> int:
    path = args.cache or default_cache_path()
    if not path.exists():
        print(f"no cache at {path} (autosoft tune creates it)")
        return 0
    entries = Cache(path, create=False).entries()
    print(f"{path}: {len(entries)} entries")
    if entries:
        print(f"{'family':9} {'dtype':9} {'shape':14} {'gpu':22} {'sm':4} {'cuda':5} {'time (us)':>10} "
              f"{'% of copy':>9}  variant")
    for e in entries:
        pct = f"{100 * e.copy_time_us / e.time_us:8.1f}%" if e.copy_time_us else f"{'-':>9}"
        print(f"{e.key.family:9} {e.key.dtype:9} {e.key.shape:14} {e.key.gpu_name[:22]:22} "
              f"{e.key.compute_capability:4} {e.key.cuda_version:5} {e.time_us:10.2f} {pct}  {e.variant_name}")
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


def cmd_render(args: argparse.Namespace) -> int:
    family, problem = _problem(args)
    target = Target.for_arch(str(args.arch))
    from .families.base import space_of

    space = space_of(family)
    params = family.default_params(problem, target)
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--param {item!r}: expected NAME=VALUE, e.g. --param vec=4")
        params[name.strip()] = space.parse_value(name.strip(), value)
    sys.stdout.write(build_variant(family, problem, params, target).source)
    return 0
