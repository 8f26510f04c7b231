"""What the serving families check of a call on the host before anything reaches a device
(attention_kvcache, attention_varlen): the arrays' dtypes and shapes, once per signature, with
errors naming the argument, and whether an array is handed to the kernel as it is. A private
module: the registry imports no family from it."""
from __future__ import annotations

from typing import Any, Mapping

from ..autograd import tracing
from ..dtypes import check_input_dtypes


_VALID: set[tuple[Any, ...]] = set()  # (family, then each array's shape and dtype) of calls that passed
_VALID_KEPT = 4096  # then forgotten all at once: shapes that change every call must not grow it without end


def check_arrays(who: str, family: Any, names: tuple[str, ...], arrays: tuple[Any, ...]) -> bool:
    """Whether the arrays (None: an optional one not given) were checked: their dtypes
    (dtypes.check_input_dtypes) and shapes (the family's check_call_shapes), raising their errors. False
    while torch.compile traces (the operator checks then) and where one is no array (the array
    layer says what it is not). A signature that passed once is not checked again: a decode loop
    pays one lookup a step."""
    if tracing():  # the operator's fake implementation checks the shapes; its real one calls python_call again
        return False
    try:
        key = (family.name, *[None if a is None else (a.shape, a.dtype) for a in arrays])
        if key in _VALID:
            return True
    except (AttributeError, TypeError):  # no array, or a shape or dtype that does not hash
        key = None
    facts = array_facts(dict(zip(names, arrays)))
    if facts is None:
        return False
    shapes, dtypes = facts
    check_input_dtypes(who, [(n, d, d) for n, d in dtypes.items()], family.dtypes, family.input_dtypes)
    family.check_call_shapes(who, shapes)
    if key is not None:
        if len(_VALID) >= _VALID_KEPT:
            _VALID.clear()
        _VALID.add(key)
    return True


def array_facts(named: Mapping[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]] | None:
    """The shapes and dtype names (torch's without the "torch." prefix) of the given arrays (None:
    an optional one not given), or None where one is no array at all: the array layer then says
    what it is not."""
    shapes, dtypes = {}, {}
    for name, a in named.items():
        if a is None:
            continue
        shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
        if shape is None or dtype is None:
            return None
        shapes[name], dtypes[name] = tuple(shape), str(dtype).removeprefix("torch.")
    return shapes, dtypes


def taken_as_it_is(a: Any, align: int) -> bool:
    """Whether the array layer hands `a` to the kernel as it is (contiguous, its address a multiple
    of `align` bytes) rather than a copy: what a kernel that writes into an input needs."""
    if hasattr(a, "is_contiguous"):  # torch: its allocations start aligned (no data_ptr: a fake tensor has none)
        return bool(a.is_contiguous()) and a.storage_offset() * a.element_size() % align == 0
    flags = getattr(a, "flags", None)
    if flags is not None and hasattr(a, "data"):  # CuPy
        return bool(flags.c_contiguous) and a.data.ptr % align == 0
    return True  # another DLPack producer: converted to CuPy sharing its memory, checked no further
