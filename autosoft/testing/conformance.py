"""The family conformance suite: the checks every kernel family passes, as pytest tests.

A test module joins the suite by importing its tests and providing one fixture, `conformance_case`,
that yields a `Case` per family (as Optuna's sampler suites are joined):

    from autosoft.testing.conformance import *  # noqa: F401,F403 - the suite's tests
    from autosoft.testing.conformance import Case

    @pytest.fixture(params=[Case(get_family("softmax")), Case(MY_FAMILY, all_correct=False)], ids=str)
    def conformance_case(request):
        return request.param

CPU checks (no GPU): declarations, the shape text round trip, default and seed params valid for
every example problem on sm_80 and sm_90, unique variant names, strict rendering, launches that
agree with the rendered kernels (names, argument counts, buffers), the verification shape
compiling to the same kernel, costs and output shapes, and a sample of variants compiling with
NVRTC. GPU checks (pytest marker `gpu`): sampled variants verify against the family's reference
with every output element poisoned first, so an element a kernel never writes fails.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import jinja2
import pytest

from ..compile import compile_source
from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import UserError
from ..export import kernel_parameters
from ..families.base import (SUPPORTED_ARCHS, Family, Problem, Target, build_variant, space_of, template_folders,
                             template_root, valid_points)
from ..render import check_references, render

__all__ = [
    "Case", "sample_points",
    "test_declarations_are_complete", "test_shape_text_round_trips", "test_default_and_seed_params_are_valid",
    "test_variant_names_are_unique_identifiers", "test_rendering_is_strict_and_deterministic",
    "test_launches_agree_with_the_rendered_kernels", "test_verification_shape_compiles_to_the_same_kernel",
    "test_costs_and_outputs_are_consistent", "test_problem_distance_is_a_distance",
    "test_sampled_variants_compile_with_nvrtc", "test_sampled_variants_verify_on_the_gpu",
]

ARCHS = ("80", "90")
NAME_SAMPLE = 3000   # valid points whose names must be unique, per example problem
COMPILE_SAMPLE = 2   # random valid points compiled besides the default and two seeds
GPU_EXAMPLES = 4     # example problems verified on the GPU

@dataclass(frozen=True)
class Case:
    """A family under test. all_correct: every valid point computes the right result (False for a
    family that holds broken variants on purpose: then only its default and seeds must verify)."""
    family: Family
    all_correct: bool = True

    def __str__(self) -> str:
        return self.family.name

    def problems(self) -> list[Problem]:
        return [self.family.problem(shape, dtype, options) for shape, dtype, options in self.family.examples]


def sample_points(family: Family, problem: Problem, target: Target, k: int, seed: int,
                  seeds: int | None = None) -> list[dict[str, Any]]:
    """The default, the first `seeds` seed params (all with None) and k valid points drawn with a
    fixed seed, each once: the variants a test checks."""
    picks = [family.default_params(problem, target), *family.seed_params(problem, target)[:seeds]]
    if k:
        valid = valid_points(family, problem, target)  # no engine built for another architecture
        picks += random.Random(seed).sample(valid, min(k, len(valid)))
    unique: list[dict[str, Any]] = []
    for p in picks:
        if p not in unique:
            unique.append(p)
    return unique


def _sample(case: Case, problem: Problem, target: Target, k: int, seed: int) -> list[dict[str, Any]]:
    """A case's sample: random points only where every valid point must be correct."""
    return sample_points(case.family, problem, target, k if case.all_correct else 0, seed, seeds=2)


# --- CPU tier ------------------------------------------------------------------------------------

def test_declarations_are_complete(conformance_case: Case) -> None:
    family = conformance_case.family
    assert re.fullmatch(r"[a-z][a-z0-9_]*", family.name), "a family name is a lower-case identifier"
    assert family.dtypes and set(family.dtypes) <= set(DTYPES)
    assert family.default_dtype in family.dtypes
    assert family.inputs and family.outputs and not set(family.inputs) & set(family.outputs)
    assert "workspace" not in family.inputs + family.outputs, "workspace is the runtime's own buffer"
    assert family.input_kinds and len(set(family.input_kinds)) == len(family.input_kinds)
    assert len({o.name for o in family.options}) == len(family.options)
    assert family.archs and set(family.archs) <= set(SUPPORTED_ARCHS)
    assert family.input_alignment in (1, 2, 4, 8, 16)
    assert family.examples, "examples give the suite problems to check"
    assert {dtype for _, dtype, _ in family.examples} <= set(family.dtypes)
    space = space_of(family)
    assert space.parameters, "a search space with parameters"
    assert all(c.why for c in space.constraints), "every constraint says why"
    source, _, _ = jinja2.FileSystemLoader(template_root(family) or _templates()).get_source(
        jinja2.Environment(), family.template)
    assert source.strip()
    # the template digest covers every file it reads, each engine's template included
    check_references(family.template, template_root(family), template_folders(family))
    names = [engine.name for engine in family.engines]
    assert len(set(names)) == len(names) and "engine" not in space_of(family).names[1:], "engines of distinct names"
    for engine in family.engines:
        assert set(engine.archs) <= set(family.archs), f"engine {engine.name}: archs the family builds for"
        check_references(engine.template, template_root(family), template_folders(family))


