"""autosoft.testing.compiling on the CPU: the GPU tests' variants compiled together in one pool,
in order, each source once a run; a variant that does not compile fails the test with its log."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import autosoft.compile
from autosoft.testing import compiling


def _variant(source: str) -> SimpleNamespace:
    return SimpleNamespace(name=f"v_{source}", source=source, digest=f"digest of {source}",
                           target=SimpleNamespace(arch="90"))


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """compile_source replaced by a recorder (what it compiled, on which threads); an empty memo."""
    calls: list[tuple[str, str]] = []
    threads: set[str] = set()

    def compile_source(source, arch):
        calls.append((source, arch))
        threads.add(threading.current_thread().name)
        return autosoft.compile.CompileResult(source != "broken", source.encode(), f"log of {source}")
    monkeypatch.setattr(autosoft.compile, "compile_source", compile_source)
    monkeypatch.setattr(compiling, "_COMPILED", {})
    return SimpleNamespace(calls=calls, threads=threads)


def test_compiled_keeps_the_order_and_compiles_each_source_once_a_run(fake_nvrtc):
    variants = [_variant(s) for s in ("a", "b", "a", "c")]
    assert [r.cubin for r in compiling.compiled(variants)] == [b"a", b"b", b"a", b"c"]
    assert sorted(fake_nvrtc.calls) == [("a", "90"), ("b", "90"), ("c", "90")]
    assert [r.cubin for r in compiling.compiled([_variant("c"), _variant("d")])] == [b"c", b"d"]
    assert len(fake_nvrtc.calls) == 4, "c was compiled before"
    assert all(name.startswith("nvrtc") for name in fake_nvrtc.threads), "in the pool, not the test's thread"


def test_a_variant_that_does_not_compile_fails_the_test_with_its_log(fake_nvrtc):
    with pytest.raises(AssertionError, match="v_broken: log of broken"):
        next(compiling.loaded_variants([_variant("broken"), _variant("fine")]))
