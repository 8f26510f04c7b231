"""A separate process that owns the GPU context and evaluates candidates for the tuner.

A candidate may fault (illegal address), hang, or poison the CUDA context. Running it in a
worker lets the tuner survive all of that: a result that does not arrive in time is a
timeout, a worker that dies or reports a launch failure is replaced by a fresh one (with a
fresh context), and the tune goes on.
"""
from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from typing import Any

from .errors import one_line
from .evaluate import Outcome, Status

_START_TIMEOUT_S = 120.0  # importing CuPy and creating a context, once per worker


@dataclass(frozen=True)
class Watchdog:
    """How long one evaluation may take: multiple x the default variant's kernel time x the
    launches of an evaluation, kept between floor and cap (seconds)."""
    multiple: float = 200.0
    floor_s: float = 10.0
    cap_s: float = 120.0

    def limit(self, default_time_us: float | None, launches: int) -> float:
        if default_time_us is None:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.multiple * default_time_us * 1e-6 * launches))


class GpuWorker:
    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")  # never fork a process that holds a CUDA context
        self._proc: Any = None
        self._conn: Any = None
        self.restarts = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child,), daemon=True, name="autosoft-gpu-worker")
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(_START_TIMEOUT_S):
            self.stop()
            raise RuntimeError("the GPU worker did not start")
        ready = parent.recv()
        if ready != "ready":
            self.stop()
            raise RuntimeError(f"the GPU worker failed to start: {ready}")

    def _call(self, request: tuple, timeout_s: float) -> tuple[bool, Any]:
        """(True, reply), or (False, why) when the worker hung or died; it is then replaced."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send(request)
            if not self._conn.poll(timeout_s):
                self.restart()
                return False, f"no result within {timeout_s:.1f} s; the worker was killed and restarted"
            return True, self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            self.restart()
            return False, f"the worker died (exit code {code}) and was restarted"

    def evaluate(self, family: Any, variant: Any, cubin: bytes, seed: int, timeout_s: float) -> Outcome:
        ok, reply = self._call(("evaluate", family, variant, cubin, seed), timeout_s)
        if not ok:
            status = Status.TIMEOUT if reply.startswith("no result") else Status.LAUNCH_FAIL
            return Outcome(status, message=reply)
        if reply.status is Status.LAUNCH_FAIL:
            self.restart()  # a fault can leave the context unusable: start clean for the next one
        return reply

    def time_side_by_side(self, family: Any, compiled: list[tuple[Any, bytes]], timeout_s: float) -> list[float] | None:
        """Re-time verified variants of one problem side by side (evaluate.time_side_by_side);
        None when that fails, and the caller keeps the times it has."""
        ok, reply = self._call(("side_by_side", family, compiled), timeout_s)
        if ok and isinstance(reply, list):
            return reply
        if ok:
            self.restart()  # it raised: start clean, as after a launch failure
        return None

    def time_copy(self, nbytes_each_way: int, l2_bytes: int, timeout_s: float = 120.0) -> float:
        ok, reply = self._call(("copy", nbytes_each_way, l2_bytes), timeout_s)
        if not ok or isinstance(reply, Exception):
            raise RuntimeError(f"timing the reference copy failed: {reply}")
        return reply

    def matmul_tflops(self, timeout_s: float = 120.0) -> float:
        ok, reply = self._call(("matmul",), timeout_s)
        if not ok or isinstance(reply, Exception):
            raise RuntimeError(f"timing the reference matrix product failed: {reply}")
        return reply

    def restart(self) -> None:
        self.stop()
        self.restarts += 1

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def __enter__(self) -> "GpuWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _serve(conn: Any) -> None:
    """The worker's loop: evaluate requests until the pipe closes."""
    try:
        from .evaluate import evaluate, time_side_by_side
        from .runtime import LoadedVariant, cupy_module
        from .timing import matmul_tflops, time_copy

        cupy_module().cuda.runtime.free(0)  # create the context now, not inside the first timeout
        conn.send("ready")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        kind = request[0]
        try:
            if kind == "evaluate":
                _, family, variant, cubin, seed = request
                conn.send(evaluate(family, variant, cubin, seed=seed))
            elif kind == "side_by_side":
                _, family, compiled = request
                conn.send(time_side_by_side(family, [LoadedVariant(v, cubin) for v, cubin in compiled]))
            elif kind == "copy":
                conn.send(time_copy(request[1], request[2]).median_us)
            elif kind == "matmul":
                conn.send(matmul_tflops())
        except Exception as exc:  # noqa: BLE001 - anything else is this candidate's launch failure
            conn.send(Outcome(Status.LAUNCH_FAIL, message=f"{type(exc).__name__}: {one_line(exc)}")
                      if kind == "evaluate" else exc)
