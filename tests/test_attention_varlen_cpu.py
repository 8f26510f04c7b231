"""CPU tier for attention over packed sequences: the bucket a call is, the inputs (lengths at the
edges) and the check against an attention written here independently in NumPy; the default
kernels compile."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autosoft.dtypes import to_float64, to_storage
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant

FAMILY = get_family("attention_varlen")
CASE = ("4,4,40,64", "float16", {"kv_heads": 2, "kv_len": 57, "causal": True, "window_left": 30})


def _attend(problem, inputs):
    """o (total_q, Hq, D) and lse (total_q, Hq) in float64, query by query, sequence by sequence."""
    _, h, _, d = problem.shape
    kv_heads = int(problem.option("kv_heads", h))
    left = problem.option("window_left")
    q, k, v = (to_float64(inputs[n], problem.dtype, np) for n in ("q", "k", "v"))
    cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
    o, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for s in range(len(cu_q) - 1):
        nq, nk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(nq):
            pos = nk - nq + i
            seen = [t for t in range(nk) if t <= pos and (left is None or t >= pos - int(left))]
            for head in range(h):
                row = cu_q[s] + i
                if not seen:
                    o[row, head], lse[row, head] = 0.0, -math.inf
                    continue
                kv = head // (h // kv_heads)
                scores = np.array([float(inputs["scale"]) * q[row, head] @ k[cu_k[s] + t, kv] for t in seen])
                weights = np.exp(scores - scores.max())
                o[row, head] = weights @ np.stack([v[cu_k[s] + t, kv] for t in seen]) / weights.sum()
                lse[row, head] = scores.max() + math.log(weights.sum())
    return o, lse


def test_the_check_passes_the_right_answer_and_names_the_wrong_sequence():
    problem = FAMILY.problem(*CASE)
    inputs = FAMILY.make_inputs(problem, "normal_x10", np, np.random.default_rng(5))
    queries, keys = np.diff(inputs["cu_seqlens_q"]), np.diff(inputs["cu_seqlens_k"])
    assert queries[:2].tolist() == [1, 40] and keys[:2].tolist() == [57, 1], "the edges come first"
    o, lse = _attend(problem, inputs)
    outputs = {"o": to_storage(o.astype(np.float32), "float16", np), "lse": lse.astype(np.float32)}
    assert FAMILY.check(problem, inputs, outputs, np) is None
    outputs["o"][int(inputs["cu_seqlens_q"][2]), 1] += 1
    wrong = FAMILY.check(problem, inputs, outputs, np)
    assert wrong is not None and wrong.startswith("sequence 2 (")


def test_a_call_s_arrays_and_bounds_give_its_bucket():
    shapes = {"q": (70, 8, 128), "k": (90, 2, 128), "v": (90, 2, 128), "cu_seqlens_q": (4,), "cu_seqlens_k": (4,)}
    problem = FAMILY.problem_for(shapes, "bfloat16", {"causal": True, "max_seqlen_q": 64, "max_seqlen_k": 80})
    assert problem == FAMILY.problem("3,8,64,128", "bfloat16", {"kv_heads": 2, "kv_len": 80, "causal": True})
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        FAMILY.problem_for({**shapes, "cu_seqlens_k": (5,)}, "bfloat16", {"max_seqlen_q": 64, "max_seqlen_k": 80})
    with pytest.raises(ValueError, match="multiple of k.s and v.s 3"):
        FAMILY.problem_for({**shapes, "k": (90, 3, 128), "v": (90, 3, 128)}, "bfloat16",
                           {"max_seqlen_q": 64, "max_seqlen_k": 80})


def test_the_function_refuses_bad_bounds_before_any_gpu_work():
    import autosoft

    torch = pytest.importorskip("torch")
    q = torch.zeros(10, 4, 64, dtype=torch.float16)
    offsets = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= 1"):
        autosoft.attention_varlen(q, q, q, offsets, offsets, 0, 6)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        autosoft.attention_varlen(q, q, q, offsets, offsets, 6, 6.5)
    with pytest.raises(TypeError, match="CPU tensor"):
        autosoft.attention_varlen(q, q, q, offsets, offsets, 6, 6)


@pytest.mark.parametrize("arch", ["80", "90"])
def test_default_kernels_compile(arch):
    from autosoft.compile import compile_source

    target = Target.for_arch(arch)
    problem = FAMILY.problem(*CASE)
    variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
    assert "if (m0 >= ROWS) return;" in variant.source
    result = compile_source(variant.source, target.arch)
    assert result.ok, result.log[:2000]


# --- the wgmma engine (sm_90a) -----------------------------------------------------------------

SM90 = Target.for_arch("90")


@pytest.mark.parametrize("shape, opts", [
    ("4,8,1000,64", {"kv_heads": 2, "causal": True}), ("4,8,1000,128", {"kv_heads": 2}),
    ("3,16,2048,128", {"kv_heads": 4, "causal": True, "window_left": 100, "softcap": 30.0}),
    ("3,16,2000,64", {"kv_len": 3000}), ("4,8,1000,128", {"causal": True, "persistent": False})])
def test_the_wgmma_kernel_is_the_sm90_default_and_compiles(shape, opts):
    from autosoft.compile import compile_source

    persistent = opts.pop("persistent", None)
    problem = FAMILY.problem(shape, "bfloat16", opts)
    params = FAMILY.default_params(problem, SM90)
    assert params["engine"] == "wgmma"
    if persistent is not None:  # one block per tile
        params.update(persistent=persistent, queue=False)
    variant = build_variant(FAMILY, problem, params, SM90)
    # each tile's sequence from the offsets, 3-D boxes at its first token, rows stored per token
    for line in ("tl.q_first = cu_seqlens_q[seq];", "c * 64, tl.hq, tl.q_first + tl.m0);",
                 "if (tile_first >= tiles_total) {", "lse[((long long)tl.q_first + qi) * HQ + tl.hq]"):
        assert line in variant.source, line
    (launch,) = variant.launches
    tiles = (-(-problem.shape[2] // params["block_m"]), problem.shape[1], problem.shape[0])
    resident = SM90.sm_count * params["blocks_per_sm"]
    assert launch.grid == ((min(np.prod(tiles), resident), 1, 1) if params["persistent"] else tiles)
    assert launch.args[3:8] == ("o", "lse", "scale", problem.shape[1], problem.shape[0])
    assert launch.args[8:10] == ("cu_seqlens_q", "cu_seqlens_k")
    assert (launch.args[-1] == "workspace") == bool(params["queue"]) == ("causal" in opts and persistent is None)
    result = compile_source(variant.source, "90")
    assert result.ok, result.log[:2000]


def test_the_tuner_tries_both_engines_and_the_mma_kernel_serves_other_gpus():
    problem = FAMILY.problem("4,8,1000,128", "bfloat16", {"kv_heads": 2, "causal": True})
    engines = [p["engine"] for p in FAMILY.seed_params(problem, SM90)]
    assert engines[0] == "wgmma" and "mma" in engines
    schedules = [p.get("persistent") for p in FAMILY.seed_params(problem, SM90) if p["engine"] == "wgmma"]
    assert True in schedules and False in schedules, "persistent blocks and one block per tile"
    assert FAMILY.default_params(problem, Target.for_arch("80"))["engine"] == "mma"


class _Encoder:
    """libcuda's cuTensorMapEncodeTiled stood in for: records each map's dims, strides and box."""

    def __init__(self):
        self.calls = []

    @property
    def cuTensorMapEncodeTiled(self):  # noqa: N802 - the driver's name
        import ctypes

        def encode(out, dtype, rank, address, dims, strides, box, ones, interleave, swizzle, l2, oob):
            self.calls.append({"address": address.value, "dims": list(dims), "strides": list(strides),
                               "box": list(box)})
            ctypes.memmove(out.value, bytes(128), 128)
            return 0
        return encode


def _box(flat, call, coords, itemsize):
    """What the tensor-memory accelerator loads from `flat` (the array's elements in memory order)
    for a map as encoded (dims and byte strides innermost first) at box `coords`: zeros past an
    edge, the box's innermost dimension contiguous."""
    dims, box = call["dims"], call["box"]
    steps = [1] + [s // itemsize for s in call["strides"]]
    out = np.zeros(box[::-1], dtype=flat.dtype)
    for index in np.ndindex(*box[::-1]):
        at = [c + i for c, i in zip(coords, index[::-1])]
        if all(0 <= a < n for a, n in zip(at, dims)):
            out[index] = flat[sum(a * s for a, s in zip(at, steps))]
    return out


def test_packed_tensor_maps_box_a_head_s_rows_from_a_sequence_s_first_token(monkeypatch):
    """The maps the runtime encodes for a call over fewer tokens than the bucket holds, and the
    boxes the kernel asks for (column chunk, head, the sequence's first token + the tile's row):
    each is the packed array's rows of that head, the next sequence's past its end, zeros past the
    call's tokens (never the bucket's)."""
    from autosoft import runtime
    from autosoft.families.attention_varlen import packed_maps

    fake = _Encoder()
    monkeypatch.setattr(runtime._libcuda_driver, "cu", lambda: fake)
    problem = FAMILY.problem("3,4,100,128", "float16", {"kv_heads": 2, "kv_len": 150, "causal": True})
    q_map, k_map, _ = packed_maps(problem, 2, 150, 64, 32)
    lengths_q, lengths_k = [30, 100, 70], [150, 3, 90]
    cu_q, cu_k = np.cumsum([0, *lengths_q]), np.cumsum([0, *lengths_k])
    rng = np.random.default_rng(1)
    q = rng.integers(1, 1000, (cu_q[-1], 4, 128)).astype(np.int16)
    k = rng.integers(1, 1000, (cu_k[-1], 2, 128)).astype(np.int16)
    runtime.encode_tensor_map(q_map, 4096, None, rows=q.shape[0])
    runtime.encode_tensor_map(k_map, 8192, None, rows=k.shape[0])
    q_call, k_call = fake.calls
    assert q_call["dims"] == [128, 4, 200] and q_call["box"] == [64, 1, 64], "the call's tokens, not the bucket's 300"
    for b, m0, head, c in ((0, 0, 3, 1), (1, 64, 2, 0), (2, 0, 1, 1)):  # the last: 64 rows past 130 of 200
        got = _box(q.ravel(), q_call, (c * 64, head, cu_q[b] + m0), 2)
        rows = q[cu_q[b] + m0:cu_q[b] + m0 + 64, head, c * 64:c * 64 + 64]
        assert np.array_equal(got[:len(rows), 0], rows) and not got[len(rows):].any()
    for b, key0, kv_head in ((0, 128, 1), (1, 0, 0), (2, 64, 1)):
        got = _box(k.ravel(), k_call, (0, kv_head, cu_k[b] + key0), 2)
        rows = k[cu_k[b] + key0:cu_k[b] + key0 + 32, kv_head, :64]
        assert np.array_equal(got[:len(rows), 0], rows) and not got[len(rows):].any()


def test_a_launch_encodes_packed_maps_over_the_call_s_own_rows(monkeypatch):
    from autosoft import runtime
    from autosoft.runtime import LoadedVariant
    from test_driver import RecordingDriver

    fake = _Encoder()
    monkeypatch.setattr(runtime._libcuda_driver, "cu", lambda: fake)
    problem = FAMILY.problem("4,8,1000,128", "bfloat16", {"kv_heads": 2, "causal": True})
    variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, SM90), SM90)
    driver = RecordingDriver()
    driver.sizes["attention_fwd"] = [128 if not isinstance(a, (str, np.generic)) else 8 if isinstance(a, str)
                                     else a.itemsize for a in variant.launches[0].args]
    loaded = LoadedVariant(variant, b"cubin", driver)
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "o", "lse", "scale", "q_rows", "k_rows", "v_rows")
    launch = loaded.launcher(names, ("scale", "q_rows", "k_rows", "v_rows"))
    for rows_q, rows_k in ((2500, 3100), (700, 40)):
        launch(0x10000, 0x20000, 0x30000, 0x100, 0x200, 0x40000, 0x50000, np.float32(0.1),
               np.int64(rows_q), np.int64(rows_k), np.int64(rows_k), 7)
    assert [c["dims"][-1] for c in fake.calls] == [2500, 3100, 3100, 700, 40, 40], "re-encoded for new lengths"
    assert fake.calls[1]["dims"] == [128, 2, 3100] and fake.calls[1]["strides"] == [128 * 2, 2 * 128 * 2]
    with pytest.raises(KeyError, match="q_rows"):
        loaded.launcher(names[:8], ("scale",))


