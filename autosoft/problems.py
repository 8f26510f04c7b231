"""The problems file: a list of problems that `autosoft tune --problems FILE` reads and that a
program records while it runs.

The format, YAML:

```yaml
softmax:
  - shape: [4096x128, 4096x256]   # one shape or a list
    dtype: [float32, float16]     # one or a list; omitted: the family's default dtype
attention:
  - shape: 1,32,1024,128
    dtype: bfloat16
    causal: [true, false]         # a problem option the family declares: one value or a list
```

The top level maps a family name to a list of items. Each item has `shape` (required), `dtype`
(optional; omitted or null: the family's default) and any of the options the family declares
(`Family.options`): a flag takes true or false (false: the option is absent), an int option an
integer, a float option a number; omitted or null: the option's default. Every list in an item
is crossed (the cartesian product: shapes, then dtypes, then options in declared order). A shape
is written as the family's --shape text ("4096x128", "1,32,1024,128") or as a YAML list of
integers: a list whose elements are all integers is ONE shape ([4096, 128]); any other list is a
list of shapes, each a text or a list of integers ([4096x128, [4096, 256]]). Problems come in
order of appearance, duplicates dropped.

Recording: with the environment variable AUTOSOFT_RECORD naming a file, every problem that a
program dispatches without a tuned entry for its exact shape (a nearest-shape entry or the
heuristic default served it) is added to that file, once per process (`record`, called by
dispatch.py when it prepares a problem). `write_problems` merges under an exclusive lock
(fcntl.flock on `<file>.lock`) and replaces the file atomically, so processes recording at once
lose nothing. It writes one item per problem (shape as "MxN" text without option suffixes,
dtype, set options), families sorted by name, problems of a family in order of appearance.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from .errors import UserError, one_line
from .files import replace_text
from .families import get_family
from .families.base import Family, OptionValue, Problem, ProblemOption

try:
    import fcntl
except ImportError:  # not POSIX: concurrent writers are not serialised
    fcntl = None  # type: ignore[assignment]

__all__ = ["RECORD_ENV", "problems_from_args", "read_problems", "record", "write_problems"]

RECORD_ENV = "AUTOSOFT_RECORD"
_HEADER = "# autosoft problems: `autosoft tune --problems FILE` tunes each (format: autosoft/problems.py)\n"


# --- reading ------------------------------------------------------------------------------

def read_problems(path: str | os.PathLike[str]) -> list[Problem]:
    """The problems a problems file holds, in order of appearance, duplicates dropped.
    Every error (missing or unreadable file, not YAML, no problems, a bad item) is a one-line
    UserError naming the file and, where it lies in one, the family and item."""
    problems = _parse(path, _load(path))
    if not problems:
        raise UserError(f"{os.fspath(path)}: holds no problems; write family names each with a list of items, "
                        f"e.g. `softmax: [{{shape: 4096x8192, dtype: float32}}]`")
    return problems


def _load(path: str | os.PathLike[str]) -> Any:
    """The file's YAML document (None for an empty file)."""
    name = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{name}: no such problems file") from None
    except UnicodeDecodeError:
        raise UserError(f"{name}: not a problems file (not UTF-8 text)") from None
    except OSError as exc:
        raise UserError(f"{name}: cannot read ({exc.strerror or one_line(exc)})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise UserError(f"{name}: not YAML: {getattr(exc, 'problem', None) or one_line(exc)}{at}") from None


def _parse(path: str | os.PathLike[str], document: Any) -> list[Problem]:
    name = os.fspath(path)
    if document is None:
        return []
    if not isinstance(document, dict):
        raise UserError(f"{name}: not a problems file: expected family names each with a list of items, "
                        f"not {_kind(document)}")
    problems: list[Problem] = []
    for family_name, items in document.items():
        try:
            family = get_family(str(family_name))
        except UserError as exc:
            raise UserError(f"{name}: {one_line(exc)}") from None
        if not isinstance(items, list):
            raise UserError(f"{name}: {family.name}: expected a list of items (- shape: ...), not {_kind(items)}")
        for number, item in enumerate(items, start=1):
            problems += _item_problems(family, item, f"{name}: {family.name} item {number}")
    return list(dict.fromkeys(problems))


def _item_problems(family: Family, item: Any, where: str) -> list[Problem]:
    """The problems one item stands for: every list in it crossed."""
    declared = {o.name: o for o in family.options}
    keys = ("shape", "dtype", *declared)
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected a mapping of {', '.join(keys)}, not {_kind(item)}")
    unknown = [k for k in item if k not in keys]
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(keys)})")
    if item.get("shape") is None:
        raise UserError(f"{where}: missing shape ({family.shape_help})")
    shapes = _shapes(item["shape"], where)
    dtypes: list[str | None] = [None] if item.get("dtype") is None else _listed(item["dtype"], "dtype", where)
    for dtype in dtypes:
        if dtype is not None and not isinstance(dtype, str):
            raise UserError(f"{where}: dtype {dtype!r}: expected a name, one of {', '.join(family.dtypes)}")
    given = [(n, _option_values(o, item[n], where)) for n, o in declared.items() if item.get(n) is not None]
    names = [n for n, _ in given]
    problems = []
    for shape, dtype, *values in itertools.product(shapes, dtypes, *(v for _, v in given)):
        try:
            problems.append(family.problem(shape, dtype, dict(zip(names, values))))
        except UserError as exc:
            raise UserError(f"{where}: {one_line(exc)}") from None
    return problems


