"""The package's type hints as a type checker sees them: py.typed ships, and the overloads of the
public functions give torch for torch, CuPy for CuPy (and for other DLPack producers), pairs with
return_lse=True, and errors for arrays of two kinds or no array at all. Twice: with minimal
stand-ins for torch and CuPy (what holds where CuPy has stubs), and with the real packages as a
user's mypy sees them (CuPy ships no type hints: its arrays are Any, and so are calls on them)."""
from __future__ import annotations

import importlib.util
import re
import tomllib

import pytest

from helpers import REPO

STUBS = {
    "torch/__init__.pyi": "from typing import Any\nclass Tensor:\n    def __dlpack__(self, *a: Any, **k: Any) -> Any: ...\n",
    "cupy/__init__.pyi": "from typing import Any\nclass ndarray:\n    def __dlpack__(self, *a: Any, **k: Any) -> Any: ...\n",
}
SAMPLE = '''
from typing import Any
import autosoft
import cupy
import torch

class Producer:
    def __dlpack__(self, *a: Any, **k: Any) -> Any: ...

def use(t: torch.Tensor, c: cupy.ndarray, p: Producer) -> None:
    reveal_type(autosoft.softmax(t))  # 1
    reveal_type(autosoft.softmax(c))  # 2
    reveal_type(autosoft.softmax(p))  # 3
    reveal_type(autosoft.attention(t, t, t, causal=True))  # 4
    reveal_type(autosoft.attention(c, c, c, return_lse=True))  # 5
    reveal_type(autosoft.attention(t, t, t, True, None, True))  # 6
    reveal_type(autosoft.load_cache("tuned.sqlite"))  # 7
    reveal_type(autosoft.attention_colsum)  # 8
    reveal_type(autosoft.log_softmax(t, dim=0, out=t))  # 9
    reveal_type(autosoft.log_softmax(p, 1))  # 10
    autosoft.softmax([1.0, 2.0])  # error: no array
    autosoft.attention(t, c, t)  # error: two kinds
'''


def test_py_typed_ships_with_the_package():
    assert (REPO / "autosoft" / "py.typed").is_file()
    with open(REPO / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["autosoft"]


def test_every_package_of_the_source_is_installed():
    """pyproject lists packages by hand: a folder left out (autosoft.testing once was) is missing
    from a non-editable install, where plug-in families import the conformance suite from."""
    with open(REPO / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "autosoft").rglob("__init__.py")}
    assert found <= listed, found - listed


def run_mypy(sample_text: str, folder, mypy_path: str, cache, monkeypatch) -> tuple[str, dict[int, str | None], set[int]]:
    """mypy on a user's file: autosoft from the source tree, its own errors silent as for an
    installed package; mypy's output, the revealed type of each `# <n>` line, the error lines."""
    api = pytest.importorskip("mypy.api")
    sample = folder / "sample.py"
    sample.write_text(sample_text)
    monkeypatch.setenv("MYPYPATH", mypy_path)
    out, err, _ = api.run([str(sample), "--python-version", "3.11", "--follow-imports", "silent",
                           "--cache-dir", str(cache), "--no-error-summary", "--hide-error-context"])
    assert not err, err
    revealed = dict(re.findall(r"sample\.py:(\d+): note: Revealed type is \"(.*)\"", out))
    lines = sample_text.splitlines()
    by_mark = {int(m.group(1)): revealed.get(str(i + 1)) for i, line in enumerate(lines)
               if (m := re.search(r"# (\d+)$", line))}
    errors = {int(n) for n in re.findall(r"sample\.py:(\d+): error:", out)}
    return out, by_mark, errors


def test_the_overloads_give_each_call_its_array_kind(tmp_path, monkeypatch):
    for name, text in STUBS.items():
        (tmp_path / "stubs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "stubs" / name).write_text(text)
    out, by_mark, errors = run_mypy(SAMPLE, tmp_path, f"{tmp_path / 'stubs'}:{REPO}", tmp_path / "cache", monkeypatch)
    lines = SAMPLE.splitlines()
    assert by_mark[1] == "torch.Tensor" and by_mark[2] == "cupy.ndarray" and by_mark[3] == "cupy.ndarray"
    assert by_mark[4] == "torch.Tensor"
    assert by_mark[5] == "tuple[cupy.ndarray, cupy.ndarray]"
    assert by_mark[6] == "tuple[torch.Tensor, torch.Tensor]"
    assert by_mark[7] in ("int", "builtins.int")
    assert by_mark[8] is not None and "Any" in by_mark[8]  # a family's function, served at run time
    assert by_mark[9] == "torch.Tensor" and by_mark[10] == "cupy.ndarray"
    expected = {i + 1 for i, line in enumerate(lines) if "# error" in line}
    assert errors == expected, out


@pytest.mark.long
def test_with_the_real_packages_torch_calls_are_typed_and_cupy_calls_any(tmp_path, request, monkeypatch):
    """What README promises a user's mypy with torch and CuPy installed: calls on torch tensors
    return torch.Tensor (pairs with return_lse=True); CuPy ships no type hints, so a CuPy array is
    Any to mypy, calls on CuPy arrays and other DLPack producers are Any, and q, k, v of two kinds
    are not caught; a call with no array at all is still an error. The first run analyses torch
    (about 45 s on a 2-core machine); pytest's cache keeps mypy's cache for later runs."""
    for package in ("torch", "cupy"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    sample = SAMPLE.replace("import cupy\n", "import cupy  # type: ignore[import-untyped]\n")
    cache = request.config.cache.mkdir("mypy-real-packages") if getattr(request.config, "cache", None) \
        else tmp_path / "mypy-cache"  # pytest run with -p no:cacheprovider
    out, by_mark, errors = run_mypy(sample, tmp_path, str(REPO), cache, monkeypatch)
    tensor = "torch._tensor.Tensor"
    assert (by_mark[1], by_mark[4], by_mark[9]) == (tensor, tensor, tensor), out
    assert by_mark[6] == f"tuple[{tensor}, {tensor}]"
    assert (by_mark[2], by_mark[3], by_mark[5], by_mark[10]) == ("Any", "Any", "Any", "Any"), out
    assert by_mark[7] in ("int", "builtins.int") and by_mark[8] == "Any"
    lines = sample.splitlines()
    assert errors == {i + 1 for i, line in enumerate(lines) if "error: no array" in line}, out


def test_every_family_function_is_in_all_with_its_return_type():
    import inspect

    import autosoft
    from autosoft.families import families

    functions = {n for n, f in families().items() if f.has_python_call}
    assert functions and functions <= set(autosoft.__all__)
    assert {"softmax", "log_softmax", "attention", "load_cache"} <= set(autosoft.__all__)
    assert all(hasattr(autosoft, n) for n in autosoft.__all__)
    namespace: dict = {}
    exec("from autosoft import *", namespace)
    assert functions <= set(namespace)
    colsum = inspect.signature(autosoft.attention_colsum)
    assert colsum.return_annotation == "tuple[Array, Array] | tuple[Array, Array, Array]"
    assert list(colsum.parameters)[:4] == ["q", "k", "v", "split"]
    assert "Call" not in str(colsum)
