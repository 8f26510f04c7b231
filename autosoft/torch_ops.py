"""The families' torch custom operators, for autograd, torch.compile and CUDA graphs.

    import autosoft.torch_ops                     # registers the operators (imports torch)
    outputs = torch.ops.autosoft.<name>(...)      # every operator a family declares

Each family declares its operators (autosoft.operators.TorchOperator, the class attribute
`torch_operators`): a schema, how the operator's arguments become the family's call, and its
autograd formula. This module registers whatever is declared and names no family. Called as plain
Python, autosoft is something torch.compile cannot see into and autograd cannot differentiate. The
operators are defined with a `torch.library.Library` (schemas tagged pt2_compliant_tag; none
mutates its inputs), each with

- its real implementation for every backend (CompositeExplicitAutograd): the declared call, run
  by `arrays.call_family` as the family's public function runs it (same kernels, same plans, same
  errors, launched on torch's current stream, outputs allocated by torch: what a CUDA graph
  capture needs); a call along another dim than the last moves it last and the outputs back; an
  operator with plan_options takes call_family's cached plan under call_family's own key along the
  last dim, nothing else checked (the schema already made x a tensor and dim an int);
- a fake implementation (`torch.library.register_fake`, also the Meta kernel) that runs the
  declared call (its errors need no data), checks what the array layer checks without data
  (device, dtypes, the family's shapes and problem), with the errors of the real path, and returns
  empty tensors laid out as the real outputs are (contiguous; along another dim than the last, the
  moved layout's view), which torch.compile traces with;
- an Autograd kernel of its own (`_autograd_kernel`, for every autograd key): with grad mode on
  and an input that requires gradients, an operator that declares a backward runs an
  autograd.Function whose backward is the declared formula (AOTAutograd traces it, so a compiled
  model's backward graph holds the operators the formula calls); one that declares none refuses
  such calls before anything runs: RuntimeError (autograd.no_backward_error) in eager mode, and at
  compile time under torch.compile, where Dynamo runs the operator on fake tensors that require
  gradients.

Why not `torch.library.custom_op` (as before issue 19): on a 2-core CPU host with torch 2.13
(benchmarks/op_dispatch.py: a trivial implementation on a CPU tensor, dispatch cost over calling
it directly) custom_op's dispatch cost 9-14 us per call (about 20 us on the H200 host of
BENCHMARKS.md), `register_autograd` on a Library op 7-10 us, this registration 3-4.5 us, of which
2-3.5 us is the dispatcher's floor (a Library op with no Autograd kernel at all costs that: the C++
dispatcher and one call into Python and back). A call that needs no gradient costs one Python
hop: the Autograd kernel calls the real implementation itself where the dispatcher would call it
next, that is where the call's dispatch key set (passed to the kernel, memoised by its bits) names
the CPU or CUDA backend after autograd, with nothing between (no tensor subclass such as
FakeTensor, no dispatch mode, no functionalization or functorch layer). Anything else (fake or
meta tensors while tracing, modes) is redispatched below autograd, exactly as custom_op's kernel
always redispatches. Under torch.inference_mode() the dispatcher skips the Autograd kernel and
calls the real one.

The public functions go through these operators when they must (autograd records a tensor that
requires gradients, or torch.compile traces: autograd.through_operator). Otherwise they take the plan
path directly, which has no dispatcher in between. `autosoft` itself never imports torch, so a
CuPy user never loads it; importing this module registers the operators (`register()`), and
`autosoft.native` adds compiled Autograd kernels for the operators it names where it was built.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import native
from .arrays import call_family, not_on_gpu
from .autograd import no_backward_error
from .dispatch import DISPATCHER
from .dtypes import OUTPUT_DTYPES, TORCH_INPUT_NAMES, check_input_dtypes
from .families import families, get_family
from .families.base import OptionValue
from .operators import OperatorCall, TorchOperator, declared_operators

if TYPE_CHECKING:
    import torch

__all__ = ["register", "declared", "call_operator", "OPS"]

OPS: tuple[str, ...] = ()
"""The registered operators' names in torch.ops.autosoft, as the families declare them."""

