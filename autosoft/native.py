"""Compiled kernels for torch.ops.autosoft.softmax and log_softmax: build, load, record plans.

    autosoft native               # once per torch version: builds native_ops.cpp (a C++ compiler, ninja)
    import autosoft.torch_ops     # from then on registers the compiled kernels too

Why: an operator whose kernel is Python costs, per call from Python, the dispatcher's hop into
Python and back, and the output's allocation and cuLaunchKernel through Python wrappers. On the
H200 machine that was 18 us for torch.ops.autosoft.softmax on a small tuned input against 10 us
for torch.softmax (BENCHMARKS.md, issue 19). native_ops.cpp is the operators' AutogradCUDA kernel
in C++: a call whose plan is recorded allocates its output with torch and launches the recorded
kernel on torch's current stream, no Python in between. Anything else (a first call, gradients,
another dim, a non-contiguous input, tracing or dispatch modes, a split variant with a workspace)
comes back to `_miss`: the Python Autograd kernel of autosoft.torch_ops, the same path as without
the extension, after which the call's plan is recorded when it is a plain launch
(runtime.NativeLaunch: one kernel, the input's and output's addresses the only words that change).

The same records serve the public autosoft.softmax and autosoft.log_softmax, without the dispatcher:
the extension's `softmax_direct` and `log_softmax_direct` (what `direct` returns; autosoft.api calls
them first, once the first call on a CUDA tensor found them) launch a recorded plan and return the
output, or return None for any call they do not take (another dim, `out`, gradients, a
non-contiguous input, tracing or modes, a subclass), after which the public function's Python path
runs unchanged. A plain call whose plan is not recorded yet comes to `_direct_miss`: the Python path,
then the record, or a mark that the plan cannot be replayed (so those calls go to Python at once).

The extension is built by torch.utils.cpp_extension into <cache folder>/native/<name>, the cache
folder being kernels.sqlite's (AUTOSOFT_CACHE_DIR or the user cache), <name> naming a sha256 of the
source, the torch version and build, and the Python ABI: a new torch or autosoft builds anew. It is never
built on import (a build takes tens of seconds); `enable` and `direct` only load one that exists (one that
will not load gives a warning, and the Python paths serve). AUTOSOFT_NATIVE=0
keeps it unloaded. Records are dropped, with the plans they replay, whenever the dispatcher clears
its caches (load_cache, forget). Needs torch; imported by autosoft.torch_ops, the CLI, and autosoft.api
at the first call of autosoft.softmax or log_softmax on a CUDA tensor.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from .arrays import call_family
from .cache import default_cache_path
from .dispatch import DISPATCHER
from .errors import UserError

__all__ = ["SOURCE", "OPS", "NativeBuildError", "build", "library_path", "enable", "direct", "disable", "enabled",
           "recorded", "launches"]

SOURCE = Path(__file__).with_name("native_ops.cpp")
OPS = ("softmax", "log_softmax")
"""The operators with compiled kernels; native_ops.cpp numbers them by their position here."""


class NativeBuildError(UserError):
    """The extension could not be built (no torch, no compiler or ninja, a compile error)."""


_lock = threading.Lock()
_module: Any = None  # the loaded extension, once enable() found one
_kernels: dict[int, tuple[Callable[..., Any], str, tuple]] = {}  # op -> (Python Autograd kernel, family, plan options)
_kept: dict[tuple, Any] = {}  # what each record replays: plan key -> plan (keeps its module loaded)
_watching = False  # whether DISPATCHER.on_clear calls _forget
_asking_again: list[Callable[[], None]] = []  # what direct()'s callers gave to be told when enable() loads a build
# per operator of OPS: the softmax family's options as call_family takes them and keys its plans, and the
# public function its errors name (as autosoft.api's Python path calls call_family)
_PUBLIC: tuple[tuple[dict[str, Any] | None, tuple, str], ...] = (
    (None, (), "autosoft.softmax"), ({"log": True}, (("log", True),), "autosoft.log_softmax"))


def _name(torch: Any) -> str:
    # the torch build too, not its version only: PyPI's, conda-forge's and a source build of one
    # version link differently (C++ ABI, symbols), and a cache folder may serve several environments
    build = f"{getattr(torch.version, 'git_version', '')}:{getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', '')}"
    digest = hashlib.sha256(SOURCE.read_bytes() + b"\0" + torch.__version__.encode() + b"\0" + build.encode()
                            + b"\0" + sys.implementation.cache_tag.encode()).hexdigest()[:16]
    return f"autosoft_native_{digest}"


def library_path() -> Path:
    """Where this torch's build of the extension is (or would be): a .so file."""
    import torch

    name = _name(torch)
    return default_cache_path().parent / "native" / name / f"{name}.so"


