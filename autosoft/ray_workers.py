"""Batch workers placed by Ray: one task per GPU of an existing cluster (`autosoft tune --ray`).

The optional extra `autosoft[ray]`. This is the pattern Kernel Tuner's parallel runner and
vLLM's kernel-tuning scripts use (one `num_gpus=1` worker per GPU, Ray setting
CUDA_VISIBLE_DEVICES), with one difference: the workers do not report to this driver, they
share the batch through the study storage like workers started any other way (batch.py), so a
Ray worker and a worker started by hand on another host can tune one batch together, and the
driver only starts them and draws the progress. The storage must be reachable from every node:
a journal file on a one-node cluster, PostgreSQL across nodes.
"""
from __future__ import annotations

from typing import Any, Callable

from .errors import UserError, one_line

__all__ = ["check_reachable", "run_on_ray"]

CONNECT_TIMEOUT_S = 5.0


def check_reachable(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A one-line UserError when nothing answers at the cluster address (`address`, else
    RAY_ADDRESS) within `timeout_s`: ray.init retried an unreachable address for minutes, printing
    its own warnings. Checks only that the port takes a TCP connection; no address (or "auto"
    and "local") means a cluster found or started on this machine, which is not checked here."""
    import os
    import socket

    given = address or os.environ.get("RAY_ADDRESS", "")
    text = given.strip().removeprefix("ray://")
    if text in ("", "auto", "local"):
        return
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UserError(f"--ray {given}: expected HOST:PORT of the cluster's head (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else \
            (exc.strerror or one_line(exc)).lower()
        raise UserError(f"--ray {given}: no Ray cluster there ({why}); start one with `ray start --head`, "
                        "or give its head's address") from None


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError("--ray needs Ray: pip install 'autosoft[ray]'") from None
    return ray


def _task(spec: Any, run_worker: Callable[..., Any]) -> dict[str, Any]:
    """One worker (batch.run_worker, passed in: this module does not import batch.py, which
    imports it) on the GPU Ray gave this task; what it did."""
    import ray

    gpus = ",".join(str(g) for g in ray.get_gpu_ids())
    summary = run_worker(spec, label=f"ray:{gpus}")
    return {"worker": summary.worker, "owned": summary.owned, "helped": summary.helped, "trials": summary.trials}


def run_on_ray(spec: Any, address: str | None, run_worker: Callable[..., Any], *,
               tick: Callable[[], Any] = lambda: None, gpus: int | None = None) -> list[str]:
    """Start one worker, run_worker(spec, label=...), per GPU of the Ray cluster at `address`
    (None: RAY_ADDRESS, or a local cluster of this machine's GPUs), draw with `tick` about once a
    second until all end.
    `gpus`: how many workers (default: every GPU the cluster has). Returns the workers that
    failed, each as 'ray:<n>: <error>'."""
    ray = _ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001 - Ray's connection errors have many types
            raise UserError(f"--ray {address or ''}: cannot join the cluster ({one_line(exc)[:160]})") from None
    count = gpus if gpus is not None else int(ray.cluster_resources().get("GPU", 0))
    if count < 1:
        raise UserError("--ray: the cluster has no GPU (ray status shows its resources)")
    task = ray.remote(num_gpus=1, max_retries=0)(_task)
    refs = {task.remote(spec, run_worker): n for n in range(count)}
    pending = list(refs)
    failed: list[str] = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a task's error, whatever it was
                failed.append(f"ray:{refs[ref]}: {one_line(exc)[:200]}")
        tick()
    return failed