_lock = threading.Lock()
_declared: dict[str, TorchOperator] = {}  # registered operators by name
_overloads: dict[str, Any] = {}  # their default overloads (torch.ops.autosoft.<name>.default)
_arguments: dict[str, tuple[tuple[str, bool, Any], ...]] = {}  # their schemas' (name, a tensor, default) arguments
_libs: list[Any] = []  # the torch.library.Library objects that hold the registrations (they last as long as these)


def register() -> None:
    """Register every operator the families declare (autosoft.operators), from any thread: those
    registered before stay as they are, so a family registered since (a plug-in) gets its operators
    on the next call. Imports torch; ImportError where torch is missing or older than
    torch.library.register_fake (torch 2.4)."""
    global OPS
    with _lock:
        import torch

        if not hasattr(torch.library, "register_fake"):
            raise ImportError(f"autosoft.torch_ops needs torch.library.register_fake (torch >= 2.4); this is torch "
                              f"{torch.__version__}")
        new = [op for op in declared_operators(families()) if op.name not in _declared]
        if not new:
            return
        lib = torch.library.Library("autosoft", "FRAGMENT")
        _libs.append(lib)
        kernels = {}
        for op in new:  # one at a time, each whole: a bad declaration leaves the others registered
            schema = torch._C.parse_schema(f"autosoft::{op.name}{op.schema}")
            outputs = get_family(op.family).outputs
            if len(schema.returns) != len(outputs):
                raise ValueError(f"torch operator {op.name}: its schema returns {len(schema.returns)} tensors, the "
                                 f"{op.family} family's outputs are {', '.join(outputs)}")
            lib.define(op.name + op.schema, tags=(torch.Tag.pt2_compliant_tag,))
            overload = getattr(torch.ops.autosoft, op.name).default
            real = _real_implementation(op, len(outputs) == 1)
            # every backend: a CPU tensor reaches the real path, which refuses it with the public function's error
            lib.impl(op.name, real, "CompositeExplicitAutograd")
            torch.library.register_fake(f"autosoft::{op.name}", _fake_implementation(op, len(outputs) == 1), lib=lib)
            kernels[op.name] = _autograd_kernel(torch, op, overload, real)
            lib.impl(op.name, kernels[op.name], "Autograd", with_keyset=True)
            _overloads[op.name] = overload
            _arguments[op.name] = tuple((a.name, _is_tensor(torch, a.type), a.default_value)
                                        for a in schema.arguments)
            _declared[op.name] = op
            OPS = tuple(_declared)
        # where `autosoft native` built them: compiled AutogradCUDA kernels for the operators it names,
        # which fall back on the Python kernels above for what they do not take
        compiled = {op.name: (kernels[op.name], op.family, tuple(op.plan_options.items()))
                    for op in new if op.name in native.OPS and op.plan_options is not None}
        if compiled:
            native.enable(compiled)


def _is_tensor(torch: Any, kind: Any) -> bool:
    """Whether a schema argument's type is Tensor or Tensor? (an optional input, None where not given)."""
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def declared(name: str) -> TorchOperator:
    """The declaration of the registered operator `name`; KeyError where none is."""
    return _declared[name]


def call_operator(name: str, inputs: Sequence[str], arrays: Sequence[Any], options: Any,
                  scalars: Any) -> tuple[Any, ...]:
    """The outputs (a tuple, also of one) of operator `name` for a family function's call
    (base.Call): each schema argument by its name, a tensor from the arrays (named by the family's
    `inputs`), a number from the problem options or the run-time scalars, else the schema's default.
    What a family's Python function calls while torch.compile traces (the graph holds the operator)
    and while autograd records (the operator's backward)."""
    given = {**dict(zip(inputs, arrays)), **options, **scalars}
    values = [given[n] if tensor else _number(given.get(n, default)) for n, tensor, default in _arguments[name]]
    outputs = _overloads[name](*values)
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _number(value: Any) -> Any:
    """A run-time scalar (a NumPy number) as the schema's Python number; others as they are."""
    return value.item() if hasattr(value, "item") else value