def build(force: bool = False, verbose: bool = False) -> Path:
    """Build the extension for this torch and Python unless it is built (force: again); returns
    its path. NativeBuildError, with the reason on one line, where it cannot be built.

    The compiler runs in a child process (torch.utils.cpp_extension.load there): this process
    loads nothing, and cpp_extension's memory of what it built before in this process (it skips
    a second build of the same sources under the same name) cannot leave a new folder empty."""
    try:
        import torch  # noqa: F401 - library_path needs its version; the child imports it again
    except ImportError as exc:
        raise NativeBuildError(f"autosoft native: needs torch ({exc})") from None
    path = library_path()
    if path.exists() and not force:
        return path
    _ninja_on_path()
    if not shutil.which(os.environ.get("CXX", "c++")):
        raise NativeBuildError("autosoft native: no C++ compiler (c++, or the one $CXX names) on PATH")
    if shutil.which("ninja") is None:
        raise NativeBuildError('autosoft native: needs ninja (pip install ninja, or pip install "autosoft[native]")')
    # every build goes to a folder beside the library and replaces it only once it succeeded: a
    # failed rebuild leaves the working one in place, and a process that finds the library (two
    # xdist workers, two programs) never loads one the linker is still writing
    folder = path.parent / ("rebuild" if force and path.exists() else "staging")
    folder.mkdir(parents=True, exist_ok=True)
    built = folder / path.name
    if built != path and built.exists():
        built.unlink()
    child = subprocess.run([sys.executable, "-c", _BUILD, path.stem, str(SOURCE), str(folder), str(int(verbose))],
                           stdout=None if verbose else subprocess.PIPE, stderr=None if verbose else subprocess.PIPE,
                           text=True)
    if not force and path.exists() and (child.returncode != 0 or not built.exists()):
        # another process built it while this one waited for the build's lock, and moved it into
        # place: this one's child found nothing to build, or lost the library it was loading
        return path
    if child.returncode != 0 or not built.exists():
        lines = [line.strip() for line in (child.stderr or "").splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {child.returncode}"
        raise NativeBuildError(f"autosoft native: building {SOURCE.name} failed "
                               f"(see {folder}; run `autosoft native --force --verbose`): {reason}")
    if built != path:
        os.replace(built, path)
    return path


# what the build's child process runs: name, source, folder, verbose (cpp_extension builds under a
# file lock in the folder, so concurrent builds of one library wait for each other)
_BUILD = """import sys
from torch.utils import cpp_extension
name, source, folder, verbose = sys.argv[1:5]
cpp_extension.load(name=name, sources=[source], build_directory=folder, extra_cflags=["-O2"], verbose=verbose == "1")
"""


def _ninja_on_path() -> None:
    """PyPI's ninja installs its binary beside the package; torch looks for `ninja` on PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


def enable(kernels: Mapping[str, tuple[Callable[..., Any], str, tuple]] | None = None) -> bool:
    """Register the compiled kernels (AutogradCUDA of torch.ops.autosoft.softmax and log_softmax)
    where the extension is built, AUTOSOFT_NATIVE is not 0 and a CUDA driver is present; returns
    whether they are registered. `kernels`: per operator of OPS, its Python Autograd kernel
    (called for every call the compiled one does not take), the family it calls and that family's
    options as arrays.call_family keys its plans (the operator's declared plan_options);
    autosoft.torch_ops.register() passes them, and a later call (after `build`) may leave them out."""
    with _lock:
        if kernels is not None:
            _kernels.clear()
            _kernels.update({OPS.index(name): kernel for name, kernel in kernels.items()})
        if os.environ.get("AUTOSOFT_NATIVE", "").strip() == "0":
            return False
        if not _kernels:
            raise RuntimeError("autosoft.native.enable: import autosoft.torch_ops first (it passes the kernels)")
        launch = _loaded()
        if launch is None:
            return False
        if not _module.enabled():
            _module.enable(launch, _miss)
        asking_again = list(_asking_again)
    for ask_again in asking_again:  # a caller of direct() may have been told None before the build
        ask_again()
    return True


def direct(ask_again: Callable[[], None] | None = None
           ) -> tuple[Callable[[Any, Any, Any], Any], Callable[[Any, Any, Any], Any]] | None:
    """The compiled first steps of autosoft.softmax and autosoft.log_softmax, each f(x, dim, out)
    -> the output of a recorded plan, or None where the public function's Python path is to run;
    loads the extension where it is built. None where it is not built, AUTOSOFT_NATIVE is 0 or no
    CUDA driver is present. Needs no autosoft.torch_ops (no operator is registered). `ask_again`:
    called by every later enable() (after `build`, say), so that a caller holding this answer asks
    again (autosoft.api passes its reset)."""
    with _lock:
        if ask_again is not None and ask_again not in _asking_again:
            _asking_again.append(ask_again)
        if os.environ.get("AUTOSOFT_NATIVE", "").strip() == "0":
            return None
        launch = _loaded()
        if launch is None:
            return None
        return _module.softmax_direct, _module.log_softmax_direct


def _loaded() -> int | None:
    """The address of cuLaunchKernel once the extension is loaded (dispatcher clears drop its
    records) with its public entries on; None where there is no driver or no build. Called with
    _lock held."""
    global _module, _watching
    launch = _cu_launch_kernel()
    if launch is None:
        return None
    if _module is None:
        try:
            path = library_path()
        except UserError:  # AUTOSOFT_CACHE_DIR names a file: the calls will say so; importing must not
            return None
        if not path.exists():
            return None
        try:
            _module = _load(path)
        except (ImportError, OSError) as exc:
            # never an error for every call: the Python paths serve as without the build
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            warnings.warn(f"autosoft native: cannot load {path} ({first}); the Python paths serve instead. "
                          "Rebuild it with `autosoft native --force`", RuntimeWarning, stacklevel=2)
            return None
    if not _watching:
        DISPATCHER.on_clear(_forget)
        _watching = True
    if not _module.direct_on():  # the public functions' compiled first steps (disable() turns them off)
        _module.init(launch, _direct_miss)
    return launch


def disable() -> None:
    """Deregister the compiled kernels (the Python ones serve CUDA tensors again), turn the public
    functions' compiled first steps off (their Python path serves every call) and drop the records;
    enable() turns both on again."""
    with _lock:
        if _module is not None:
            _module.disable()
        _kept.clear()


def enabled() -> bool:
    """Whether the compiled kernels are registered."""
    return _module is not None and bool(_module.enabled())


def direct_enabled() -> bool:
    """Whether autosoft.softmax's and log_softmax's compiled first steps launch recorded plans."""
    return _module is not None and bool(_module.direct_on())


def recorded() -> int:
    """How many plans the compiled kernels replay."""
    return int(_module.size()) if _module is not None else 0


def launches() -> int:
    """How many calls the compiled kernels have launched themselves (the others went to Python)."""
    return int(_module.launches()) if _module is not None else 0


def _load(path: Path) -> Any:
    import torch  # noqa: F401 - the extension links against the libraries importing torch loads

    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"autosoft native: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cu_launch_kernel() -> int | None:
    """The driver's cuLaunchKernel (the library CuPy launches through), None without a driver."""
    try:
        return ctypes.cast(ctypes.CDLL("libcuda.so.1").cuLaunchKernel, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _miss(op: int, keyset: Any, x: Any, dim: int) -> Any:
    """A call the compiled kernel did not take: the Python Autograd kernel runs it; then, when the
    call was a plain one along the last dim, its plan is recorded if it is a plain launch."""
    kernel, family, options = _kernels[op]
    y = kernel(keyset, x, dim)
    # the plan under call_family's key was made for this dtype, shape and device whatever the call
    # (a subclass such as a fake tensor while tracing aside): the compiled kernel takes it from now on
    if dim == -1 and type(x) is sys.modules["torch"].Tensor and x.is_cuda:
        key = _plan_key(family, options, x)
        if key not in _kept:
            _record(op, x, DISPATCHER.fast.get(key), key)
    return y


def _direct_miss(op: int, x: Any) -> Any:
    """A public call (autosoft.softmax or log_softmax on a plain CUDA tensor along the last dim, no
    out) whose plan the compiled first step has no record of: the public function's Python path,
    then the plan recorded, or marked as one the compiled step leaves to Python."""
    options, opts, who = _PUBLIC[op]
    y = call_family("softmax", (x,), options=options, who=None if op == 0 else who)[0]
    key = _plan_key("softmax", opts, x)
    plan = DISPATCHER.fast.get(key)
    if plan is not None and key not in _kept and not _record(op, x, plan, key):
        _module.record_unreplayable(op, x)
    return y


def _plan_key(family: str, options: tuple, x: Any) -> tuple:
    """The key under which arrays.call_family keeps its plan for a call of `family` on the one
    tensor x with these options (as items) and no scalars."""
    return (family, options, (), x.dtype, x.shape, x.get_device())


def _record(op: int, x: Any, plan: Any, key: tuple) -> bool:
    """Record `plan` (made for calls like x) for the compiled kernels where it is a plain launch;
    whether it was."""
    native = getattr(plan, "native", None)
    if native is None:
        return False
    pointers = dict((at, word) for word, at in native.pointers)
    _module.record(op, x, native.function, list(native.geometry), list(native.words), pointers[0], pointers[1])
    _kept[key] = plan
    return True


def _forget() -> None:
    """The dispatcher cleared its plans: the records go first (clear returns once no launch uses
    one), then the plans they replay."""
    if _module is not None:
        _module.clear()
    _kept.clear()