def _templates() -> str:
    from ..resources import templates_dir

    return str(templates_dir())


def test_shape_text_round_trips(conformance_case: Case) -> None:
    family = conformance_case.family
    for problem in conformance_case.problems():
        again = family.parse_problem(problem.shape_text, problem.dtype)
        assert again == problem, f"{problem.shape_text}: parse_problem(shape_text) gives {again}"
        assert family.parse_shape(problem.shape_text.split("+")[0]) == problem.shape
        assert family.check_shape(problem.shape) == problem.shape
    with pytest.raises(UserError):
        family.parse_shape("not a shape")
    with pytest.raises(UserError):
        family.problem(family.examples[0][0], "int8")


@pytest.mark.parametrize("arch", ARCHS)
def test_default_and_seed_params_are_valid(conformance_case: Case, arch: str) -> None:
    family = conformance_case.family
    target = Target.for_arch(arch)
    for problem in conformance_case.problems():
        default = family.default_params(problem, target)
        assert family.is_valid(problem, target, default), f"{problem.shape_text} on sm_{arch}: default invalid"
        seeds = family.seed_params(problem, target)
        for seed in seeds:
            assert family.is_valid(problem, target, seed), f"{problem.shape_text}: seed {seed} invalid"
        keys = [tuple(sorted(s.items())) for s in seeds]
        assert len(set(keys)) == len(keys), f"{problem.shape_text}: a seed is repeated"


def test_variant_names_are_unique_identifiers(conformance_case: Case) -> None:
    family = conformance_case.family
    target = Target.for_arch("90")
    space = space_of(family)
    for problem in conformance_case.problems()[:3]:
        valid = space.valid_points(family.problem_values(problem, target))
        valid = random.Random(0).sample(valid, min(NAME_SAMPLE, len(valid)))
        names = [family.variant_name(problem, p) for p in valid]
        assert all(re.fullmatch(r"[A-Za-z_]\w*", n) for n in names), "names are C identifiers"
        assert len(set(names)) == len(names), f"{problem.shape_text}: two valid points share a name"


def test_rendering_is_strict_and_deterministic(conformance_case: Case) -> None:
    family = conformance_case.family
    target = Target.for_arch("90")
    problem = conformance_case.problems()[0]
    variant = build_variant(family, problem, family.default_params(problem, target), target)
    again = build_variant(family, problem, family.default_params(problem, target), target)
    assert variant.source == again.source and variant.digest == again.digest
    assert "{{" not in variant.source and "{%" not in variant.source
    space = space_of(family)
    values = space.evaluate(dict(variant.params), family.problem_values(problem, target))
    args = family.template_args(problem, values)  # without "name" and "kernel_names"
    with pytest.raises(jinja2.UndefinedError):
        render(family.template, args, template_root(family))


@pytest.mark.parametrize("arch", ARCHS)
def test_launches_agree_with_the_rendered_kernels(conformance_case: Case, arch: str) -> None:
    family = conformance_case.family
    target = Target.for_arch(arch)
    assert set(family.strided_inputs) <= set(family.inputs), "strided_inputs names inputs"
    for problem in conformance_case.problems():
        shapes = family.input_shapes(problem)
        assert set(family.strided_inputs) <= set(shapes), "input_shapes gives every strided input's shape"
        strides = {f"{name}_stride{i}" for name in family.strided_inputs for i in range(len(shapes[name]) - 1)}
        buffers = set(family.inputs) | set(family.outputs) | strides
        for params in _sample(conformance_case, problem, target, 3, seed=len(problem.shape_text)):
            variant = build_variant(family, problem, params, target)
            written: set[str] = set()
            assert variant.launches, f"{variant.name}: no launch"
            for launch in variant.launches:
                declared = kernel_parameters(variant.source, launch.kernel)  # ValueError: no such kernel
                assert len(declared) == len(launch.args), \
                    f"{variant.name}: {launch.kernel} takes {len(declared)} arguments, launched with {len(launch.args)}"
                named = {a for a in launch.args if isinstance(a, str)}
                assert named <= buffers | {"workspace"}, f"{variant.name}: unknown buffers {named - buffers}"
                written |= named & set(family.outputs)
                assert all(g >= 1 for g in launch.grid) and launch.grid[0] < 2**31 and max(launch.grid[1:]) < 65536
                assert 1 <= launch.block[0] * launch.block[1] * launch.block[2] <= 1024
                assert 0 <= launch.shared_mem <= target.smem_optin
            uses_workspace = any("workspace" in l.args for l in variant.launches)
            assert uses_workspace == (variant.workspace_bytes > 0), f"{variant.name}: workspace declared and used differ"
            assert written == set(family.outputs), f"{variant.name}: outputs {set(family.outputs) - written} never passed"