def __getattr__(name: str) -> Any:
    """torch_ops.<name>: the registered operator's default overload (torch.ops.autosoft.<name>.default)."""
    try:
        return _overloads[name]
    except KeyError:
        raise AttributeError(f"module 'autosoft.torch_ops' has no attribute {name!r}") from None


# --- the autograd kernels: the one Python hop of a call ---------------------------------------
#
# The dispatcher runs an operator's Autograd kernel first (unless inference mode or a
# no-autograd guard excludes it), for every device. Each kernel here:
# - with grad mode on and an input that requires gradients: an operator with a declared backward
#   runs its autograd.Function (forward below autograd, backward the declared formula); the others
#   refuse before anything runs (no_backward_error), in eager mode and, under torch.compile, when
#   Dynamo runs the operator on fake tensors, that is at compile time;
# - otherwise, where the dispatcher's next kernel would be the real implementation (the call's key
#   set, after autograd, names the CPU or CUDA backend and nothing above it: no tensor subclass,
#   no dispatch mode, no functionalization or functorch layer), calls that implementation itself:
#   one Python hop for the whole call;
# - otherwise (fake tensors while tracing, meta tensors, modes, ...), redispatches below autograd,
#   as torch.library.custom_op's autograd kernel always does.

_DIRECT: dict[int, bool] = {}  # a call's dispatch key set (its raw bits) -> whether its next kernel is the real one


def _goes_to_real(torch: Any) -> Any:
    """direct(keyset) -> whether the dispatcher would call the real implementation next, memoised
    in _DIRECT (the kernels look there first: a key set's bits are one cheap call, its highest
    key after autograd several)."""
    after = torch._C._after_ADInplaceOrView_keyset  # ADInplaceOrView: a fallthrough for these operators
    backends = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)

    def direct(keyset: Any) -> bool:
        known = _DIRECT[keyset.raw_repr()] = (keyset & after).highestPriorityTypeId() in backends
        return known

    return direct


def _autograd_kernel(torch: Any, op: TorchOperator, overload: Any, real: Callable[..., Any]) -> Any:
    """The Autograd kernel of the declared operator `op` (the OpOverload `overload`, whose real
    implementation is `real`), as lib.impl(..., "Autograd", with_keyset=True) takes it:
    kernel(keyset, *args). With op.plan_options, a call along the last dim takes the plan straight
    from call_family's cache, as the real implementation does, one Python frame fewer."""
    direct = _goes_to_real(torch)
    below, after_autograd = torch._C._AutoDispatchBelowAutograd, torch._C._after_autograd_keyset
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
    known = _DIRECT.get  # written out in each kernel below: every call saved is ~0.1 us of the hot path

    def redispatch(keyset: Any, *args: Any) -> Any:
        with below():
            return overload.redispatch(keyset & after_autograd, *args)

    if op.backward is None:
        def refusing_kernel(keyset: Any, *args: Any) -> Any:
            # No backward: without this refusal, outputs of inputs that require gradients would carry
            # none, and backward() would fail far from the call (or a model silently stop learning).
            if grad_enabled() and any_requires_grad(*args):
                raise no_backward_error(op.name, op.instead)
            to_real = known(keyset.raw_repr())
            if to_real or (to_real is None and direct(keyset)):
                return real(*args)
            return redispatch(keyset, *args)

        return refusing_kernel

    apply = _autograd_function(torch, op, overload, real, direct, redispatch).apply
    if op.plan_options is None:
        def differentiable_kernel(keyset: Any, *args: Any) -> Any:
            if grad_enabled() and any_requires_grad(*args):
                return apply(keyset, *args)
            to_real = known(keyset.raw_repr())
            if to_real or (to_real is None and direct(keyset)):
                return real(*args)
            return redispatch(keyset, *args)

        return differentiable_kernel

    plans = DISPATCHER.fast  # load_cache and forget clear it; it is never replaced
    family, options = op.family, tuple(op.plan_options.items())  # as call_family puts them in its plan key

    def plan_kernel(keyset: Any, x: Any, dim: int) -> Any:
        # differentiable_kernel with the real implementation's hot path written in: the operator's
        # whole Python, per call
        if grad_enabled() and x.requires_grad:
            return apply(keyset, x, dim)
        to_real = known(keyset.raw_repr())
        if to_real or (to_real is None and direct(keyset)):
            if dim == -1:
                plan = plans.get((family, options, (), x.dtype, x.shape, x.get_device()))
                if plan is not None:
                    return plan((x,), ())[0]
            return real(x, dim)
        return redispatch(keyset, x, dim)

    return plan_kernel