def _shapes(value: Any, where: str) -> list[str]:
    """Shape texts from `shape`: a text, a list of ints (one shape) or a list of either."""
    if _is_int_list(value):
        return ["x".join(map(str, value))]
    shapes = _listed(value, "shape", where)
    if isinstance(value, list) and any(_is_int(v) for v in value):  # [1,32,1024,128, 1x32x2048x128]
        raise UserError(f"{where}: shape {value!r} mixes integers and texts: inside [ ] a shape written "
                        f"with commas falls apart; write it with x (1x32x1024x128), quote it or nest it")
    for one in shapes:
        if not (isinstance(one, str) or _is_int(one) or _is_int_list(one)):
            raise UserError(f"{where}: shape {one!r}: expected a text such as 4096x128 or a list of integers")
    return ["x".join(map(str, one)) if isinstance(one, list) else str(one) for one in shapes]


def _option_values(option: ProblemOption, value: Any, where: str) -> list[OptionValue]:
    values = _listed(value, option.name, where)
    for v in values:
        fits = (isinstance(v, bool) if option.kind == "flag" else _is_int(v) if option.kind == "int"
                else isinstance(v, (int, float)) and not isinstance(v, bool))
        if not fits:
            expected = {"flag": "true or false", "int": "an integer", "float": "a number"}[option.kind]
            raise UserError(f"{where}: {option.name} {v!r}: expected {expected}")
    return values


def _listed(value: Any, key: str, where: str) -> list[Any]:
    if not isinstance(value, list):
        return [value]
    if not value:
        raise UserError(f"{where}: {key} is an empty list")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(v) for v in value)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a text"}.get(type(value), f"{type(value).__name__} {value!r}")


# --- the command line ---------------------------------------------------------------------

def problems_from_args(family: Family | str, shapes: Sequence[str], dtypes: Sequence[str] = (),
                       options: Mapping[str, OptionValue] | None = None) -> list[Problem]:
    """The problems of repeated --shape and --dtype crossed (no --dtype: the family's default),
    with one value per option; duplicates dropped. The family's UserError on a bad value."""
    family = get_family(family) if isinstance(family, str) else family
    if not shapes:
        raise UserError(f"{family.name}: give a --shape ({family.shape_help})")
    return list(dict.fromkeys(family.problem(shape, dtype, dict(options or {}))
                              for shape in shapes for dtype in (list(dtypes) or [None])))


# --- writing ------------------------------------------------------------------------------

def write_problems(path: str | os.PathLike[str], problems: Iterable[Problem]) -> None:
    """Add problems to a problems file (created with its folder when missing): those it holds
    stay, new ones are appended, none twice; families sorted by name. Runs under an exclusive
    lock on `<path>.lock` and replaces the file atomically, so concurrent writers lose nothing;
    a file that is not a problems file is a UserError and stays as it is. Nothing new: the file
    is not rewritten."""
    name = os.fspath(path)
    target = Path(path)
    target = target.resolve() if target.is_symlink() else target  # write through a link, as open() would
    new = list(dict.fromkeys(problems))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(Path(f"{target}.lock")):
            held = _parse(name, _load(target)) if target.exists() else []
            merged = list(dict.fromkeys(held + new))
            if len(merged) == len(held):
                return  # nothing new: the file stays as it is (or absent)
            replace_text(target, _HEADER + _dump(merged))
    except OSError as exc:
        raise UserError(f"{name}: cannot write ({exc.strerror or one_line(exc)})") from None


def _dump(problems: Sequence[Problem]) -> str:
    document: dict[str, list[dict[str, Any]]] = {}
    for p in sorted(problems, key=lambda p: p.family):  # stable: each family's problems keep their order
        document.setdefault(p.family, []).append(
            {"shape": "x".join(map(str, p.shape)), "dtype": p.dtype, **dict(p.options)})
    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False) if document else ""


@contextlib.contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


# --- recording ----------------------------------------------------------------------------

_recorded: set[tuple[str, Problem]] = set()  # (file, problem) written (or tried) by this process
_recorded_lock = threading.Lock()


def record(problem: Problem) -> None:
    """Add a problem to the file AUTOSOFT_RECORD names, once per process; nothing when it is
    unset. A failure to write warns once for that problem and never raises."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    key = (os.path.abspath(path), problem)
    with _recorded_lock:
        if key in _recorded:
            return
        _recorded.add(key)
    try:
        write_problems(path, [problem])
    except Exception as exc:  # noqa: BLE001 - recording must never break the user's kernel call
        warnings.warn(f"autosoft: {RECORD_ENV}: could not record {problem.family} {problem.shape_text} "
                      f"{problem.dtype}: {one_line(exc)}", UserWarning, stacklevel=2)
