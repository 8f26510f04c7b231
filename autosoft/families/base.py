"""The contract every kernel family implements, and the values passed between the boxes.

A family is one module (a `Family` subclass instance registered with `families.register`), one
template folder and one search-space file. Everything else in the package — the command line,
the Python entry points, dispatch, export, the tuner, the conformance suite — reads only what a
family declares here. `Family`'s docstrings are the contract: what each member receives,
returns and may raise. `autosoft.testing.conformance` checks it for every registered family.
"""
from __future__ import annotations

import abc
import math
import re
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Sequence

from ..compile import source_digest
from ..dtypes import DTYPES, ITEMSIZE, check_dtype
from ..errors import UserError
from ..render import render, template_digest
from ..space import EngineSpaces, ParamValue, SearchSpace, load_space

if TYPE_CHECKING:
    from ..operators import TorchOperator

__all__ = [
    "DTYPES", "ITEMSIZE", "Call", "Engine", "Family", "Launch", "OptionValue", "Problem", "ProblemOption", "Target", "TensorMap",
    "Variant",
    "build_variant", "engine_of", "family_template_digest", "is_valid", "option_flag", "params_from_text", "point_space",
    "space_of", "template_folders", "template_root",
    "valid_neighbours",
]

OptionValue = bool | int | float
SUPPORTED_ARCHS: tuple[str, ...] = ("80", "86", "89", "90")  # cp.async, ldmatrix, mma.sync: sm_80 and newer


@dataclass(frozen=True)
class Target:
    """What a variant is built and laid out for: a GPU, or an architecture alone (CPU tests, render)."""
    arch: str                # "90" for sm_90
    name: str = "unknown"    # GPU name, "sm_90" when rendering for an architecture only
    sm_count: int = 132
    smem_optin: int = 227 * 1024  # opt-in shared memory per block, bytes
    l2_bytes: int = 50 * 1024 * 1024

    @staticmethod
    def for_arch(arch: str) -> "Target":
        smem = {"80": 163 * 1024, "86": 99 * 1024, "89": 99 * 1024}.get(arch, 227 * 1024)
        sms = {"80": 108}.get(arch, 132)
        return Target(arch=arch, name=f"sm_{arch}", sm_count=sms, smem_optin=smem)