def _autograd_function(torch: Any, op: TorchOperator, overload: Any, real: Callable[..., Any],
                       direct: Callable[[Any], bool], redispatch: Callable[..., Any]) -> Any:
    """The autograd.Function of an operator with a declared backward: forward runs the operator
    below autograd and saves what the formula reads (op.backward.saves: schema arguments and the
    family's outputs by name); backward calls the formula with torch.ops.autosoft."""
    assert op.backward is not None
    arguments = [(a.name, _is_tensor(torch, a.type), a.default_value) for a in overload._schema.arguments]
    outputs = get_family(op.family).outputs
    sources: list[tuple[str, bool, int, bool, Any]] = []  # (name, from the outputs, index, a tensor, default)
    for name in op.backward.saves:
        if name in outputs:
            sources.append((name, True, outputs.index(name), True, None))
        else:
            index = [n for n, _, _ in arguments].index(name)  # ValueError: a name the schema lacks
            sources.append((name, False, index, arguments[index][1], arguments[index][2]))
    tensor_names = [name for name, _, _, tensor, _ in sources if tensor]
    single = len(outputs) == 1
    formula, ops, known = op.backward.formula, torch.ops.autosoft, _DIRECT.get

    def forward(ctx: Any, keyset: Any, *args: Any) -> Any:
        to_real = known(keyset.raw_repr())
        if to_real is None:
            to_real = direct(keyset)
        results = real(*args) if to_real else redispatch(keyset, *args)
        produced = (results,) if single else results
        tensors, kept = [], {}
        for name, from_outputs, index, tensor, default in sources:
            # the dispatcher leaves out trailing arguments that have their schema default
            value = produced[index] if from_outputs else args[index] if index < len(args) else default
            if tensor:
                tensors.append(value)
            else:
                kept[name] = value
        ctx.save_for_backward(*tensors)
        ctx.kept = kept
        # an output the loss did not read gets None, as Backward promises, not zeros: a formula
        # can then skip that term instead of computing with zeros
        ctx.set_materialize_grads(False)
        return results

    def backward(ctx: Any, *grads: Any) -> Any:
        saved = dict(zip(tensor_names, ctx.saved_tensors), **ctx.kept)
        return (None, *formula(ops, saved, grads))  # None: the key set's

    # made with its name (grad_fn shows it: <op>_autogradBackward)
    Function = type(f"{op.name}_autograd", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    return Function


# --- the real implementations: the family's call through the array layer ----------------------

def _real_implementation(op: TorchOperator, single: bool) -> Callable[..., Any]:
    """The operator's implementation for every backend: its declared call, run by call_family
    as the family's public function runs it (naming autosoft.<operator> in errors where it is not
    the family's own name, as call_family names the family otherwise)."""
    family, declared_call = op.family, op.call
    who = None if op.name == op.family else f"autosoft.{op.name}"

    def real(*args: Any) -> Any:
        outs = _run(family, who or f"autosoft.{family}", who, declared_call(*args))
        return outs[0] if single else outs

    if op.plan_options is None:
        return real
    plans = DISPATCHER.fast
    options = tuple(op.plan_options.items())

    def planned(x: Any, dim: int) -> Any:
        if dim == -1:
            # The hot path. The schema made x a tensor and dim an int; call_family's cached plan under
            # call_family's own key (the same plan the public function takes); a first call prepares it there.
            plan = plans.get((family, options, (), x.dtype, x.shape, x.get_device()))
            if plan is not None:
                return plan((x,), ())[0]
        return real(x, dim)

    return planned


def _run(family: str, name: str, who: str | None, call: OperatorCall) -> tuple[Any, ...]:
    """call_family(family, ...) on a call's arrays; along another dim than the last, on the arrays
    with that dim moved last (a copy), the outputs moved back (a view)."""
    arrays, options, scalars = call.arrays, call.options or None, call.scalars or None
    if call.dim is not None:
        last = _last_dim(name, arrays[0], call.dim)
        if last != max(arrays[0].dim(), 1) - 1:
            moved = [a.movedim(last, -1) for a in arrays]
            outs = call_family(family, moved, options=options, scalars=scalars, who=who)
            return tuple(o.movedim(-1, last) for o in outs)
    return call_family(family, arrays, options=options, scalars=scalars, who=who)


def _last_dim(who: str, x: Any, dim: int) -> int:
    """dim as a non-negative index of x's dimensions; IndexError outside them."""
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{who}: dim {dim} is out of range for a {x.dim()}-dimensional input "
                         f"(expected {-ndim} to {ndim - 1})")
    return dim % ndim


