"""runtime.LoadedVariant over a DriverBackend, and autosoft/driver.py, without a GPU: what a launch
hands the driver (each address in its kernel parameter, the geometry, the stream), what a load sets,
which failures are retried from the variant's device, where workspaces come from; and that the
torch path from a warm kernel store to the driver imports no CuPy."""
from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from autosoft.families.base import Launch, Problem, Target, Variant
from autosoft.runtime import LoadedVariant

REPO = Path(__file__).resolve().parents[1]


class RecordingDriver:
    """A DriverBackend that keeps what LoadedVariant asks of it. Like libcuda, its launch
    returns a status (launch_ok or a failure) instead of raising; a launch made while a device
    other than `works_on` is current fails. Each launch reads the kernel's parameters back through
    the params address it was given, as the driver does."""

    name = "recording"
    error = None  # it never raises: a failure is a returned status
    launch_ok = ("ok",)

    def __init__(self, current: int = 0, works_on: int = 0) -> None:
        self.now, self.works_on = current, works_on
        self.attributes: list[tuple] = []
        self.launches: list[dict] = []
        self.allocations: list[int] = []
        self.held: list = []
        self.sizes: dict[str, list[int]] = {}

    def load(self, cubin: bytes, device: int) -> dict:
        return {"cubin": cubin, "device": device}

    def function(self, module: dict, kernel: str) -> tuple[str, int]:
        return kernel, 1000 + len(kernel)

    def set_attribute(self, function: str, attribute: int, value: int) -> None:
        self.attributes.append((function, attribute, value))

    def failed(self, call: str, status: tuple) -> Exception:
        return RuntimeError(f"{call}: {status[0]}")

    def _record(self, kind: str, function: str, geometry: tuple, stream: int, params: int) -> None:
        sizes = self.sizes[function]
        pointers = (ctypes.c_void_p * len(sizes)).from_address(params)
        values = [int.from_bytes(ctypes.string_at(pointers[i], size), "little") for i, size in enumerate(sizes)]
        self.launches.append(dict(kind=kind, function=function, geometry=geometry, stream=stream, values=values,
                                  device=self.now))

    def launch_kernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self._record("plain", function, (gx, gy, gz, bx, by, bz, smem), stream, params)
        return self.launch_ok if self.now == self.works_on else ("CUDA_ERROR_INVALID_CONTEXT",)

    def bound_launch(self, function, geometry, params):
        return lambda stream: self.launch_kernel(function, *geometry, stream, params, 0)

    def launch_cooperative(self, function, gx, gy, gz, bx, by, bz, smem, stream, params) -> None:
        self._record("cooperative", function, (gx, gy, gz, bx, by, bz, smem), stream, params)

    def current_device(self) -> int:
        return self.now

    def is_current(self, device: int) -> bool:
        return self.now == device

    @contextlib.contextmanager
    def on_device(self, device: int):
        before, self.now = self.now, device
        try:
            yield
        finally:
            self.now = before

    def zeros(self, nbytes: int, device: int) -> tuple:
        buffer = ctypes.create_string_buffer(nbytes)
        self.allocations.append(nbytes)
        self.held.append(buffer)
        return buffer, ctypes.addressof(buffer)


def _variant(*launches: Launch, workspace_bytes: int = 0) -> Variant:
    return Variant("softmax", Problem("softmax", "float32", (4, 8)), Target.for_arch("90"), {}, "hand_made", "",
                   launches, workspace_bytes)


def _loaded(driver: RecordingDriver, *launches: Launch, workspace_bytes: int = 0) -> LoadedVariant:
    for launch in launches:  # the size of each parameter, for reading them back
        driver.sizes[launch.kernel] = [8 if isinstance(a, str) else np.dtype(type(a)).itemsize for a in launch.args]
    return LoadedVariant(_variant(*launches, workspace_bytes=workspace_bytes), b"cubin", driver)


def test_a_launch_writes_each_address_into_its_own_parameter():
    driver = RecordingDriver()
    # the kernel takes y before x: the launcher's order (x, y) must not leak into the parameters
    loaded = _loaded(driver, Launch("rows", (5, 1, 1), (256, 1, 1), 0, ("y", "x", np.int64(-7), np.float32(0.5))))
    launch = loaded.launcher(("x", "y"))
    launch(0x1000, 0x2000, 55)
    launch(0x3000, 0x4000, 66)
    first, second = driver.launches
    assert first["function"] == "rows" and first["geometry"] == (5, 1, 1, 256, 1, 1, 0) and first["stream"] == 55
    assert first["values"][:2] == [0x2000, 0x1000] and second["values"][:2] == [0x4000, 0x3000]
    assert np.int64(first["values"][2] - (1 << 64)) == -7  # a literal keeps its type and value
    assert np.frombuffer(first["values"][3].to_bytes(4, "little"), np.float32)[0] == np.float32(0.5)
    assert launch.native.function == 1000 + len("rows")  # what autosoft.native replays: the function's address


