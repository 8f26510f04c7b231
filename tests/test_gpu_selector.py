"""GPU tier: a selector fitted on a few quickly tuned softmax shapes serves an untuned shape, its
pick, the nearest entry and the family's default verified on the device and raced first; the
public function's output is then right."""
from __future__ import annotations

import numpy as np
import pytest

from autosoft.cache import Cache
from autosoft.dispatch import DISPATCHER, SELECTOR, Dispatcher, selector_pick
from autosoft.families import get_family
from autosoft.families.base import Problem
from autosoft.generalize import fit_selector
from autosoft.runners import GpuRunner
from autosoft.tune import tune

pytestmark = pytest.mark.gpu

TUNED = [(256, 512), (1024, 2048), (64, 16384), (16, 65536)]
UNTUNED = Problem("softmax", "float32", (48, 16384))  # a row length tuned: its leaf's first pick is valid


def test_a_fitted_selector_serves_and_verifies_an_untuned_shape(cache_dir):
    import cupy as cp

    import autosoft

    family = get_family("softmax")
    cache = Cache(cache_dir / "kernels.sqlite")
    with GpuRunner() as runner:
        for shape in TUNED:
            report = tune(family, Problem("softmax", "float32", shape), 8, cache, runner=runner, seed=1)
            assert report.stored
        fitted = fit_selector(family, cache, runner, max_configs=4)
    selector = fitted.selector
    assert 1 <= len(selector.configs) <= 4 and len(selector.shapes) == len(TUNED)
    assert cache.selectors() == [selector]
    assert min(fitted.training_ratios()) > 0.5, "the tree picks a configuration near the best on its own shapes"

    pick = selector_pick(selector, family, UNTUNED, runner.device.target, first_only=True)
    assert pick is not None, "the leaf's first configuration ran on 64x16384, so it is valid on 48 rows of 16384"
    dispatcher = Dispatcher()
    choice = dispatcher.choose(UNTUNED)
    assert choice.source == f"{SELECTOR} (config {pick[0]} of {len(selector.configs)})", choice.source
    assert choice.fallback is not None and choice.fallback.source.startswith("nearest")
    store = dispatcher.store
    loaded = dispatcher.loaded(UNTUNED, 0)
    contenders = []
    for c in (choice, *choice.rivals):  # one of each kernel, as the race takes them
        if all(c.variant.digest != v.digest for v in contenders):
            contenders.append(c.variant)
    assert loaded.variant.digest in {v.digest for v in contenders}
    if len(contenders) > 1:
        assert store.race_winner(UNTUNED, contenders) == loaded.variant.digest, "the contenders raced"
        assert all(store.is_verified(v) for v in contenders), "each verified on the device before timing"
    assert store.is_verified(loaded.variant)
    assert Dispatcher().loaded(UNTUNED, 0).variant.digest == loaded.variant.digest, "the recorded winner serves"

    DISPATCHER.forget()  # the public function reads the cache again: earlier tests may have read it
    x = cp.random.standard_normal(UNTUNED.shape, dtype=cp.float32)
    y = autosoft.softmax(x)
    expected = np.exp(cp.asnumpy(x) - cp.asnumpy(x).max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(cp.asnumpy(y), expected, rtol=1e-4, atol=1e-6)

    # A new row count of that row length met first inside a CUDA graph capture (a serving engine
    # captures one graph per batch size): served without a race, which would sync and end the capture.
    torch = pytest.importorskip("torch")
    captured_shape = (40, UNTUNED.shape[1])
    xt = torch.randn(captured_shape, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yt = autosoft.softmax(xt)
    xt.normal_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(yt, torch.softmax(xt, dim=-1), rtol=1e-4, atol=1e-6)
    captured = Problem("softmax", "float32", captured_shape)
    assert store.race_winner(captured, contenders) is None, "not raced inside the capture, so not recorded"
