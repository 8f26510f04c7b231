"""The launch through libcuda (autosoft/driver.py) on the GPU: the same bits as the launch
through CuPy on every family's examples, the device read alike through both, and a process that
passes torch tensors to every public function with a warm kernel store never imports CuPy."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[1]


def _examples():
    from autosoft.families import families

    return [(name, shape, dtype, dict(options)) for name, family in sorted(families().items())
            for shape, dtype, options in family.examples]


def test_the_driver_reads_the_device_as_cupy_does():
    from autosoft import driver
    from autosoft.runtime import cupy_module

    cp = cupy_module()
    for index in range(cp.cuda.runtime.getDeviceCount()):
        props = cp.cuda.runtime.getDeviceProperties(index)
        mine = driver.device_properties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        assert (mine["name"], mine["major"], mine["minor"], mine["sm_count"], mine["smem_optin"], mine["l2_bytes"]) == \
            (name, props["major"], props["minor"], props["multiProcessorCount"], props["sharedMemPerBlockOptin"],
             props["l2CacheSize"])


@pytest.mark.parametrize("name, shape, dtype, options", _examples(), ids=lambda v: str(v).replace(" ", ""))
def test_the_driver_launch_gives_the_bits_of_the_cupy_launch(cache_dir, name, shape, dtype, options):
    """Each family's examples, default variant: the same inputs through a LoadedVariant of each
    driver (libcuda, CuPy), outputs compared bit for bit. The examples hold cooperative
    splits with workspaces, clusters and large dynamic shared memory, which each must set up. A
    family with a `deterministic` option is asked for it: its other variants add partial results in
    whatever order the blocks come, so two runs through one driver differ in the last bits too."""
    from autosoft import driver
    from autosoft.evaluate import allocate_outputs
    from autosoft.families import get_family
    from autosoft.families.base import build_variant
    from autosoft.kernel_store import default_store
    from autosoft.runtime import LoadedVariant, cupy_driver, cupy_module, device_info

    cp = cupy_module()
    family = get_family(name)
    target = device_info().target
    if any(option.name == "deterministic" for option in family.options):
        options = {**options, "deterministic": True}
    problem = family.problem(shape, dtype, options)
    variant = build_variant(family, problem, family.default_params(problem, target), target)
    cubin = default_store().get_or_compile(variant)
    through = {"libcuda": LoadedVariant(variant, cubin, driver.libcuda()),
               "cupy": LoadedVariant(variant, cubin, cupy_driver())}
    inputs = family.make_inputs(problem, family.input_kinds[0], cp, cp.random.default_rng(5))
    results = {}
    for label, loaded in through.items():
        outputs = allocate_outputs(family, variant, cp)
        for _ in range(2):  # twice: a workspace's counters must be left as they were found
            loaded.launch({**inputs, **outputs})
        cp.cuda.runtime.deviceSynchronize()
        results[label] = {k: cp.asnumpy(v).tobytes() for k, v in outputs.items()}
    assert results["libcuda"] == results["cupy"]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=REPO)


# every public function with torch tensors; a name of autosoft.__all__ not called here fails the test
_EVERY_FUNCTION = textwrap.dedent("""
    import json, sys
    import torch
    import autosoft

    before = set(sys.modules)  # what torch itself imported
    dev = "cuda"
    x = torch.randn(64, 1000, device=dev)
    q, k, v = (torch.randn(1, 2, 100, 64, device=dev, dtype=torch.float16) for _ in range(3))
    logits = torch.randn(16, 1000, device=dev)
    target = torch.randint(0, 1000, (16,), device=dev)
    hidden = torch.randn(16, 64, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(1000, 64, device=dev, dtype=torch.bfloat16)
    router = torch.randn(33, 160, device=dev)
    k_cache, v_cache = (torch.randn(9, 16, 2, 64, device=dev, dtype=torch.float16) for _ in range(2))
    table = torch.arange(8, device=dev, dtype=torch.int32).reshape(2, 4)
    lengths = torch.tensor([5, 40], device=dev, dtype=torch.int32)
    q_decode = torch.randn(2, 1, 4, 64, device=dev, dtype=torch.float16)
    packed = torch.randn(30, 2, 64, device=dev, dtype=torch.float16)
    offsets = torch.tensor([0, 10, 30], device=dev, dtype=torch.int32)
    o, lse = autosoft.attention(q, k, v, causal=True, return_lse=True)
    calls = {
        "softmax": lambda: autosoft.softmax(x),
        "log_softmax": lambda: autosoft.log_softmax(x, dim=0),
        "attention": lambda: autosoft.attention(q, k, v, causal=True, return_lse=True),
        "attention_colsum": lambda: autosoft.attention_colsum(q, k, v, 50),
        "attention_backward": lambda: autosoft.attention_backward(q, k, v, o, torch.randn_like(o), lse, causal=True),
        "attention_kvcache": lambda: autosoft.attention_kvcache(q_decode, k_cache, v_cache, lengths, table),
        "attention_varlen": lambda: autosoft.attention_varlen(packed, packed, packed, offsets, offsets, 20, 20),
        "topk_softmax": lambda: autosoft.topk_softmax(router, 6),
        "cross_entropy": lambda: autosoft.cross_entropy(logits, target),
        "linear_cross_entropy": lambda: autosoft.linear_cross_entropy(hidden, weight, target),
    }
    functions = [n for n in autosoft.__all__ if callable(getattr(autosoft, n)) and n not in
                 ("load_cache", "UserError", "NoDeviceError")]
    with torch.no_grad():
        for name in calls:
            calls[name]()
    torch.cuda.synchronize()
    ours = set(sys.modules) - before
    print(json.dumps({"cupy": "cupy" in sys.modules, "uncalled": sorted(set(functions) - set(calls)),
                      "nvrtc": sorted(m for m in ours if m.endswith("nvrtc")),
                      "bindings": sorted(m for m in ours if m.startswith("cuda.bindings.driver"))}))
""")


def test_a_torch_process_with_a_warm_store_never_imports_cupy(tmp_path):
    """The first process fills the kernel store (compiling and verifying may import CuPy); a fresh
    one then calls every public function on torch tensors: no CuPy, no NVRTC, no binding of the
    driver, and the same results."""
    pytest.importorskip("torch")
    env = dict(os.environ, AUTOSOFT_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("AUTOSOFT_KERNEL_STORE", None)
    cold = _run(_EVERY_FUNCTION, env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    warm = _run(_EVERY_FUNCTION, env)
    assert warm.returncode == 0, warm.stderr[-3000:]
    import json

    result = json.loads(warm.stdout.strip().splitlines()[-1])
    assert result["uncalled"] == [], f"public functions this test does not call yet: {result['uncalled']}"
    assert result["cupy"] is False, "a warm store's torch process imported CuPy"
    assert result["nvrtc"] == [], "a warm store's process loaded NVRTC (its version is recorded beside the store)"
    assert result["bindings"] == [], "the launch goes through libcuda itself, not cuda-bindings"


def test_torch_tensors_on_a_thread_without_a_current_context():
    """A thread torch has not used yet: the launch finds no context current and is made from the
    device's primary context."""
    torch = pytest.importorskip("torch")
    import threading

    import autosoft

    x = torch.randn(32, 513, device="cuda")
    expected = torch.softmax(x, dim=-1)
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("y", autosoft.softmax(x)))
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    torch.testing.assert_close(out["y"], expected)
