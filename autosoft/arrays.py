"""The array layer: CUDA torch tensors, CuPy arrays and other DLPack producers as device pointers,
dtypes, streams and freshly allocated outputs, one way for every family.

`call_family` is the generic path behind every public entry point (`autosoft.softmax`,
`autosoft.attention`, ...): classify the arrays (a TypeError for host arrays, None, lists and
the like, before any CUDA is touched), build the family's Problem from their shapes, make the
inputs contiguous and aligned as the kernels need, allocate the outputs in the caller's
framework, launch the dispatched variant on the caller's current stream, return the outputs.
A call whose family, options and array signatures were seen before takes the plan prepared for
them (kept in DISPATCHER.fast, which load_cache and forget clear): the per-call work is the
output allocation and one launch, into argument slots built with the plan.

Torch tensors are launched through libcuda itself (runtime.load_for_torch) on torch's current
stream, in the device's primary context: with a warm kernel store a torch process never imports
CuPy. CuPy is imported for CuPy arrays and other DLPack producers, and on the torch path only to
compile a kernel the store lacks or to verify a choice not tuned for this very problem.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .dispatch import DISPATCHER
from .dtypes import CUPY_INPUT_NAMES, TORCH_INPUT_NAMES, TORCH_NAMES, check_input_dtypes
from .families import get_family
from .families.base import Family, OptionValue, Problem, TensorMap

VEC_ALIGN = 16  # the kernels read 16-byte vectors: an output shares its input's address mod 16
_int64 = np.int64  # a stride as a kernel argument


def call_family(name: str, arrays: Sequence[Any], *, options: Mapping[str, OptionValue] | None = None,
                scalars: Mapping[str, Any] | None = None, out: Any = None, who: str | None = None) -> tuple[Any, ...]:
    """Run family `name` on `arrays` (in the order of its array inputs) with its problem options
    and run-time scalar arguments; returns its outputs in the order of `family.outputs`, each in
    the framework of the first array (torch in, torch out; a DLPack producer gives CuPy arrays).
    `out`: an array of the caller's framework to hold the first output (shape and dtype exactly
    the output's), returned in its place. The kernel writes into it where it is contiguous, shares
    the first input's address mod 16 and is not that input; otherwise the output is copied in.

    Raises TypeError for host arrays, non-arrays, mixed frameworks and dtypes the family does not
    take; ValueError for shapes it does not take, and for an `out` of the wrong shape, dtype or
    device; NoDeviceError where no GPU is usable. `who` is the public function those errors name
    (default autosoft.<name>; the softmax family's log option is autosoft.log_softmax).
    """
    opts = tuple(options.items()) if options else ()
    names = tuple(scalars) if scalars else ()
    values = tuple(scalars.values()) if scalars else ()
    torch = sys.modules.get("torch")
    first = arrays[0] if arrays else None
    if torch is not None and isinstance(first, torch.Tensor):
        # the hot path: one dict lookup by what decides the plan (dtype, shape, device of each array)
        try:
            if len(arrays) == 1:
                key = (name, opts, names, first.dtype, first.shape, first.get_device())
            else:
                key = (name, opts, names, *[None if a is None else (a.dtype, a.shape, a.get_device())
                                            for a in arrays])  # None: an optional input not given
        except AttributeError:  # a later argument is no tensor: _prepare says so
            key = None
        plan = DISPATCHER.fast.get(key)
        if plan is None:
            plan = _prepare(get_family(name), _TorchArrays(torch), arrays, options or {}, names, who)
            if key is not None:
                DISPATCHER.fast[key] = plan
        return plan(arrays, values) if out is None else _into(who or f"autosoft.{name}", plan, arrays, values, out, torch)
    family = get_family(name)
    arrays = as_cupy(family, arrays, who)
    key = (name, opts, names, *[None if a is None else (a.dtype, a.shape, a.data.device_id) for a in arrays])
    plan = DISPATCHER.fast.get(key)
    if plan is None:
        plan = DISPATCHER.fast[key] = _prepare(family, _CupyArrays(sys.modules["cupy"]), arrays, options or {},
                                               names, who)
    return plan(arrays, values) if out is None else _into(who or f"autosoft.{name}", plan, arrays, values, out, None)


def _into(who: str, plan: Callable[..., tuple[Any, ...]], arrays: Sequence[Any], values: tuple[Any, ...],
          out: Any, torch: Any) -> tuple[Any, ...]:
    """The plan's outputs with the first one in `out`: checked against the output the plan gives
    (shape, dtype, device, framework), written there directly where the kernel can, else copied."""
    if torch is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"{who}: out must be a torch tensor like the input, not {type(out).__name__}")
    if torch is None and not type(out).__module__.startswith("cupy"):
        raise TypeError(f"{who}: out must be a CuPy array like the input, not {type(out).__name__}")
    return plan(arrays, values, out)


def call_along(name: str, x: Any, dim: Any, out: Any, options: Mapping[str, OptionValue] | None, who: str) -> Any:
    """call_family(name, (x,)) along `dim` for a family that works along the last dimension (the
    softmax family): the last directly, another moved last (one copy), computed, moved back (a
    view); `out` as call_family's, here copied in. `who` names the public function in errors."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"autosoft.{who}: dim must be an int, got {type(dim).__name__}")
    dim = int(dim)
    shape = getattr(x, "shape", None)
    public = f"autosoft.{who}"
    if shape is None:
        return call_family(name, (x,), options=options, who=public)[0]  # the array layer says what x is not
    ndim = len(shape)
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"autosoft.{who}: dim {dim} is out of range for a {ndim}-dimensional input "
                         f"(expected {-max(ndim, 1)} to {max(ndim, 1) - 1})")
    dim = dim % ndim if ndim else 0
    if dim == ndim - 1 or ndim == 0:
        return call_family(name, (x,), options=options, out=out, who=public)[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        y = call_family(name, (x.movedim(dim, -1),), options=options, who=public)[0].movedim(-1, dim)
    else:
        x = as_cupy(get_family(name), [x], public)[0]  # TypeError for anything but CuPy arrays and CUDA DLPack producers
        import cupy  # there: x is a CuPy array now

        y = cupy.moveaxis(call_family(name, (cupy.moveaxis(x, dim, -1),), options=options, who=public)[0], -1, dim)
    if out is None:
        return y
    if tuple(out.shape) != tuple(y.shape) or str(out.dtype) != str(y.dtype) or type(out) is not type(y):
        raise ValueError(f"autosoft.{who}: out must be a {y.dtype} array of shape {tuple(y.shape)} like the "
                         f"result, got {type(out).__name__} {out.dtype} {tuple(out.shape)}")
    if hasattr(out, "copy_"):
        return out.copy_(y)
    out[...] = y
    return out


def as_cupy(family: Family, arrays: Sequence[Any], who: str | None = None) -> list[Any]:
    """CuPy arrays for CuPy arrays and DLPack CUDA producers; TypeError, before CUDA is touched,
    for anything else (naming `who`, default autosoft.<family>)."""
    who = who or f"autosoft.{family.name}"
    names = [n for n in family.inputs][:len(arrays)]
    out = []
    for name, a in zip(names, arrays):
        type_name = f"{type(a).__module__}.{type(a).__name__}"
        if type_name.startswith("cupy.") or (a is None and name in family.optional_inputs):
            out.append(a)
            continue
        if type_name.startswith("numpy."):
            raise TypeError(f"{who}: {name} is a host (NumPy) array; move it to the GPU first (cupy.asarray({name}))")
        if type_name.startswith("torch."):
            raise TypeError(f"{who}: {name} is a torch tensor while the first argument is not; pass one kind of array")
        if not hasattr(a, "__dlpack__"):
            shown = type(a).__name__ if type(a).__module__ == "builtins" else type_name
            raise TypeError(f"{who}: {name} is a {shown}, not a CuPy array, a CUDA torch tensor or a "
                            "DLPack CUDA tensor")
        where = _dlpack_device_type(a)
        if where is not None and where not in _CUDA_DLPACK:
            place = "in host memory" if where in _HOST_DLPACK else f"on a DLPack device of type {where}, not a CUDA GPU"
            raise TypeError(f"{who}: {name} is a {type_name} {place}; move it to the GPU first")
        from .runtime import cupy_module

        try:
            out.append(cupy_module().from_dlpack(a))
        except Exception as exc:  # noqa: BLE001 - DLPack producers raise many kinds
            if isinstance(exc, TypeError) or type(exc).__name__ == "NoDeviceError":
                raise
            raise TypeError(f"{who}: cannot view {type_name} on the GPU through DLPack: {exc}") from None
    return out


_CUDA_DLPACK = (2, 13)  # DLPack's kDLCUDA and kDLCUDAManaged: what CuPy views
_HOST_DLPACK = (1, 3)  # kDLCPU and kDLCUDAHost (pinned host memory)


def _dlpack_device_type(a: Any) -> int | None:
    """The DLPack device type a producer says its memory is on (__dlpack_device__), None where it
    says nothing: asked before any GPU is looked for, so a host producer is a TypeError even on a
    machine without one."""
    device = getattr(a, "__dlpack_device__", None)
    if device is None:
        return None
    try:
        return int(device()[0])
    except Exception:  # noqa: BLE001 - a producer that cannot say: CuPy's from_dlpack decides
        return None


def not_on_gpu(who: str, name: str, tensor: Any) -> TypeError:
    """The error for a torch tensor that is not on a CUDA device, naming where it is."""
    kind = tensor.device.type
    if kind == "meta":  # no data to move: made on the meta device, it must be made again on the GPU
        return TypeError(f"{who}: {name} is a meta tensor (a shape without data); autosoft computes on CUDA "
                         f"tensors (only torch.ops.autosoft's operators take meta tensors, for shape inference)")
    return TypeError(f"{who}: {name} is a {'CPU' if kind == 'cpu' else kind} tensor; move it to the GPU first "
                     f"({name}.cuda())")


def _prepare(family: Family, fw: "_Framework", arrays: Sequence[Any], options: Mapping[str, OptionValue],
             scalar_names: tuple[str, ...], who: str | None = None) -> Callable[..., tuple[Any, ...]]:
    """Check one call signature and return its plan: plan(arrays, scalar_values) -> outputs."""
    who = who or f"autosoft.{family.name}"
    array_names = tuple(n for n in family.inputs if n not in scalar_names)
    if len(arrays) != len(array_names):
        raise TypeError(f"{who}: expected {len(array_names)} arrays ({', '.join(array_names)}), got {len(arrays)}")
    given = [(n, a) for n, a in zip(array_names, arrays) if a is not None or n not in family.optional_inputs]
    fw.check(who, [n for n, _ in given], [a for _, a in given])
    dtype = check_input_dtypes(who, [(n, str(a.dtype), fw.dtype(a)) for n, a in given], family.dtypes,
                               family.input_dtypes)
    device = fw.device(arrays[0])
    shapes = {n: tuple(int(s) for s in a.shape) for n, a in given}
    outputs = family.caller_outputs(shapes, dtype, options)
    if any(fw.size(a) == 0 for _, a in given):
        # nothing to compute from: an output that is not empty itself (attention's o over no key,
        # the backward's dk over no query) holds the family's value for that (Family.empty_values)
        fills = tuple(family.empty_values.get(name, 0.0) if math.prod(shape) else None
                      for name, (shape, _) in outputs.items())

        def empty(arrays: Sequence[Any], scalars: tuple[Any, ...], given: Any = None) -> tuple[Any, ...]:
            outs = [fw.empty(shape, dt, device, 0) for shape, dt in outputs.values()]
            if given is not None:
                fw.check_out(given, next(iter(outputs.values())), device, 0)
                outs[0] = given
            for out, value in zip(outs, fills):
                if value is not None:
                    fw.fill(out, value)
            return tuple(outs)
        return empty
    problem = family.problem_for(shapes, dtype, options)
    # inputs taken with their own strides: each one's strides but the last follow the scalars
    strided = tuple(i for i, n in enumerate(array_names) if n in family.strided_inputs)
    stride_names = tuple(f"{array_names[i]}_stride{d}" for i in strided for d in range(len(shapes[array_names[i]]) - 1))
    loaded = fw.loaded(problem, device)
    # tensor maps over their array's own rows (TensorMap.runtime_rows): fixed by the signature,
    # passed after the strides
    rows = {m.rows_name: _int64(shapes[m.array][0]) for launch in loaded.variant.launches for m in launch.args
            if isinstance(m, TensorMap) and m.runtime_rows}
    launch = loaded.launcher(array_names + tuple(outputs) + scalar_names + stride_names + tuple(rows),
                             scalar_names + stride_names + tuple(rows))
    if rows:
        with_rows, row_values = launch, tuple(rows.values())

        def launch(*args: Any) -> None:
            with_rows(*args[:-1], *row_values, args[-1])
    # a signature fixes the first input's shape and dtype: whether the first output matches them
    # (softmax's) is known now, not asked at each call
    like_first = next(iter(outputs.values())) == (shapes[array_names[0]], dtype) if array_names[0] in shapes else False
    return fw.plan(launch, tuple(outputs.values()), device, family.input_alignment, len(arrays), strided, like_first)


class _Framework:
    """What the plan needs of a framework: dtype names, pointers, devices, streams, allocation."""

    def check(self, who: str, names: Sequence[str], arrays: Sequence[Any]) -> None: ...
    def dtype(self, a: Any) -> str | None: ...
    def device(self, a: Any) -> int: ...
    def size(self, a: Any) -> int: ...
    def ptr(self, a: Any) -> int: ...
    def fix(self, a: Any, align: int) -> Any: ...
    def empty(self, shape: tuple[int, ...], dtype: str, device: int, like_ptr: int) -> Any: ...
    def fill(self, out: Any, value: float) -> None: ...
    def stream(self, device: int) -> int: ...

    def plan(self, launch: Callable[..., None], specs: tuple[tuple[tuple[int, ...], str], ...], device: int,
             align: int, n_arrays: int, strided: tuple[int, ...] = (), like_first: bool = False
             ) -> Callable[..., tuple[Any, ...]]:
        """plan(arrays, scalar_values) -> outputs, for calls with `n_arrays` input arrays: each input
        made contiguous and `align`-ed (a copy only where it is not), outputs allocated sharing the
        first input's address mod 16, one launch on the device's current stream. The inputs at the
        indices `strided` (the family's strided_inputs) are taken as they are where their last
        dimension is contiguous and their address and other strides are `align`-ed, and their
        strides (elements, but the last) are passed after the scalars. like_first: the first
        output has the first input's shape and dtype. The generic form; frameworks may specialise it."""
        fix, ptr, empty, stream = self.fix, self.ptr, self.empty, self.stream
        fix_strided, strides_of = self.fix_strided, self.strides

        check_out, copy_into = self.check_out, self.copy_into

        def plan(arrays: Sequence[Any], scalars: tuple[Any, ...], given: Any = None) -> tuple[Any, ...]:
            held = [a if a is None else fix_strided(a, align) if i in strided else fix(a, align)
                    for i, a in enumerate(arrays)]
            ptrs = [0 if a is None else ptr(a) for a in held]  # None: an optional input not given
            strides = [s for i in strided for s in strides_of(held[i])]
            outs = [empty(shape, dt, device, ptrs[0]) for shape, dt in specs]
            direct = given is not None and check_out(given, specs[0], device, ptrs[0])
            if direct:
                outs[0] = given
            launch(*ptrs, *[ptr(o) for o in outs], *scalars, *strides, stream(device))
            if given is not None and not direct:
                outs[0] = copy_into(given, outs[0])
            return tuple(outs)

        return plan

    def check_out(self, out: Any, spec: tuple[tuple[int, ...], str], device: int, first_ptr: int) -> bool:
        """ValueError unless `out` has the output's shape, dtype and device; whether the kernel can
        write into it: contiguous, the first input's address mod 16, not that input's memory."""
        shape, dtype = spec
        if tuple(out.shape) != tuple(shape) or self.dtype(out) != dtype or self.device(out) != device:
            raise ValueError(f"out must be a {dtype} array of shape {tuple(shape)} on device {device}, got "
                             f"{out.dtype} {tuple(out.shape)} on device {self.device(out)}")
        address = self.ptr(out)
        return self.contiguous(out) and address % VEC_ALIGN == first_ptr % VEC_ALIGN and address != first_ptr

    def contiguous(self, a: Any) -> bool: ...

    def strides(self, a: Any) -> list[Any]:
        """The strides of every dimension but the last, in elements, as numpy int64 (kernel arguments)."""
        ...

    def fix_strided(self, a: Any, align: int) -> Any:
        """a where its last dimension is contiguous and its address and other strides are
        multiples of `align` bytes (a dimension of one element has no stride to speak of), else a
        contiguous copy."""
        ...

    def copy_into(self, out: Any, result: Any) -> Any:
        out[...] = result
        return out

    def loaded(self, problem: Problem, device: int) -> Any:
        """The problem's variant loaded on `device` for this framework's arrays (through CuPy)."""
        from .runtime import cupy_module

        with cupy_module().cuda.Device(device):
            return DISPATCHER.loaded(problem, device)


def torch_loaded(problem: Problem, device: int) -> Any:
    """The problem's variant loaded on `device` for torch tensors: through libcuda on the
    device's primary context (torch's), so a warm kernel store never imports CuPy (CuPy is
    imported only to compile on a cold store's miss, or to verify a choice that was not tuned
    for this very problem). For a family that launches by itself (cross_entropy)."""
    from .runtime import load_for_torch

    torch = sys.modules["torch"]
    with torch.cuda.device(device):  # the device's context current: the dispatcher asks which GPU
        return DISPATCHER.loaded(problem, device, load_for_torch)


def torch_current_stream(torch: Any) -> Callable[[int], int]:
    """device -> torch's current stream on it, as the raw handle, without building a torch Stream
    object (Triton reads it the same way)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw else (lambda device: torch.cuda.current_stream(device).cuda_stream)


class _TorchArrays(_Framework):
    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self._dtypes = {v: getattr(torch, v) for v in (*TORCH_NAMES.values(), "int32")}  # int32: index outputs
        self.stream = torch_current_stream(torch)

    def loaded(self, problem: Problem, device: int) -> Any:
        return torch_loaded(problem, device)

    def plan(self, launch: Callable[..., None], specs: tuple[tuple[tuple[int, ...], str], ...], device: int,
             align: int, n_arrays: int, strided: tuple[int, ...] = (), like_first: bool = False
             ) -> Callable[..., tuple[Any, ...]]:
        """The generic plan with the torch calls written out: this is autosoft.softmax's hot path,
        where every call into torch costs a hundred nanoseconds or more."""
        torch = self.torch
        empty, empty_like, contiguous = torch.empty, torch.empty_like, torch.contiguous_format
        where = torch.device("cuda", device)
        outs_spec = tuple((shape, self._dtypes[dt]) for shape, dt in specs)
        stream, realign, check_out = self.stream, self._realigned, self.check_out

        if n_arrays == 1 and len(outs_spec) == 1 and align == 1 and not strided:
            # one array in, one out, any address (softmax): the fewest torch calls per call
            (out_shape, out_dtype), = outs_spec

            def plan_one(arrays: Sequence[Any], scalars: tuple[Any, ...], given: Any = None) -> tuple[Any, ...]:
                a = arrays[0]
                if not a.is_contiguous():
                    a = a.clone(memory_format=contiguous)
                x = a.data_ptr()
                if given is not None and check_out(given, specs[0], device, x):
                    launch(x, given.data_ptr(), *scalars, stream(device))
                    return (given,)
                out = empty_like(a) if like_first else empty(out_shape, dtype=out_dtype, device=where)
                y = out.data_ptr()
                if (y - x) % VEC_ALIGN:
                    out = realign(out, x % VEC_ALIGN)
                    y = out.data_ptr()
                if scalars:
                    launch(x, y, *scalars, stream(device))
                else:  # softmax's: no argument tuple to unpack
                    launch(x, y, stream(device))
                return (out,) if given is None else (given.copy_(out),)

            native = getattr(launch, "native", None)
            if native is not None and sorted(at for _, at in native.pointers) == [0, 1]:
                # what autosoft.native's compiled kernels replay: the input's address into one
                # word, a fresh output's into the other (any other case stays here)
                plan_one.native = native  # type: ignore[attr-defined]
            return plan_one

        fix_strided, strides_of = self.fix_strided, self.strides

        def plan(arrays: Sequence[Any], scalars: tuple[Any, ...], given: Any = None) -> tuple[Any, ...]:
            ptrs = []
            strides = []
            copies = []  # held until the launch: a copy let go would give its block to the next one
            for i, a in enumerate(arrays):
                if a is None:  # an optional input not given: a null pointer
                    ptrs.append(0)
                    continue
                if i in strided:
                    fixed = fix_strided(a, align)
                    strides += strides_of(fixed)
                    if fixed is not a:
                        copies.append(fixed)
                    a = fixed
                elif not a.is_contiguous() or (align > 1 and a.data_ptr() % align):
                    a = a.clone(memory_format=contiguous)  # a fresh block is 256-byte aligned
                    copies.append(a)
                ptrs.append(a.data_ptr())
            if strides:
                scalars = (*scalars, *strides)
            first = ptrs[0] % VEC_ALIGN
            direct = given is not None and check_out(given, specs[0], device, ptrs[0])
            outs = []
            for i, (shape, dt) in enumerate(outs_spec):
                out = given if i == 0 and direct else empty(shape, dtype=dt, device=where)
                address = out.data_ptr()
                if address % VEC_ALIGN != first:
                    out = realign(out, first)
                    address = out.data_ptr()
                outs.append(out)
                ptrs.append(address)
            launch(*ptrs, *scalars, stream(device))
            if given is not None and not direct:
                outs[0] = given.copy_(outs[0])
            return tuple(outs)

        return plan

    def check(self, who: str, names: Sequence[str], arrays: Sequence[Any]) -> None:
        torch = self.torch
        for name, a in zip(names, arrays):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{who}: {name} must be a torch tensor like the first argument, "
                                f"not {type(a).__name__}")
            if not a.is_cuda:
                raise not_on_gpu(who, name, a)
        if len({a.device for a in arrays}) != 1:
            raise ValueError(f"{who}: {', '.join(names)} must be on one device")

    def dtype(self, a: Any) -> str | None:
        return TORCH_INPUT_NAMES.get(str(a.dtype))

    def device(self, a: Any) -> int:
        return a.get_device()

    def size(self, a: Any) -> int:
        return a.numel()

    def ptr(self, a: Any) -> int:
        return a.data_ptr()

    def contiguous(self, a: Any) -> bool:
        return a.is_contiguous()

    def strides(self, a: Any) -> list[Any]:
        return [_int64(s) for s in a.stride()[:-1]]

    def fix_strided(self, a: Any, align: int) -> Any:
        size = a.element_size()
        if a.data_ptr() % align == 0 and (a.dim() == 0 or a.stride(-1) == 1 or a.shape[-1] == 1) and \
                all(n == 1 or s * size % align == 0 for n, s in zip(a.shape[:-1], a.stride()[:-1])):
            return a
        return a.clone(memory_format=self.torch.contiguous_format)

    def copy_into(self, out: Any, result: Any) -> Any:
        return out.copy_(result)

    def fix(self, a: Any, align: int) -> Any:
        if a.is_contiguous() and a.data_ptr() % align == 0:
            return a
        return a.clone(memory_format=self.torch.contiguous_format)  # a fresh block is 256-byte aligned

    def empty(self, shape: tuple[int, ...], dtype: str, device: int, like_ptr: int) -> Any:
        out = self.torch.empty(shape, dtype=self._dtypes[dtype], device=device)
        misalign = like_ptr % VEC_ALIGN
        return out if misalign == out.data_ptr() % VEC_ALIGN else self._realigned(out, misalign)

    def fill(self, out: Any, value: float) -> None:
        out.fill_(value)

    def _realigned(self, out: Any, misalign: int) -> Any:
        """A tensor like `out` whose address is `misalign` past a multiple of 16 bytes."""
        itemsize = out.element_size()
        flat = self.torch.empty(out.numel() + VEC_ALIGN // itemsize, dtype=out.dtype, device=out.device)
        start = misalign // itemsize
        return flat[start:start + out.numel()].view(out.shape)


class _CupyArrays(_Framework):
    def __init__(self, cp: Any) -> None:
        self.cp = cp

    def check(self, who: str, names: Sequence[str], arrays: Sequence[Any]) -> None:
        if len({a.data.device_id for a in arrays}) != 1:
            raise ValueError(f"{who}: {', '.join(names)} must be on one device")

    def dtype(self, a: Any) -> str | None:
        return CUPY_INPUT_NAMES.get(str(a.dtype))

    def device(self, a: Any) -> int:
        return a.data.device_id

    def size(self, a: Any) -> int:
        return a.size

    def ptr(self, a: Any) -> int:
        return a.data.ptr

    def contiguous(self, a: Any) -> bool:
        return a.flags.c_contiguous

    def strides(self, a: Any) -> list[Any]:
        return [_int64(s // a.itemsize) for s in a.strides[:-1]]

    def fix_strided(self, a: Any, align: int) -> Any:
        if a.data.ptr % align == 0 and (a.ndim == 0 or a.strides[-1] == a.itemsize or a.shape[-1] == 1) and \
                all(n == 1 or s % align == 0 for n, s in zip(a.shape[:-1], a.strides[:-1])):
            return a
        return self.fix(a, align)

    def fix(self, a: Any, align: int) -> Any:
        if a.flags.c_contiguous and a.data.ptr % align == 0:
            return a
        with a.device:
            return self.cp.array(a, order="C", copy=True)  # a fresh block is 256-byte aligned

    def empty(self, shape: tuple[int, ...], dtype: str, device: int, like_ptr: int) -> Any:
        cp = self.cp
        with cp.cuda.Device(device):
            out = cp.empty(shape, dtype=dtype)
            misalign = like_ptr % VEC_ALIGN
            if misalign == out.data.ptr % VEC_ALIGN:
                return out
            flat = cp.empty(out.size + VEC_ALIGN // out.itemsize, dtype=dtype)
            start = misalign // out.itemsize
            return flat[start:start + out.size].reshape(shape)

    def fill(self, out: Any, value: float) -> None:
        with out.device:
            out.fill(value)

    def stream(self, device: int) -> int:
        cp = self.cp
        with cp.cuda.Device(device):
            return cp.cuda.get_current_stream().ptr