def test_verification_shape_compiles_to_the_same_kernel(conformance_case: Case) -> None:
    family = conformance_case.family
    target = Target.for_arch("90")
    for problem in conformance_case.problems():
        smaller = family.verification_problem(problem)
        family.check_shape(smaller.shape)
        params = family.default_params(problem, target)
        if family.is_valid(smaller, target, params):
            assert build_variant(family, smaller, params, target).source == \
                build_variant(family, problem, params, target).source, f"{problem.shape_text}: another kernel"


def test_costs_and_outputs_are_consistent(conformance_case: Case) -> None:
    family = conformance_case.family
    for problem in conformance_case.problems():
        assert family.bytes_moved(problem) > 0 and family.flops(problem) >= 0
        specs = family.output_specs(problem)
        assert set(specs) == set(family.outputs)
        if _size(problem.shape) > 1 << 22:
            continue  # too large for the NumPy stand-in below
        shapes = {name: shape for name, (shape, _) in _caller_inputs(family, problem).items()}
        caller = family.caller_outputs(shapes, problem.dtype, dict(problem.options))
        assert set(caller) == set(family.outputs)
        for name, (shape, dtype) in specs.items():
            assert dtype in OUTPUT_DTYPES and caller[name][1] == dtype
            assert _size(caller[name][0]) == _size(shape), f"{name}: caller and kernel shapes differ in size"
        assert family.problem_for(shapes, problem.dtype, dict(problem.options)) == problem


def _caller_inputs(family: Family, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
    """Input array shapes for a problem, from make_inputs on the CPU (NumPy stands in for CuPy)."""
    import numpy as np

    inputs = family.make_inputs(problem, family.input_kinds[0], np, np.random.default_rng(0))
    return {n: (tuple(a.shape), str(a.dtype)) for n, a in inputs.items() if hasattr(a, "shape") and a.ndim}


def _size(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def test_problem_distance_is_a_distance(conformance_case: Case) -> None:
    family = conformance_case.family
    problems = conformance_case.problems()
    for a in problems:
        assert family.problem_distance(a, a) == 0
        for b in problems:
            assert family.problem_distance(a, b) == family.problem_distance(b, a)
            if a.options != b.options and not family.options:
                assert family.problem_distance(a, b) == float("inf")


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_variants_compile_with_nvrtc(conformance_case: Case, arch: str) -> None:
    family = conformance_case.family
    target = Target.for_arch(arch)
    problems = conformance_case.problems()
    for problem in (problems[0], problems[-1]):
        for params in _sample(conformance_case, problem, target, COMPILE_SAMPLE, seed=1):
            variant = build_variant(family, problem, params, target)
            result = compile_source(variant.source, arch)
            if conformance_case.all_correct or params == family.default_params(problem, target):
                assert result.ok, f"{variant.name} for sm_{arch}: {result.log[:2000]}"


# --- GPU tier ------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_sampled_variants_verify_on_the_gpu(conformance_case: Case) -> None:
    from ..evaluate import verify
    from ..runtime import device_info
    from .compiling import loaded_variants

    family = conformance_case.family
    target = device_info().target
    variants = [build_variant(family, problem, params, target)
                for problem in conformance_case.problems()[:GPU_EXAMPLES]
                for params in _sample(conformance_case, problem, target, 1, seed=2)]
    for loaded in loaded_variants(variants):  # compiled together, verified one by one
        problem = loaded.variant.problem
        wrong = verify(family, loaded, seed=3)
        assert wrong is None, f"{loaded.variant.name} on {problem.shape_text} {problem.dtype}: {wrong}"
