"""The package's type hints as a type checker sees them: py.typed ships, and the overloads of the
public functions give torch for torch, CuPy for CuPy (and for other DLPack producers), pairs with
return_lse=True, and errors for arrays of two kinds or no array at all. Minimal stand-ins for
torch and CuPy keep the check independent of what is installed (CuPy ships no type hints)."""
from __future__ import annotations

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


def test_the_overloads_give_each_call_its_array_kind(tmp_path, monkeypatch):
    api = pytest.importorskip("mypy.api")
    for name, text in STUBS.items():
        (tmp_path / "stubs" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "stubs" / name).write_text(text)
    sample = tmp_path / "sample.py"
    sample.write_text(SAMPLE)
    monkeypatch.setenv("MYPYPATH", f"{tmp_path / 'stubs'}:{REPO}")
    out, err, _ = api.run([str(sample), "--python-version", "3.11", "--follow-imports", "silent",
                           "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", "--hide-error-context"])
    assert not err, err
    revealed = dict(re.findall(r"sample\.py:(\d+): note: Revealed type is \"(.*)\"", out))
    lines = SAMPLE.splitlines()
    by_mark = {int(m.group(1)): revealed.get(str(i + 1)) for i, line in enumerate(lines)
               if (m := re.search(r"# (\d+)$", line))}
    assert by_mark[1] == "torch.Tensor" and by_mark[2] == "cupy.ndarray" and by_mark[3] == "cupy.ndarray"
    assert by_mark[4] == "torch.Tensor"
    assert by_mark[5] == "tuple[cupy.ndarray, cupy.ndarray]"
    assert by_mark[6] == "tuple[torch.Tensor, torch.Tensor]"
    assert by_mark[7] in ("int", "builtins.int")
    assert by_mark[8] is not None and "Any" in by_mark[8]  # a family's function, served at run time
    assert by_mark[9] == "torch.Tensor" and by_mark[10] == "cupy.ndarray"
    errors = {int(n) for n in re.findall(r"sample\.py:(\d+): error:", out)}
    expected = {i + 1 for i, line in enumerate(lines) if "# error" in line}
    assert errors == expected, out