def test_scalars_by_name_reach_their_parameters():
    driver = RecordingDriver()
    loaded = _loaded(driver, Launch("attn", (1, 1, 1), (128, 1, 1), 0, ("q", "o", "scale")))
    loaded.launcher(("q", "o", "scale"), ("scale",))(0x100, 0x200, np.float32(0.125), 9)
    (launch,) = driver.launches
    assert launch["values"][:2] == [0x100, 0x200] and launch["stream"] == 9
    assert np.frombuffer(launch["values"][2].to_bytes(8, "little")[:4], np.float32)[0] == np.float32(0.125)


def test_loading_asks_for_large_shared_memory_and_large_clusters_once():
    driver = RecordingDriver()
    loaded = _loaded(driver, Launch("big", (1, 1, 1), (128, 1, 1), 100 * 1024, ("x", "y"), cluster_blocks=16),
                     Launch("small", (1, 1, 1), (128, 1, 1), 0, ("x", "y")))
    assert driver.attributes == [("big", 8, 100 * 1024), ("big", 14, 1)]
    loaded.launcher(("x", "y"))(1, 2, 0)
    assert driver.attributes == [("big", 8, 100 * 1024), ("big", 14, 1)], "nothing set again per launch"
    assert [l["function"] for l in driver.launches] == ["big", "small"]


def test_a_failed_launch_from_another_device_is_retried_on_the_variants_device():
    driver = RecordingDriver(current=0, works_on=0)
    launch = _loaded(driver, Launch("rows", (1, 1, 1), (32, 1, 1), 0, ("x", "y"))).launcher(("x", "y"))
    driver.now = 1  # the caller's thread has moved to another GPU
    launch(0x10, 0x20, 3)
    assert [(l["device"], l["values"][:2]) for l in driver.launches] == [(1, [0x10, 0x20]), (0, [0x10, 0x20])]
    assert driver.now == 1, "the caller's device is given back"


def test_a_failed_launch_on_the_variants_device_raises_the_drivers_error():
    driver = RecordingDriver(current=0, works_on=2)  # fails wherever it runs
    launch = _loaded(driver, Launch("rows", (1, 1, 1), (32, 1, 1), 0, ("x", "y"))).launcher(("x", "y"))
    with pytest.raises(RuntimeError, match="cuLaunchKernel: CUDA_ERROR_INVALID_CONTEXT"):
        launch(1, 2, 0)
    assert len(driver.launches) == 1, "no retry where the variant's device was current"


def test_workspaces_come_from_the_driver_once_per_stream_and_cooperative_launches_stay_cooperative():
    driver = RecordingDriver()
    loaded = _loaded(driver, Launch("partials", (4, 1, 1), (64, 1, 1), 0, ("x", "workspace"), cooperative=True),
                     Launch("finish", (4, 1, 1), (64, 1, 1), 0, ("x", "y", "workspace")), workspace_bytes=96)
    launch = loaded.launcher(("x", "y"))
    launch(0x100, 0x200, 1)
    launch(0x300, 0x400, 1)
    launch(0x500, 0x600, 2)
    assert [l["kind"] for l in driver.launches[:2]] == ["cooperative", "plain"]
    assert driver.allocations == [96, 96], "one zeroed workspace per stream"
    on_stream = {}
    for l in driver.launches:
        workspace = l["values"][1] if l["function"] == "partials" else l["values"][2]
        on_stream.setdefault(l["stream"], set()).add(workspace)
    assert len(on_stream[1]) == 1 and len(on_stream[2]) == 1 and on_stream[1] != on_stream[2]
    assert {ctypes.addressof(b) for b in driver.held} == on_stream[1] | on_stream[2]


def test_the_torch_path_from_a_warm_store_to_the_driver_imports_no_cupy(tmp_path):
    """Choose, render, digest (the local NVRTC's version), read a warm store's cubin, load through
    libcuda: none of it imports CuPy. The load itself fails here without a GPU (and on a GPU
    on the made-up cubin): it is the import structure that is checked."""
    script = textwrap.dedent(f"""
        import sys
        from autosoft import arrays, dispatch, runtime
        from autosoft.errors import NoDeviceError
        from autosoft.driver import DriverError
        from autosoft.families import get_family
        from autosoft.families.base import Target, build_variant
        from autosoft.kernel_store import KernelStore
        family = get_family("softmax")
        problem = family.problem("4096x8192", "float32")
        target = Target.for_arch("90")
        variant = build_variant(family, problem, family.default_params(problem, target), target)
        store = KernelStore({str(tmp_path / "kernels")!r})
        store.put(variant.digest, b"a stored cubin")
        assert store.get_or_compile(variant) == b"a stored cubin" and store.stats().compiles == 0
        try:
            runtime.load_for_torch(variant, b"a stored cubin")
        except (NoDeviceError, DriverError) as exc:
            print("load refused:", type(exc).__name__)
        print("cupy imported:", "cupy" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**_env(), "PYTHONPATH": os.pathsep.join(
                                    filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))})
    assert result.returncode == 0, result.stderr
    assert "cupy imported: False" in result.stdout, result.stdout


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