# --- the fake implementations: shapes, dtypes and the errors that need no data ----------------

def _fake_implementation(op: TorchOperator, single: bool) -> Callable[..., Any]:
    """The operator's fake implementation: its declared call, then _fake_outputs."""
    family, declared_call, who = op.family, op.call, f"autosoft.{op.name}"

    def fake(*args: Any) -> Any:
        call = declared_call(*args)
        arrays = call.arrays
        if call.dim is not None:
            last = _last_dim(who, arrays[0], call.dim)
            if last != max(arrays[0].dim(), 1) - 1:
                moved = _fake_outputs(family, who, [a.movedim(last, -1) for a in arrays], call.options)
                outs = [o.movedim(-1, last) for o in moved]
                return outs[0] if single else tuple(outs)
        outs = _fake_outputs(family, who, arrays, call.options)
        return outs[0] if single else tuple(outs)

    return fake


def _fake_outputs(name: str, who: str, arrays: Sequence[torch.Tensor],
                  options: Any) -> list[torch.Tensor]:
    """The checks of arrays._prepare that need no data, in its order and with its errors, then
    empty contiguous outputs in the order of the family's outputs.

    Device: CUDA, or meta (meta tensors only ever reach this implementation: shape inference
    with a model built on the meta device works); CPU and other devices are refused as the real
    path refuses them. Shapes: the family's caller_outputs on the (possibly symbolic) shapes, so
    arrays that must agree become guards of a dynamic-shape graph; the family's problem checks
    (size limits and the like) on the example sizes only (symbolic sizes' hints: no guards, no
    specialisation), which the real implementation checks again each call."""
    import torch

    family = get_family(name)
    given = [(n, a) for n, a in zip(family.inputs, arrays) if a is not None or n not in family.optional_inputs]
    names = [n for n, _ in given]
    for n, a in given:
        if a.device.type not in ("cuda", "meta"):
            raise not_on_gpu(who, n, a)
    if len({a.device for _, a in given}) != 1:
        raise ValueError(f"{who}: {', '.join(names)} must be on one device")
    dtype = check_input_dtypes(who, [(n, str(a.dtype), TORCH_INPUT_NAMES.get(str(a.dtype))) for n, a in given],
                               family.dtypes, family.input_dtypes)
    checked: dict[str, OptionValue] = dict(options)
    outputs = family.caller_outputs({n: tuple(a.shape) for n, a in given}, dtype, checked)
    hinted = {n: tuple(_hint(s) for s in a.shape) for n, a in given}
    if all(s is not None for shape in hinted.values() for s in shape) and \
            not any(0 in shape for shape in hinted.values()):
        family.problem_for(hinted, dtype, checked)  # type: ignore[arg-type]  # no Nones here
    torch_dtypes = {v: getattr(torch, v) for v in OUTPUT_DTYPES}
    first = arrays[0]
    return [first.new_empty(shape, dtype=torch_dtypes[dt]) for shape, dt in (outputs[o] for o in family.outputs)]


def _hint(size: Any) -> int | None:
    """An int size as it is; a symbolic one's example value (None where it has none) without a guard."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


register()