def test_a_queue_block_without_a_tile_still_counts_itself_out():
    """The grid covers the longest sequence's tiles in every sequence, so a batch of short ones
    leaves blocks with no tile. Under the queue the last block to count itself out resets the
    counter for the next launch: a block that left without counting kept it from ever reaching the
    grid, so later launches on the same workspace skipped tiles (their rows never written)."""
    import re

    problem = FAMILY.problem("4,8,1000,128", "bfloat16", {"kv_heads": 2, "causal": True})
    params = FAMILY.default_params(problem, SM90)
    assert params["engine"] == "wgmma" and params["queue"]
    source = build_variant(FAMILY, problem, params, SM90).source
    idle = re.search(r"if \(tile_first >= tiles_total\) (\{.*?\n  \}|return;)", source, re.S)
    assert idle, "no exit for a block without a tile"
    assert "atomicAdd(queue + 1, 1) == (int)gridDim.x - 1" in idle.group(1) and "return;" in idle.group(1)
    counted_out = source.count("atomicAdd(queue + 1, 1)")
    assert counted_out == 2, "the idle exit and the producer's end each count a block out"
    # without a queue no block has anything to count
    plain = build_variant(FAMILY, problem, {**params, "queue": False}, SM90).source
    assert "queue" not in re.search(r"if \(tile_first >= tiles_total\) (\{.*?\n  \}|return;)", plain, re.S).group(1)
