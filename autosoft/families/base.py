"""The small interface every kernel family implements, and the values passed between the boxes."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from ..compile import source_digest
from ..errors import UserError
from ..render import render, template_digest
from ..space import ParamValue, SearchSpace, load_space

DTYPES = ("float32", "float16", "bfloat16")
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Target:
    """What a variant is built and laid out for: a GPU, or an architecture alone (CPU tests, render)."""
    arch: str                # "90" for sm_90
    name: str = "unknown"    # GPU name, "" when rendering for an architecture only
    sm_count: int = 132
    smem_optin: int = 227 * 1024  # opt-in shared memory per block, bytes
    l2_bytes: int = 50 * 1024 * 1024

    @staticmethod
    def for_arch(arch: str) -> "Target":
        smem = {"80": 163 * 1024, "86": 99 * 1024, "89": 99 * 1024}.get(arch, 227 * 1024)
        sms = {"80": 108}.get(arch, 132)
        return Target(arch=arch, name=f"sm_{arch}", sm_count=sms, smem_optin=smem)


@dataclass(frozen=True)
class Problem:
    family: str
    dtype: str
    shape: tuple[int, ...]
    flags: tuple[str, ...] = ()  # problem variants that change the result, e.g. ("causal",)

    @property
    def shape_text(self) -> str:
        """The shape as written in cache keys: 4096x8192, with flags appended (1x32x8192x64+causal)."""
        return "x".join(map(str, self.shape)) + "".join(f"+{f}" for f in self.flags)


PORTABLE_CLUSTER_BLOCKS = 8  # the largest cluster every sm_90 launch accepts without opting in


@dataclass(frozen=True)
class Launch:
    """One kernel launch. Each arg is a buffer name (bound at run time) or a literal numpy scalar.
    cluster_blocks is the cluster size compiled into the kernel (__cluster_dims__), 1 for none:
    past 8 blocks (the portable size) the launch must opt in to a non-portable cluster.
    A cooperative launch has every block of its grid resident at once (or fails to launch),
    for blocks that wait for each other."""
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    args: tuple[Any, ...]
    cluster_blocks: int = 1
    cooperative: bool = False

    @property
    def non_portable_cluster(self) -> bool:
        return self.cluster_blocks > PORTABLE_CLUSTER_BLOCKS


@dataclass(frozen=True)
class Variant:
    """A point of the search space rendered for one problem and target."""
    family: str
    problem: Problem
    target: Target
    params: Mapping[str, ParamValue]
    name: str
    source: str
    launches: tuple[Launch, ...]
    workspace_bytes: int = 0
    kernel_names: tuple[str, ...] = field(default=())

    @cached_property
    def digest(self) -> str:
        return source_digest(self.source, self.target.arch)


class Family(Protocol):
    """What a kernel family provides. Registering one: a module, a template folder, a YAML file."""
    name: str
    template: str            # path under templates/
    inputs: tuple[str, ...]  # buffer names the caller provides
    outputs: tuple[str, ...] # buffer names the variant writes

    def parse_shape(self, text: str) -> tuple[int, ...]: ...
    def check_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...
    def problem(self, shape_text: str, dtype: str, flags: tuple[str, ...] = ()) -> Problem: ...
    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]: ...
    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str: ...
    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]: ...
    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]: ...
    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]: ...
    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]: ...
    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float: ...
    def verification_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]: ...
    def bytes_moved(self, problem: Problem) -> int: ...
    def flops(self, problem: Problem) -> float: ...
    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]: ...
    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]: ...
    input_kinds: Sequence[str]
    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None: ...


def space_of(family: Family) -> SearchSpace:
    """A family's search space: search_spaces/<name>.yaml, or the family's own `space_file`."""
    path = getattr(family, "space_file", None)
    return _load_space_cached(family.name, str(path) if path else None)


@lru_cache(maxsize=None)
def _load_space_cached(name: str, path: str | None) -> SearchSpace:
    return load_space(name, Path(path) if path else None)


def template_root(family: Family) -> str | None:
    """None for shipped families (templates/), else the folder a family brings its template in."""
    root = getattr(family, "template_root", None)
    return str(root) if root else None


def build_variant(family: Family, problem: Problem, params: Mapping[str, Any], target: Target) -> Variant:
    """Validate params against the search space and the problem, then render the variant.

    Raises UserError naming the broken constraint when the point is invalid for this problem.
    """
    space = space_of(family)
    checked = space.check_values(params)
    values = space.evaluate(checked, family.problem_values(problem, target))
    broken = [c.why for c in space.constraints if not c.expression.evaluate(values)]
    if broken:
        raise UserError(f"{family.name} variant invalid for {problem.shape_text}: {broken[0]}")
    name = family.variant_name(problem, checked)
    launches, workspace = family.launches(problem, values, target)
    args = {**family.template_args(problem, values), "name": name,
            "kernel_names": [l.kernel for l in launches]}
    source = render(family.template, args, template_root(family))
    return Variant(family.name, problem, target, checked, name, source, launches, workspace,
                   tuple(l.kernel for l in launches))


def is_valid(family: Family, problem: Problem, target: Target, params: Mapping[str, Any]) -> bool:
    """Whether params are declared values that satisfy every constraint for this problem."""
    space = space_of(family)
    return not space.violations(space.check_values(params), family.problem_values(problem, target))


def valid_neighbours(family: Family, problem: Problem, target: Target, base: Mapping[str, Any],
                     changes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """base with each change applied, in order, keeping the valid ones not seen before: seeds."""
    seeds: list[dict[str, Any]] = []
    for change in changes:
        candidate = {**base, **change}
        if candidate != base and candidate not in seeds and is_valid(family, problem, target, candidate):
            seeds.append(candidate)
    return seeds


def family_template_digest(family: Family) -> str:
    return template_digest(family.template, template_root(family))


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return dtype
