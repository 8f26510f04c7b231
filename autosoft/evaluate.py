"""Verify, then time, one compiled variant on the GPU. Every evaluation ends in an Outcome."""
from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass
from typing import Any


from .dtypes import poisoned
from .errors import one_line
from .families.base import Family, Variant
from .runtime import LoadedVariant, cupy_module
from .timing import Timing, release_l2_scratch, rotation_count, time_gpu


class Status(str, enum.Enum):
    OK = "ok"
    INVALID = "invalid"            # a constraint of the search space rejects it
    COMPILE_FAIL = "compile_fail"
    LAUNCH_FAIL = "launch_fail"    # loading or launching failed, or the kernel faulted
    TIMEOUT = "timeout"
    WRONG = "wrong"                # ran, but the output is not the softmax of the input


@dataclass(frozen=True)
class Outcome:
    status: Status
    time_us: float | None = None
    message: str = ""
    compile_s: float | None = None   # wall seconds NVRTC took for it, where the runner measured them
    evaluate_s: float | None = None  # wall seconds of loading, verifying and timing it

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


def allocate_outputs(family: Family, variant: Variant, xp: Any) -> dict[str, Any]:
    return {name: poisoned(shape, dtype, xp) for name, (shape, dtype) in family.output_specs(variant.problem).items()}


def verify(family: Family, loaded: LoadedVariant, seed: int) -> str | None:
    """Run on fresh random inputs of every kind; None when all match the reference, else why not."""
    cp = cupy_module()
    variant = loaded.variant
    rng = cp.random.default_rng(seed)
    for kind in family.input_kinds:
        inputs = family.make_inputs(variant.problem, kind, cp, rng)
        outputs = allocate_outputs(family, variant, cp)
        loaded.launch({**inputs, **outputs})
        cp.cuda.runtime.deviceSynchronize()
        problem = family.check(variant.problem, inputs, outputs, cp)
        if problem:
            return f"{kind} inputs: {problem}"
    return None


def time_variant(family: Family, loaded: LoadedVariant, reps: int = 40) -> Timing:
    """Median kernel time over rotated input sets (each set read cold from device memory)."""
    sets = _timing_sets(family, loaded.variant, seed=12345)
    return time_gpu(lambda i: loaded.launch(sets[i]), len(sets), reps)


def time_side_by_side(family: Family, loaded: list[LoadedVariant], rounds: int = 5, reps: int = 20) -> list[float]:
    """Median kernel time of each variant (same problem) over `rounds` interleaved rounds on one
    shared set of rotated inputs. The search times each candidate once, and its fastest few can
    differ by less than that timing's noise; timing them side by side, in turns, lets slow
    drifts of clock or temperature fall on all of them alike."""
    sets = _timing_sets(family, loaded[0].variant, seed=54321)
    samples: list[list[float]] = [[] for _ in loaded]
    for _ in range(rounds):
        for one, out in zip(loaded, samples):
            out.append(time_gpu(lambda i, one=one: one.launch(sets[i]), len(sets), reps).median_us)
    return [statistics.median(out) for out in samples]


def race(family: Family, loaded: list[LoadedVariant]) -> list[float] | None:
    """time_side_by_side for dispatch's race before a first call: None when the device has no
    room for the inputs it allocates beside the caller's. What it allocated goes back to the
    device after, not to CuPy's pool: the caller's arrays may be torch's, whose allocator
    cannot use that pool."""
    cp = cupy_module()
    try:
        return time_side_by_side(family, loaded)
    except cp.cuda.memory.OutOfMemoryError:
        return None
    finally:
        release_l2_scratch()
        cp.get_default_memory_pool().free_all_blocks()


def _timing_sets(family: Family, variant: Variant, seed: int) -> list[dict[str, Any]]:
    """Input/output sets of fresh normal data, enough of them that rotating over them keeps
    every run's data cold in the L2."""
    from .runtime import device_info

    cp = cupy_module()
    n_sets = rotation_count(family.bytes_moved(variant.problem), device_info().target.l2_bytes)
    rng = cp.random.default_rng(seed)
    return [{**family.make_inputs(variant.problem, "normal", cp, rng), **allocate_outputs(family, variant, cp)}
            for _ in range(n_sets)]


def evaluate(family: Family, variant: Variant, cubin: bytes, seed: int = 0, reps: int = 40) -> Outcome:
    """Load, verify, time. A failure at any step becomes the Outcome, never an exception."""
    cp = cupy_module()
    try:
        loaded = LoadedVariant(variant, cubin)
    except Exception as exc:  # noqa: BLE001 - any driver error is this variant's failure
        return Outcome(Status.LAUNCH_FAIL, message=f"load: {one_line(exc)}")
    try:
        wrong = verify(family, loaded, seed)
    except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as exc:
        return Outcome(Status.LAUNCH_FAIL, message=one_line(exc))
    if wrong:
        return Outcome(Status.WRONG, message=wrong)
    try:
        timing = time_variant(family, loaded, reps)
    except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as exc:
        return Outcome(Status.LAUNCH_FAIL, message=one_line(exc))
    return Outcome(Status.OK, time_us=timing.median_us)
