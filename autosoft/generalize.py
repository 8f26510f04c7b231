"""Fitting a family's selector (selector.py) from what a cache holds for it on this GPU.

`autosoft generalize FAMILY` runs fit_selector: the family's tuned shapes on the runner's GPU
(its name, compute capability, NVRTC major version and the current template and search-space
digests), the configurations their recorded trials and winners suggest (a greedy cover), each
configuration verified and timed on every tuned shape by the runner (the same GPU worker a tune
uses, the finalists' side-by-side re-timing included), and the tree fitted over the shapes'
features. The selector is stored in the cache beside the entries it was learned from.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ._version import __version__
from .cache import Cache, Entry
from .dispatch import _same_major, cache_key
from .errors import UserError
from .families.base import Family, Problem, Variant, build_variant, family_template_digest, space_of
from .runners import Runner
from .selector import MAX_CONFIGS, WITHIN, Sample, Selector, choose_configs, fit_tree, params_key, predict
from .tune import evaluation_launches, logged_times
from .worker import Watchdog

MIN_SHAPES = 3  # fewer tuned shapes than this teach a tree nothing a nearest entry would not


@dataclass(frozen=True)
class Fitted:
    selector: Selector
    samples: tuple[Sample, ...]

    def training_ratios(self) -> list[float]:
        """Per fitted shape: the best configuration's time over the time of the one the tree picks
        there (1.0: the tree picks the best; the first of its ranking that serves the shape)."""
        out = []
        for s in self.samples:
            served = [t for t in (s.times[i] for i in predict(self.selector.tree, s.features)) if t is not None]
            best = min((t for t in s.times if t is not None), default=None)
            if served and best is not None:
                out.append(best / served[0])
        return out


def label(problem: Problem) -> str:
    return f"{problem.dtype} {problem.shape_text}"


def family_shapes(cache: Cache, family: Family) -> set[tuple[str, str, str]]:
    """The (GPU, dtype, shape) of every entry of the family in the cache, whatever tuned it."""
    return {(e.key.gpu_name, e.key.dtype, e.key.shape) for e in cache.entries() if e.key.family == family.name}


def tuned_problems(cache: Cache, family: Family, gpu_name: str, compute_capability: str,
                   cuda_version: str) -> list[tuple[Problem, Entry]]:
    """The family's tuned problems that a selector for this GPU and NVRTC major may learn from:
    entries of this GPU, NVRTC major and the current digests, one per problem (this NVRTC
    version's first, then the fastest), in the cache's order."""
    digests = (family_template_digest(family), space_of(family).digest)
    chosen: dict[tuple[str, str], Entry] = {}
    for e in cache.entries():
        k = e.key
        if (k.family, k.gpu_name, k.compute_capability) != (family.name, gpu_name, compute_capability) \
                or (k.template_digest, k.space_digest) != digests or not _same_major(k.cuda_version, cuda_version):
            continue
        rank = (k.cuda_version != cuda_version, e.time_us)
        held = chosen.get((k.dtype, k.shape))
        if held is None or rank < (held.key.cuda_version != cuda_version, held.time_us):
            chosen[(k.dtype, k.shape)] = e
    out = []
    for e in chosen.values():
        try:
            out.append((family.parse_problem(e.key.shape, e.key.dtype), e))
        except UserError:
            continue  # a shape this family no longer takes
    return out


def recorded_times(cache: Cache, family: Family, problems: Sequence[tuple[Problem, Entry]],
                   gpu_name: str) -> dict[str, dict[str, float]]:
    """Per tuned problem (by label): the fastest recorded correct time of each configuration that
    is a point of the current space, and the entry's winner at its re-timed time."""
    space = space_of(family)
    logged = logged_times(cache, family, gpu_name, [(p.dtype, p.shape_text) for p, _ in problems])
    times = {label(p): dict(logged[(p.dtype, p.shape_text)]) for p, _ in problems}
    for p, e in problems:
        try:
            key = params_key(space.check_values(dict(e.params)))
        except UserError:
            continue
        times[label(p)][key] = min(e.time_us, times[label(p)].get(key, math.inf))
    return times


ProgressFn = Callable[[int, int, str], None]


def measure(family: Family, configs: Sequence[Mapping[str, object]], problems: Sequence[tuple[Problem, Entry]],
            runner: Runner, watchdog: Watchdog = Watchdog(), progress: ProgressFn | None = None
            ) -> list[tuple[float | None, ...]]:
    """Each configuration's time on each problem (None where it is invalid, fails to compile or
    verify): every valid one verified and timed by the runner, then the correct ones re-timed side
    by side, as a tune's finalists are, so that their times compare within one round."""
    target = runner.device.target
    out: list[tuple[float | None, ...]] = []
    for n, (problem, entry) in enumerate(problems):
        timeout_s = watchdog.limit(entry.default_time_us or entry.time_us, evaluation_launches(family))
        submitted: list[tuple[int, Variant, object]] = []
        for i, params in enumerate(configs):
            try:
                variant = build_variant(family, problem, params, target)
            except UserError:
                continue  # invalid for this shape
            submitted.append((i, variant, runner.submit(family, variant, 0, timeout_s)))  # compiles ahead
        times: list[float | None] = [None] * len(configs)
        correct: list[tuple[int, Variant]] = []
        for i, variant, pending in submitted:
            outcome = pending.result()  # type: ignore[attr-defined]
            if outcome.ok and outcome.time_us is not None:
                times[i] = outcome.time_us
                correct.append((i, variant))
        if len(correct) >= 2:
            again = runner.time_side_by_side(family, [v for _, v in correct], timeout_s * len(correct))
            if again is not None and len(again) == len(correct):
                for (i, _), t in zip(correct, again):
                    times[i] = t
        out.append(tuple(times))
        if progress:
            progress(n + 1, len(problems), label(problem))
    return out


def fit_selector(family: Family, cache: Cache, runner: Runner, *, max_configs: int = MAX_CONFIGS,
                 within: float = WITHIN, watchdog: Watchdog = Watchdog(),
                 progress: ProgressFn | None = None) -> Fitted:
    """Fit the family's selector on the runner's GPU from the cache and store it there. UserError
    (nothing written) when fewer than MIN_SHAPES tuned shapes of the family serve this GPU."""
    if max_configs < 1:
        raise UserError(f"--max-configs must be at least 1, got {max_configs}")
    device = runner.device
    problems = tuned_problems(cache, family, device.name, device.compute_capability, device.cuda_version)
    if len(problems) < MIN_SHAPES:
        raise UserError(f"{cache.path}: {len(problems)} tuned {family.name} shape"
                        f"{'' if len(problems) == 1 else 's'} on {device.name} with NVRTC "
                        f"{device.cuda_version.split('.')[0]}.x and the current templates; a selector needs at "
                        f"least {MIN_SHAPES} (tune more shapes with `autosoft tune {family.name}`)")
    keys = choose_configs(recorded_times(cache, family, problems, device.name), max_configs, within)
    configs = [json.loads(k) for k in keys]
    times = measure(family, configs, problems, runner, watchdog, progress)
    features = [family.selector_features(p) for p, _ in problems]
    names = tuple(features[0])
    samples = tuple(Sample(label(p), f, t) for (p, _), f, t in zip(problems, features, times))
    served = tuple(s for s in samples if any(t is not None for t in s.times))
    if not served:
        raise RuntimeError(f"no configuration of the {family.name} selector ran correctly on any tuned shape")
    tree = fit_tree(served, names, len(configs))
    key = cache_key(problems[0][0], device, family)
    selector = Selector(family.name, device.name, device.compute_capability, device.cuda_version,
                        key.template_digest, key.space_digest, tuple(configs), names, tree,
                        tuple(s.label for s in served), __version__, time.time())
    cache.put_selector(selector)
    return Fitted(selector, served)