def option_flag(name: str) -> str:
    """How the command line spells problem option `name`: kv_heads -> --kv-heads."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ProblemOption:
    """A problem parameter besides shape and dtype that changes the result, declared by a family:
    a flag (`kind="flag"`, e.g. causal) or a number (`"int"`, `"float"`, e.g. a split position).
    It becomes `--name` on the command line and part of the cache key when it differs from its
    default ("+causal", "+split=512")."""
    name: str
    help: str
    kind: str = "flag"                 # "flag", "int" or "float"
    default: OptionValue | None = None  # a flag's default is False; None: the option must be given
    required: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("flag", "int", "float"):
            raise ValueError(f"option {self.name}: kind must be flag, int or float, not {self.kind!r}")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"option {self.name!r}: use lower-case letters, digits and _")

    @property
    def initial(self) -> OptionValue | None:
        return False if self.kind == "flag" else self.default

    def parse(self, text: str) -> OptionValue:
        """A value from its text form (the cache key's, the command line's)."""
        try:
            return {"flag": lambda t: t in ("", "1", "true", "True"), "int": int, "float": float}[self.kind](text)
        except ValueError:
            raise UserError(f"{option_flag(self.name)} {text!r}: expected {'an integer' if self.kind == 'int' else 'a number'}") from None


@dataclass(frozen=True)
class Problem:
    """One problem: family, dtype, shape and the family's problem options that differ from their
    defaults, as sorted (name, value) pairs. Build it with `Family.problem`, which checks it."""
    family: str
    dtype: str
    shape: tuple[int, ...]
    options: tuple[tuple[str, OptionValue], ...] = ()

    def option(self, name: str, default: OptionValue | None = None) -> OptionValue | None:
        return dict(self.options).get(name, default)

    @property
    def flags(self) -> tuple[str, ...]:
        """The names of the flags that are set, e.g. ("causal",)."""
        return tuple(n for n, v in self.options if v is True)

    @property
    def shape_text(self) -> str:
        """The problem as written in cache keys: 4096x8192, with options appended
        (1x32x8192x64+causal, 1x32x1024x128+causal+split=512)."""
        parts = ["x".join(map(str, self.shape))]
        parts += [name if value is True else f"{name}={value}" for name, value in self.options]
        return "+".join(parts)

    @property
    def tune_command(self) -> str:
        """The command that tunes this problem, its options as the command line spells them:
        autosoft tune attention --shape 1x32x1x128 --kv-heads 8 --kv-len 4096 --dtype bfloat16."""
        words = ["autosoft", "tune", self.family, "--shape", "x".join(map(str, self.shape))]
        for name, value in self.options:
            words += [option_flag(name)] + ([] if value is True else [str(value)])
        return " ".join(words + ["--dtype", self.dtype])


PORTABLE_CLUSTER_BLOCKS = 8  # the largest cluster every sm_90 launch accepts without opting in


@dataclass(frozen=True)
class TensorMap:
    """A launch argument that is a TMA tensor map (CUtensorMap: 128 bytes, passed by value to a
    `const __grid_constant__` parameter) over one input or output, which the runtime encodes at
    launch from the array's address and strides (its `<array>_stride<i>` arguments, else
    contiguous): a tiled map of `shape` (outermost first, the last dimension contiguous) moving
    boxes of `box` (outermost first), each box row swizzled across its own width; a box loaded
    past an edge is filled with zeros, and a box stored past one writes nothing there.
    box[-1] * itemsize (a box row, the swizzle's span) must be 128, 64 or 32 bytes, and every
    other stride a multiple of 16 bytes.
    always_contiguous: the array is laid out contiguously whatever the call (an output the family
    allocates): it has no stride arguments.
    runtime_rows: the outermost dimension's extent is the array's own at each launch, given as the
    launch value `<array>_rows` (packed sequences of lengths that vary per call: a map as long as the
    problem's bound would read past the array); shape[0] is the most it may be."""
    array: str
    shape: tuple[int, ...]
    box: tuple[int, ...]
    dtype: str
    always_contiguous: bool = False
    runtime_rows: bool = False

    @property
    def swizzle_bytes(self) -> int:
        """The span of the swizzle: one box row, 128, 64 or 32 bytes (the layout wgmma reads)."""
        from ..dtypes import ITEMSIZE

        return self.box[-1] * ITEMSIZE[self.dtype]

    @property
    def stride_names(self) -> tuple[str, ...]:
        return () if self.always_contiguous else tuple(f"{self.array}_stride{i}" for i in range(len(self.shape) - 1))

    @property
    def rows_name(self) -> str | None:
        """The launch value giving the outermost extent, for a map with runtime_rows."""
        return f"{self.array}_rows" if self.runtime_rows else None

    @property
    def contiguous_strides(self) -> tuple[int, ...]:
        """The strides (elements, every dimension but the last, outermost first) of the array laid
        out contiguously: what a dimension of one element is given, whatever its own stride."""
        strides = [1]
        for size in reversed(self.shape[1:]):
            strides.append(strides[-1] * size)
        return tuple(reversed(strides[1:]))


@dataclass(frozen=True)
class Launch:
    """One kernel launch. Each arg is a buffer name (bound at run time: a device pointer, or a
    scalar such as attention's scale), a literal numpy scalar or a TensorMap over an input or output. cluster_blocks is the cluster
    size compiled into the kernel (__cluster_dims__), 1 for none: past 8 blocks (the portable
    size) the launch must opt in to a non-portable cluster. A cooperative launch has every block
    of its grid resident at once (or fails to launch), for blocks that wait for each other. The
    buffer named "workspace" is the variant's zeroed scratch memory, which the runtime provides."""
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


@dataclass(frozen=True)
class Call:
    """What a family's Python function (`Family.python_call`) asks of the array layer: its arrays in
    the order of `Family.inputs`, its problem options, its run-time scalars (names from `inputs`)
    and the names of the outputs the caller gets back, in order (one name: returned alone)."""
    arrays: tuple[Any, ...]
    options: Mapping[str, OptionValue]
    scalars: Mapping[str, Any]
    returns: tuple[str, ...]


class Family(abc.ABC):
    """A kernel family: what it computes, its problems, how a point of its search space becomes
    CUDA source and launches, and how a result is checked.

    Subclasses declare the class attributes below and implement the abstract methods; the rest
    is shared. Methods that receive a `Problem` may assume `problem(...)` built it (checked);
    methods that receive params may assume they passed `space.check_values` and every constraint.
    Errors a user can cause (a bad shape, dtype or option) are `UserError` with a message that
    says what to do; anything else raised is a bug in the family.
    """

    # --- declarations ----------------------------------------------------------------------
    name: ClassVar[str]
    """Registry name, CLI word and cache-key field: lower case, e.g. "softmax"."""
    template: ClassVar[str]
    """The main template, relative to `template_root` (e.g. "softmax/softmax.cu.j2")."""
    template_root: ClassVar[Path | None] = None
    """Folder the template is found in; None: the package's templates/."""
    template_folders: ClassVar[tuple[str, ...]] = ()
    """Other folders under the same root whose templates this family's template reads, e.g. the
    folder of a family whose kernel it extends: their files join its template digest."""
    space_file: ClassVar[Path | None] = None
    """The search-space YAML; None: the package's search_spaces/<name>.yaml."""
    inputs: ClassVar[tuple[str, ...]]
    """Names of the buffers the caller provides, in the order the Python entry point takes them
    (arrays first; scalars bound at run time, such as "scale", after them)."""
    outputs: ClassVar[tuple[str, ...]]
    """Names of the buffers a variant writes; `output_specs` gives their shapes and dtypes."""
    empty_values: ClassVar[Mapping[str, float]] = {}
    """What an output holds where an empty input leaves nothing to compute it from (keys: output
    names; the others hold 0): attention's lse over no key is -inf, the sum over no element 0. The
    array layer fills outputs with it when some input is empty and the output is not."""
    input_kinds: ClassVar[tuple[str, ...]]
    """The kinds of random input `make_inputs` makes for verification (e.g. "normal", "neg_inf")."""
    input_alignment: ClassVar[int] = 16
    """Bytes each input array's address must be a multiple of; the call layer copies others
    (contiguous copies are 256-byte aligned). Outputs always share the first input's address
    modulo 16, so a family whose kernels take any element address says 1 (softmax)."""
    strided_inputs: ClassVar[tuple[str, ...]] = ()
    """Inputs taken as they are wherever their last dimension is contiguous (a copy otherwise):
    the kernels get each one's other strides, in elements, as int64 run-time arguments named
    "<input>_stride<i>" (i = 0 .. ndim - 2), which a Launch lists among its args. Every stride
    and the address must be multiples of `input_alignment` bytes (else the call layer copies)."""
    dtypes: ClassVar[tuple[str, ...]] = DTYPES
    """The element types it takes (names from autosoft.dtypes.DTYPES): the problem's dtype, that of
    its first input and of every input not in `input_dtypes`."""
    input_dtypes: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    """The inputs whose dtype is their own, not the problem's, with the dtypes each takes (names
    from autosoft.dtypes.INPUT_DTYPES), e.g. {"target": ("int64", "int32")}: the array layer
    checks each against its declaration; the plans are kept per dtype of every input."""
    optional_inputs: ClassVar[tuple[str, ...]] = ()
    """Inputs a call may give as None (a DeepSeek router's bias): the kernels get a null pointer,
    and the family's problem options say whether the input is given."""
    default_dtype: ClassVar[str] = "float32"
    """The --dtype used when none is given; one of `dtypes`."""
    options: ClassVar[tuple[ProblemOption, ...]] = ()
    """Problem parameters besides shape and dtype (flags such as causal, numbers such as a split)."""
    archs: ClassVar[tuple[str, ...]] = SUPPORTED_ARCHS
    """Compute capabilities its templates compile for ("80", "90", ...)."""
    shape_help: ClassVar[str] = "the problem shape"
    """How --shape is written, with an example, for --help and error messages."""
    examples: ClassVar[tuple[tuple[str, str, Mapping[str, OptionValue]], ...]] = ()
    """(shape text, dtype, options) of problems that cover its edge cases: tiny, odd, large; the
    conformance suite checks defaults, seeds, rendering and compilation on them."""
    torch_operators: ClassVar[tuple["TorchOperator", ...]] = ()
    """The torch operators it declares (autosoft.operators): autosoft.torch_ops registers each
    with its real, fake and autograd kernels; a declared Backward is the autograd formula."""
    python_returns: ClassVar[str | None] = None
    """The return annotation of its Python function, as text, where `python_call`'s own says
    only Call (autosoft.<name>'s help() shows it)."""
    public_functions: ClassVar[tuple[str, ...]] = ()
    """"module:function" of public functions written by hand (autosoft.<function>), for a family
    whose function is more than a declared call (an autograd Function, a reduction, chunking):
    they live in autosoft/functions/, above the arrays layer a family never imports, and are
    imported on first use. A family declares either these or python_call."""

    # --- problems ----------------------------------------------------------------------------
    @abc.abstractmethod
    def parse_shape(self, text: str) -> tuple[int, ...]:
        """The shape written as `text` (--shape, a cache key), checked by `check_shape`.
        Raises UserError naming the text and the expected form."""

    @abc.abstractmethod
    def check_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape as a tuple of ints if this family supports it, else UserError saying why."""

    def problem(self, shape_text: str, dtype: str | None = None,
                options: Mapping[str, OptionValue] | Iterable[str] = ()) -> Problem:
        """A checked Problem. `options` is a name -> value mapping, or an iterable of flag names;
        unknown options, a missing required one or a dtype outside `dtypes` raise UserError."""
        dtype = check_dtype(self.default_dtype if dtype is None else dtype, self.dtypes, self.name)
        return Problem(self.name, dtype, self.parse_shape(shape_text), self.check_options(options))

    def check_options(self, options: Mapping[str, OptionValue] | Iterable[str]) -> tuple[tuple[str, OptionValue], ...]:
        """Options as a Problem holds them: declared, typed, defaults dropped, sorted by name."""
        given = dict(options) if isinstance(options, Mapping) else {name: True for name in options}
        declared = {o.name: o for o in self.options}
        unknown = [name for name in given if name not in declared]
        if unknown:
            known = ", ".join(map(option_flag, declared)) or "none"
            raise UserError(f"{self.name} takes no {', '.join(map(option_flag, unknown))} "
                            f"option (its options: {known})")
        out: list[tuple[str, OptionValue]] = []
        for name, option in sorted(declared.items()):
            value = given.get(name, option.initial)
            if value is None:
                if option.required:
                    raise UserError(f"{self.name} needs {option_flag(name)}: {option.help}")
                continue
            if option.kind == "flag":
                value = bool(value)
            elif option.kind == "int":
                if isinstance(value, bool) or int(value) != value:
                    raise UserError(f"{option_flag(name)} {value!r}: expected an integer")
                value = int(value)
            else:
                value = float(value)
            if value != option.initial:
                out.append((name, value))
        return tuple(out)

    def parse_problem(self, text: str, dtype: str) -> Problem:
        """The Problem whose `shape_text` is `text` (a cache key's shape field): the inverse of
        Problem.shape_text. Raises UserError on text that no problem of this family writes."""
        shape, *rest = str(text).split("+")
        declared = {o.name: o for o in self.options}
        options: dict[str, OptionValue] = {}
        for part in rest:
            name, sep, value = part.partition("=")
            if name not in declared:
                raise UserError(f"{self.name}: unknown option {name!r} in problem {text!r}")
            options[name] = declared[name].parse(value) if sep else True
        return self.problem(shape, dtype, options)

    @abc.abstractmethod
    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        """The names the search space's derived values and constraints may use besides the
        params (sizes, itemsize, the target's limits), for this problem on this target."""

    # --- variants ----------------------------------------------------------------------------
    # A family with one kernel implements the five methods below itself: it is its own engine. A
    # family with several kernels lists them in `engines` and leaves these to them: a point then
    # names its engine (params["engine"]) and holds that engine's parameters only.
    engines: tuple["Engine", ...] = ()
    """The family's kernels, in the order the default prefers them (set by __init__: an engine
    belongs to one family); empty for a family that is its own engine."""

    def engine(self, name: str) -> "Engine":
        """The engine called `name`; UserError naming the family's engines otherwise."""
        for engine in self.engines:
            if engine.name == name:
                return engine
        raise UserError(f"{self.name} has no engine {name!r}" + (f"; its engines: {', '.join(e.name for e in self.engines)}"
                                                                 if self.engines else " (it is one kernel)"))

    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        """A readable name, unique among the valid points of one problem (FlashInfer style:
        softmax_f16_t256_g256_v8_u1_registers_three_pass_shuffle); a C identifier."""
        engine, own = engine_of(self, params)
        return engine.variant_name(problem, own)

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        """The template's arguments, from the evaluated values (params, problem values, derived).
        "name" and "kernel_names" are added by build_variant."""
        return engine_of(self, values)[0].template_args(problem, values)

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        """The launches of a variant, in order, and the bytes of zeroed workspace they share.
        Every Launch.kernel is an extern "C" __global__ function of the rendered source taking
        exactly len(args) arguments; string args name inputs, outputs or "workspace"."""
        return engine_of(self, values)[0].launches(problem, values, target)

    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue]:
        """A valid, correct variant for any problem `problem()` accepts, without tuning. With
        engines: the default of the first engine that serves the problem and offers one."""
        for engine in self.engines:
            if engine.serves(problem, target):
                params = engine.default_params(problem, target)
                if params is not None:
                    return {"engine": engine.name, **params}
        raise NotImplementedError(f"{self.name}: no engine offers a default for {problem.shape_text} on sm_{target.arch}")

    def seed_params(self, problem: Problem, target: Target) -> list[dict[str, ParamValue]]:
        """Valid points the tuner measures first (often better than the default), no repeats.
        With engines: the default engine's seeds, then each other serving engine's, in the order
        of `engines` (Engine.seed_params)."""
        default = self.default_params(problem, target)
        first = engine_of(self, default)[0]
        seeds: list[dict[str, ParamValue]] = []
        for engine in (first, *(e for e in self.engines if e is not first)):
            if engine.serves(problem, target):
                seeds += [{"engine": engine.name, **p} for p in engine.seed_params(problem, target, default)]
        out: list[dict[str, ParamValue]] = []
        for p in seeds:
            if p != default and p not in out:
                out.append(p)
        return out

    # --- costs -------------------------------------------------------------------------------
    @abc.abstractmethod
    def bytes_moved(self, problem: Problem) -> int:
        """Bytes a kernel must read and write at least: the copy it is compared with moves this."""

    def flops(self, problem: Problem) -> float:
        """Floating-point operations of the problem; 0 for a memory-bound family (reported in GB/s)."""
        return 0.0

    def shape_distance(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """How far apart two shapes are for borrowing a tuned variant (0 for the same shape,
        symmetric, math.inf where one can never serve the other): log2 steps per dimension."""
        if len(a) != len(b):
            return math.inf
        return sum(abs(math.log2(x) - math.log2(y)) for x, y in zip(a, b))

    def problem_distance(self, a: Problem, b: Problem) -> float:
        """Distance between problems of one dtype: shape_distance when their options agree,
        else math.inf. A family whose numeric options can be borrowed across overrides it."""
        if a.options != b.options:
            return math.inf
        return self.shape_distance(a.shape, b.shape)

    def verification_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A smaller shape compiled to the same kernel, to verify a borrowed variant on."""
        return shape

    def verification_problem(self, problem: Problem) -> Problem:
        """A smaller problem compiled to the same kernel (its source is the problem's own), to
        verify a borrowed variant on. Default: the problem at `verification_shape`, its options
        kept; a family whose options follow the shape (attention's kv_heads) overrides this."""
        return replace(problem, shape=self.verification_shape(problem.shape))

    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        """The shape of each input array of a problem, for the names in `strided_inputs` at least
        (a caller that passes bare pointers gets their contiguous strides). Default: none."""
        return {}

    # --- checking (on the GPU through CuPy: xp is the cupy module) ---------------------------
    @abc.abstractmethod
    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each output buffer's (shape, dtype) as the kernels write it, for every name in `outputs`."""

    @abc.abstractmethod
    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        """Fresh random inputs of one of `input_kinds` (never zeros), every name in `inputs`."""

    @abc.abstractmethod
    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        """None when the outputs are right for the inputs (every element written), else a
        one-line description of the worst error."""

    # --- the Python entry point ----------------------------------------------------------
    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        """The Problem for a call with arrays of these shapes (names from `inputs`). Raises
        ValueError for shapes that do not fit together. Default: the first input's shape."""
        first = shapes[self.inputs[0]]
        try:
            return Problem(self.name, dtype, self.check_shape(tuple(first)), self.check_options(options))
        except UserError as exc:
            raise ValueError(f"autosoft.{self.name}: {exc}") from None

    @abc.abstractmethod
    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each output's (shape, dtype) as the caller receives it, from the shapes of the input
        arrays and the call's options alone (so that empty inputs get empty outputs without a
        Problem). Each holds as many elements as the kernels' output_specs; softmax gives y the
        shape of x."""

    def python_call(self, *args: Any, **kwargs: Any) -> Call:
        """The family's Python function, `autosoft.<name>(...)`, as the user calls it: check the
        arguments and say what to run. A family that declares one overrides this with its own
        signature and docstring (they become the function's); the default declares none, and
        NotImplementedError says so. Raises TypeError or ValueError for bad arguments."""
        raise NotImplementedError(f"the {self.name} family has no Python function")

    @property
    def has_python_call(self) -> bool:
        return type(self).python_call is not Family.python_call

    def selector_features(self, problem: Problem) -> dict[str, float]:
        """The numbers a selector (autosoft/selector.py) splits this family's problems on. This
        default reads the shape alone: a row family (M x N): rows, columns, bytes per row; another
        rank (attention's B x H x N x D): the product of the leading dimensions, the last two (N,
        D); then the dtype's size and each declared option (a flag as 0 or 1, a number as itself,
        0 when not given). A family whose speed turns on more (attention's keys per query, group
        size) overrides it."""
        shape, size = problem.shape, ITEMSIZE[problem.dtype]
        if len(shape) == 2:
            out = {"rows": float(shape[0]), "columns": float(shape[1]), "bytes_per_row": float(shape[1] * size)}
        else:
            out = {"outer": float(math.prod(shape[:-2])), "n": float(shape[-2]), "d": float(shape[-1])}
        out["dtype_size"] = float(size)
        for option in self.options:
            value = problem.option(option.name)
            out[option.name] = 0.0 if value is None or value is False else float(value)
        return out

    # --- shared machinery --------------------------------------------------------------------
    @property
    def space(self) -> SearchSpace:
        return space_of(self)

    def is_valid(self, problem: Problem, target: Target, params: Mapping[str, Any]) -> bool:
        """Whether params are declared values that satisfy every constraint for this problem."""
        return is_valid(self, problem, target, params)

    def first_valid(self, problem: Problem, target: Target, base: Mapping[str, ParamValue],
                    fallbacks: Sequence[Mapping[str, ParamValue]]) -> dict[str, ParamValue]:
        """base with each fallback change applied in turn (cumulatively) until the point is valid:
        how defaults walk towards the plainest variant. AssertionError when none is (a bug)."""
        p = dict(base)
        for change in ({}, *fallbacks):
            p = {**p, **change}
            if self.is_valid(problem, target, p):
                return p
        raise AssertionError(f"no valid default {self.name} variant for {problem}")

    def __repr__(self) -> str:
        return f"<family {self.name}>"


class Engine(abc.ABC):
    """One kernel of a family: its template, its search space, its default and seeds, how a point
    becomes template arguments, launches and a name, and the architectures it needs. The family
    keeps the problem's meaning (shapes, options, dtypes, reference check, outputs, costs, the
    Python function); an engine reads it through `self.family`. A point of an engine holds its own
    parameters only; the family's points add "engine": its name. An engine that builds on
    another's kernel (attention_colsum's on attention's) holds that engine and calls it.
    """
    name: ClassVar[str]
    """The engine's name, unique within its family and a value of params["engine"], e.g. "mma"."""
    template: ClassVar[str]
    """The template build_variant renders, relative to the family's template root."""
    archs: ClassVar[tuple[str, ...]] = SUPPORTED_ARCHS
    """Compute capabilities it compiles for; a target of another serves no problem."""

    def __init__(self, family: Family, space: str) -> None:
        """space: the name of its search space, search_spaces/<space>.yaml."""
        self.family = family
        self.space_name = space

    @property
    def space(self) -> SearchSpace:
        return _load_space_cached(self.space_name, None)

    def serves(self, problem: Problem, target: Target) -> bool:
        """Whether it builds variants of this problem for this target: its architecture, and the
        constraints of its space on the problem alone."""
        return target.arch in self.archs and not self.space.problem_violations(self.family.problem_values(problem, target))

    def is_valid(self, problem: Problem, target: Target, params: Mapping[str, Any]) -> bool:
        """Whether params (without "engine") are declared values of this engine that satisfy
        every constraint for this problem on this target; False for undeclared values."""
        try:
            checked = self.space.check_values(params)
        except UserError:
            return False
        return target.arch in self.archs and not self.space.violations(checked, self.family.problem_values(problem, target))

    def valid_neighbours(self, problem: Problem, target: Target, base: Mapping[str, Any],
                         changes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """base with each change applied, in order, keeping the valid ones not seen before: seeds."""
        seeds: list[dict[str, Any]] = []
        for change in changes:
            candidate = {**base, **change}
            if candidate != base and candidate not in seeds and self.is_valid(problem, target, candidate):
                seeds.append(candidate)
        return seeds

    @abc.abstractmethod
    def variant_name(self, problem: Problem, params: Mapping[str, ParamValue]) -> str:
        """As Family.variant_name, for a point of this engine."""

    @abc.abstractmethod
    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        """As Family.template_args, from this engine's evaluated values."""

    @abc.abstractmethod
    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        """As Family.launches."""

    @abc.abstractmethod
    def default_params(self, problem: Problem, target: Target) -> dict[str, ParamValue] | None:
        """A valid, correct point of this engine for a problem it serves, or None where it
        leaves the default to another engine."""

    @abc.abstractmethod
    def seed_params(self, problem: Problem, target: Target, default: Mapping[str, ParamValue]) -> list[dict[str, ParamValue]]:
        """Valid points of this engine the tuner measures first, likeliest first, no repeats:
        around `default` (the family's default point, with "engine") where it is this engine's,
        else this engine's own default (when it has one) and its neighbours."""

    def __repr__(self) -> str:
        return f"<engine {self.family.name}.{self.name}>"


def engine_of(family: Family, params: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The engine a point (or evaluated values) names and the point without "engine"; for a
    family without engines, the family itself and the point."""
    if not family.engines:
        return family, dict(params)
    name = space_of(family).engine(params.get("engine"))  # type: ignore[union-attr]
    engine = next(e for e in family.engines if e.name == name)
    return engine, {n: v for n, v in params.items() if n != "engine"}


def point_space(family: Family, params: Mapping[str, Any]) -> tuple[SearchSpace, dict[str, Any]]:
    """The space a point lives in (its engine's, or the family's) and the point without "engine"."""
    space = space_of(family)
    if isinstance(space, EngineSpaces):
        engine, inner, own = space.split(params)
        return inner, own
    return space, dict(params)


def space_of(family: Family) -> Any:
    """A family's search space: its `space_file`, or search_spaces/<name>.yaml; for a family with
    engines, their spaces together (space.EngineSpaces)."""
    if family.engines:
        return _engine_spaces(family.name, tuple((e.name, e.space_name) for e in family.engines))
    path = getattr(family, "space_file", None)
    return _load_space_cached(family.name, str(path) if path else None)


@lru_cache(maxsize=None)
def _engine_spaces(family: str, engines: tuple[tuple[str, str], ...]) -> EngineSpaces:
    return EngineSpaces(family, tuple((name, _load_space_cached(space, None)) for name, space in engines))


@lru_cache(maxsize=None)
def _load_space_cached(name: str, path: str | None) -> SearchSpace:
    return load_space(name, Path(path) if path else None)


def params_from_text(family: Family, problem: Problem, target: Target, items: Sequence[str]) -> tuple[dict[str, ParamValue], set[str]]:
    """The point `render --param NAME=VALUE ...` asks for, and the names given: the default with
    the given values. With engines, `engine=NAME` starts from that engine's own default, and a
    parameter only other engines declare is refused, naming them. A name given twice is refused."""
    given: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UserError(f"--param {item!r}: expected NAME=VALUE, e.g. --param vec=4")
        if name in given:
            raise UserError(f"--param {name} is given twice ({given[name]!r} and {value!r}); give it once")
        given[name] = value
    space = space_of(family)
    if not isinstance(space, EngineSpaces):
        params = family.default_params(problem, target)
        params.update({name: space.parse_value(name, value) for name, value in given.items()})
        return params, set(given)
    if "engine" in given:
        engine = next(e for e in family.engines if e.name == space.parse_value("engine", given["engine"]))
        if not engine.serves(problem, target):
            why = engine.space.problem_violations(family.problem_values(problem, target))
            raise UserError(f"the {engine.name} engine does not serve {family.name} {problem.shape_text} on "
                            f"sm_{target.arch}: {why[0] if why else 'it is built for sm_' + ', sm_'.join(engine.archs)}")
        own = engine.default_params(problem, target)
        if own is None:  # the engine leaves the default to another: its likeliest point instead
            own = (engine.seed_params(problem, target) or engine.space.valid_points(family.problem_values(problem, target)))[0]
        params = {"engine": engine.name, **own}
    else:
        params = family.default_params(problem, target)
    inner = space.space(params["engine"])
    for name, value in given.items():
        if name == "engine":
            continue
        if name not in inner.names and space.owners(name):
            others = space.owners(name)
            raise UserError(f"--param {name}: a parameter of the {' and '.join(others)} engine, not of "
                            f"{params['engine']} (choose it with --param engine={others[0]})")
        params[name] = inner.parse_value(name, value)
    return params, set(given)


def template_folders(family: Family) -> tuple[str, ...]:
    """The other template folders a family's template reads (Family.template_folders)."""
    return tuple(getattr(family, "template_folders", ()))


def template_root(family: Family) -> str | None:
    """None for shipped families (templates/), else the folder a family brings its template in."""
    root = getattr(family, "template_root", None)
    return str(root) if root else None


def build_variant(family: Family, problem: Problem, params: Mapping[str, Any], target: Target) -> Variant:
    """Validate params against the search space and the problem, then render the variant (with
    its engine's template, for a family with engines).

    Raises UserError naming the broken constraint when the point is invalid for this problem.
    """
    space = space_of(family)
    checked = space.check_values(params)
    engine, own = engine_of(family, checked)
    if family.engines and target.arch not in engine.archs:
        raise UserError(f"{family.name} variant invalid for sm_{target.arch}: the {engine.name} engine is built for "
                        f"{', '.join('sm_' + a for a in engine.archs)}")
    values = space.evaluate(checked, family.problem_values(problem, target))
    broken = space.violations(checked, family.problem_values(problem, target))
    if broken:
        raise UserError(f"{family.name} variant invalid for {problem.shape_text}: {broken[0]}")
    name = engine.variant_name(problem, own)
    launches, workspace = engine.launches(problem, values, target)
    args = {**engine.template_args(problem, values), "name": name,
            "kernel_names": [l.kernel for l in launches]}
    source = render(engine.template, args, template_root(family))
    return Variant(family.name, problem, target, checked, name, source, launches, workspace,
                   tuple(l.kernel for l in launches))


def valid_points(family: Family, problem: Problem, target: Target) -> list[dict[str, Any]]:
    """Every valid point of the family's space for this problem on this target, in the space's
    order, the points of engines built for other architectures left out (the space's constraints
    do not name the architecture an engine's instructions need)."""
    points = space_of(family).valid_points(family.problem_values(problem, target))
    if not family.engines:
        return points
    serving = {engine.name for engine in family.engines if target.arch in engine.archs}
    return [p for p in points if p["engine"] in serving]


def is_valid(family: Family, problem: Problem, target: Target, params: Mapping[str, Any]) -> bool:
    """Whether params are declared values that satisfy every constraint for this problem."""
    space = space_of(family)
    checked = space.check_values(params)
    if family.engines and target.arch not in engine_of(family, checked)[0].archs:
        return False
    return not space.violations(checked, family.problem_values(problem, target))


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
    return template_digest(family.template, template_root(family), template_folders(family))
