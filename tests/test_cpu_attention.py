"""The extension's CPU attention (runtime/cpu/attention.cpp) against
PyTorch's scaled_dot_product_attention, the route that picks it, and how the
extension is built, opted out of and remembered (runtime/cpu/extension.py)."""

import dataclasses
import functools
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
import torch

from llm_executorch_mlx.runtime import cpu
from llm_executorch_mlx.runtime.cpu import extension, extension_ops
from llm_executorch_mlx.runtime.kv_storage import storage
from llm_executorch_mlx.runtime.plan import Plan
from llm_executorch_mlx.runtime.quantized_kv import QuantizedKV


@pytest.fixture(scope="module")
def kernels():
    found = cpu.kernels(build=True)
    # The suite runs where the `test` extra put nanobind and a C++ compiler
    # exists: the kernel must build there, or the CPU speed claims are void.
    assert found.attention.on, found.attention.why
    return found


@pytest.fixture(scope="module")
def kernel(kernels):
    return kernels.extension


def torch_attention(q, k, v, scale, causal, window=0):
    q, k, v = (torch.from_numpy(np.array(x)) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    T, S = q.shape[2], k.shape[2]
    # query t's last key: the T queries are the last T of the S positions
    last = torch.arange(S - T, S)[:, None] if causal else torch.full((T, 1), S - 1)
    mask = None
    if causal or window:
        mask = torch.arange(S)[None, :] <= last
        if window:  # and only the `window` keys up to it
            mask &= torch.arange(S)[None, :] > last - window
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).numpy()


def pools(rng, B, H, S, D, slots):
    """k and v as the cache hands them over: the first S of `slots` rows."""
    k = mx.array(rng.standard_normal((B, H, slots, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, H, slots, D)).astype(np.float32))
    return k[:, :, :S, :], v[:, :, :S, :]


@pytest.mark.parametrize(
    "B, Hq, Hkv, T, S, D, causal",
    [
        (1, 9, 3, 1, 600, 64, False),  # a SmolLM-shaped decode step
        (1, 32, 8, 1, 300, 128, False),
        (1, 4, 2, 3, 17, 8, True),  # a chunk's tail of three queries
        (2, 6, 6, 4, 9, 24, True),  # batch, no grouping, a D that is not 64 wide
        (1, 2, 1, 1, 5, 12, False),  # D not a multiple of 8: the plain loops
        (1, 4, 4, 2, 2, 16, True),  # as many queries as keys
        (1, 9, 3, 16, 316, 64, True),  # a SmolLM-shaped chat turn's chunk, still row by row
        (1, 4, 2, 8, 8, 16, True),  # a first chunk: as many queries as keys
        # from 64 queries a head: the tiled path (blocks of 6 rows, 16-key panels)
        (1, 9, 3, 128, 512, 64, True),  # a SmolLM-shaped prefill chunk
        (1, 6, 2, 67, 97, 80, True),  # rows and keys that fill no block
        (2, 4, 4, 64, 71, 32, False),  # batch, no grouping, not causal
        (1, 2, 1, 64, 80, 24, True),  # D not a multiple of 16: the row loops
    ],
)
def test_matches_torch(kernel, B, Hq, Hkv, T, S, D, causal):
    rng = np.random.default_rng(S + D)
    q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32) * 2)
    k, v = pools(rng, B, Hkv, S, D, S + 7)
    out = kernel.attention(q, k, v, D**-0.5, causal)
    np.testing.assert_allclose(np.array(out), torch_attention(q, k, v, D**-0.5, causal), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "Hq, Hkv, T, S, D, causal, window",
    [
        (4, 2, 1, 40, 16, False, 16),  # a ring's decode step: the last 16 keys
        (4, 2, 3, 40, 16, True, 7),  # a few queries
        (9, 3, 128, 639, 64, True, 512),  # a prefill chunk of a 512-window layer
        (6, 2, 20, 50, 32, True, 16),  # a chunk's rows, row by row
        (6, 2, 70, 100, 32, True, 16),  # tiled: blocks whose rows start in different panels
        (2, 1, 64, 80, 24, True, 5),  # D not a multiple of 16: the row loops
        (4, 4, 9, 20, 16, True, 40),  # a window wider than the keys: plain causal
        (4, 4, 64, 70, 16, True, 100),  # the same, tiled
    ],
)
def test_sliding_window_matches_torch(kernel, Hq, Hkv, T, S, D, causal, window):
    rng = np.random.default_rng(S + window)
    q = mx.array(rng.standard_normal((1, Hq, T, D)).astype(np.float32) * 2)
    k, v = pools(rng, 1, Hkv, S, D, S + 3)
    out = kernel.attention(q, k, v, D**-0.5, causal, window=window)
    expected = torch_attention(q, k, v, D**-0.5, causal, window)
    np.testing.assert_allclose(np.array(out), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "T, D, causal, window",
    [(1, 32, False, 0), (3, 32, True, 0), (40, 32, True, 0), (40, 32, True, 24), (2, 12, True, 0), (9, 20, True, 0),
     (64, 32, True, 0), (64, 32, True, 24)],  # the last two tiled
)
def test_half_precision_keys_and_values_are_read_as_stored(kernel, dtype, T, D, causal, window):
    # a bf16 or fp16 cache under fp32 compute: the kernel widens K and V as it
    # reads them (vector loads, and the scalar tails of a D that is not a
    # multiple of 8 or 16); the reference attends over the same values
    # widened to fp32
    rng = np.random.default_rng(T + D)
    q = mx.array(rng.standard_normal((1, 6, T, D)).astype(np.float32))
    k, v = (x.astype(dtype) for x in pools(rng, 1, 2, 70, D, 80))
    out = kernel.attention(q, k, v, 0.2, causal, window=window)
    expected = torch_attention(q, k.astype(mx.float32), v.astype(mx.float32), 0.2, causal, window)
    np.testing.assert_allclose(np.array(out), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("T, strided", [(1, False), (64, False), (1, True)])
def test_every_fp16_value_is_widened_exactly(kernel, T, strided):
    # One key: its softmax weight is exactly 1, so each output is the value
    # as the kernel widened it. Every one of the 65,536 fp16 bit patterns
    # (subnormals, infinities, NaNs) against numpy's conversion, through the
    # row loops' and the tiled path's vector loads, and (values strided in
    # their last axis) the scalar one.
    values = np.arange(65536, dtype=np.uint16).view(np.float16).reshape(1, 4096, 1, 16)
    v = mx.array(values.transpose(0, 3, 2, 1).copy()).swapaxes(1, 3) if strided else mx.array(values)
    q, k = mx.zeros((1, 4096, T, 16)), mx.zeros((1, 4096, 1, 16), dtype=mx.float16)
    out = np.array(kernel.attention(q, k, v, 1.0, False))[:, :, -1:, :]
    np.testing.assert_array_equal(out, values.astype(np.float32))  # NaN equals NaN here


def test_queries_as_a_transposed_view(kernel):
    # in the model q arrives as the head split's view, not contiguous
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((1, 3, 6, 32)).astype(np.float32)).swapaxes(1, 2)  # [1, 6, 3, 32]
    k, v = pools(rng, 1, 2, 50, 32, 64)
    out = kernel.attention(q, k, v, 0.2, True)
    np.testing.assert_allclose(np.array(out), torch_attention(q, k, v, 0.2, True), atol=2e-6, rtol=1e-5)


def test_keys_strided_in_their_last_axis(kernel):
    # a transposed view: the kernel's general loops, not the vector ones
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((1, 2, 1, 16)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 16, 11)).astype(np.float32)).swapaxes(2, 3)
    v = mx.array(rng.standard_normal((1, 2, 16, 11)).astype(np.float32)).swapaxes(2, 3)
    out = kernel.attention(q, k, v, 0.3, False)
    np.testing.assert_allclose(np.array(out), torch_attention(q, k, v, 0.3, False), atol=2e-6, rtol=1e-5)


def test_large_scores_do_not_overflow(kernel):
    # scores of +-1e4 after scaling: the softmax must subtract the row max
    q = mx.full((1, 1, 1, 8), 100.0)
    k = mx.concatenate([mx.full((1, 1, 1, 8), 12.5), mx.full((1, 1, 1, 8), -12.5)], axis=2)
    v = mx.array(np.arange(16, dtype=np.float32).reshape(1, 1, 2, 8))
    out = kernel.attention(q, k, v, 1.0, False)
    np.testing.assert_allclose(np.array(out)[0, 0, 0], np.arange(8, dtype=np.float32), atol=1e-6)


def test_bad_inputs_are_refused_with_the_reason(kernel):
    q = mx.zeros((1, 3, 1, 8))
    k = v = mx.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="incompatible shapes"):
        kernel.attention(q, k, v, 1.0)
    with pytest.raises(ValueError, match="float32"):
        kernel.attention(q.astype(mx.bfloat16), k, v, 1.0)
    with pytest.raises(ValueError, match="both float32, bfloat16 or float16"):
        kernel.attention(q, k.astype(mx.int32), v.astype(mx.int32), 1.0)
    with pytest.raises(ValueError, match="both float32, bfloat16 or float16"):
        kernel.attention(q, k.astype(mx.float16), v.astype(mx.bfloat16), 1.0)
    with pytest.raises(ValueError, match="no keys"):
        kernel.attention(mx.zeros((1, 2, 1, 8)), k[:, :, :0], v[:, :, :0], 1.0)
    with pytest.raises(ValueError, match="window must be 0"):
        kernel.attention(mx.zeros((1, 2, 1, 8)), k, v, 1.0, window=-1)


@pytest.mark.parametrize("q_shape, message", [
    ((1, 3, 1, 16), r"^\[reshape\]"),  # 3 query heads over 2 key heads
    ((1, 4, 1, 8), r"^\[matmul\]"),  # another head size
])
def test_a_query_the_kernel_would_refuse_meets_mlx_s_own_checks(kernels, kernel, monkeypatch, q_shape, message):
    """A corrupt program's query that does not fit the cache's keys never
    reaches the kernel, whose refusal would not name the node: MLX's ops say
    what is wrong."""
    monkeypatch.setattr(kernel, "attention", lambda *args, **kwargs: pytest.fail("the kernel was called"))
    k, v = pools(np.random.default_rng(3), 1, 2, 40, 16, 64)
    with pytest.raises(ValueError, match=message):
        mx.eval(Plan(True, kernels).cache_attention()(mx.zeros(q_shape), k, v, scale=0.25, mask=None))


def test_route_uses_the_kernel_for_fp32_and_a_known_window(kernels, kernel, monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[2])
        return real(*args, **kwargs)

    real = kernel.attention
    monkeypatch.setattr(kernel, "attention", spy)
    rng = np.random.default_rng(2)
    sdpa = Plan(True, kernels).cache_attention()
    k, v = pools(rng, 1, 2, 40, 16, 64)
    for T, mask in ((1, None), (4, "causal"), (32, "causal")):
        q = mx.array(rng.standard_normal((1, 4, T, 16)).astype(np.float32))
        out = sdpa(q, k, v, scale=0.25, mask=mask)
        np.testing.assert_allclose(np.array(out), torch_attention(q, k, v, 0.25, mask == "causal"),
                                   atol=2e-6, rtol=1e-5)
    assert calls == [1, 4, 32]
    # a band mask (an array) with no window goes to the MLX ops, which apply it
    band = mx.array(np.tril(np.ones((2, 40), bool), 38) & ~np.tril(np.ones((2, 40), bool), 30))[None, None]
    q = mx.array(rng.standard_normal((1, 4, 2, 16)).astype(np.float32))
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(np.array(x)) for x in (q, mx.repeat(k, 2, axis=1), mx.repeat(v, 2, axis=1))),
        attn_mask=torch.from_numpy(np.array(band)), scale=0.25,
    ).numpy()
    np.testing.assert_allclose(np.array(sdpa(q, k, v, scale=0.25, mask=band)), expected, atol=2e-6, rtol=1e-5)
    assert calls == [1, 4, 32]  # the band mask went to the MLX ops
    # and so do half-precision queries (cast to the keys' dtype by MLX's ops)
    out = sdpa(*[x.astype(mx.bfloat16) for x in (q, k, v)], scale=0.25, mask="causal")
    assert out.dtype == mx.bfloat16 and calls == [1, 4, 32]
    # bf16 and fp16 keys under fp32 queries are the kernel's, uncast
    for half in (mx.bfloat16, mx.float16):
        out = sdpa(q, k.astype(half), v.astype(half), scale=0.25, mask="causal")
        np.testing.assert_allclose(np.array(out), torch_attention(q, k.astype(half).astype(mx.float32),
                                                                  v.astype(half).astype(mx.float32), 0.25, True),
                                   atol=2e-6, rtol=1e-5)
    assert calls == [1, 4, 32, 2, 2]
    # a ring layer's route knows its window (8: the band above), so the kernel takes it
    windowed = Plan(True, kernels).cache_attention(window=8)
    np.testing.assert_allclose(np.array(windowed(q, k, v, scale=0.25, mask=band)), expected, atol=2e-6, rtol=1e-5)
    assert calls == [1, 4, 32, 2, 2, 2]


KERNELS = (
    "from llm_executorch_mlx.runtime import cpu; k = cpu.kernels(build=True); "
    "print(k.attention.on, k.products.on, k.extension is not None, k.attention.why)"
)


def test_each_flag_switches_one_thing_off():
    runs = {}
    for flags in ({cpu.ATTENTION_FLAG: "0"}, {cpu.PRODUCTS_FLAG: "0"}, {cpu.ATTENTION_FLAG: "0", cpu.PRODUCTS_FLAG: "0"},
                  {cpu.KERNELS_FLAG: "0"}):
        env = {**os.environ, **flags}
        out = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, check=True)
        runs[tuple(flags)] = out.stdout.strip()
    assert runs[(cpu.ATTENTION_FLAG,)] == f"False True True {cpu.ATTENTION_FLAG}=0"
    assert runs[(cpu.PRODUCTS_FLAG,)].startswith("True False True ")
    # both parts off: the extension stays loaded for RMSNorm and SwiGLU
    assert runs[(cpu.ATTENTION_FLAG, cpu.PRODUCTS_FLAG)] == f"False False True {cpu.ATTENTION_FLAG}=0"
    # no extension at all, as on a machine without a compiler
    assert runs[(cpu.KERNELS_FLAG,)] == f"False False False {cpu.KERNELS_FLAG}=0"


def test_it_is_built_only_when_asked(tmp_path):
    code = (
        "from llm_executorch_mlx.runtime import cpu; k = cpu.kernels(); "
        "print(k.attention.on, k.attention.needs_build, k.products.needs_build)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True True"
    assert "building" not in out.stderr
    assert not list(tmp_path.glob("llm-executorch-mlx/cpu_kernels-*"))


def test_a_failed_build_is_remembered_and_not_retried(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": "false"}
    runs = [subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert "building the CPU kernels" in runs[0].stderr  # tried once
    assert "building the CPU kernels" not in runs[1].stderr  # not again
    assert all(r.stdout.startswith("False False False building it failed") for r in runs)
    assert len(list(tmp_path.glob("llm-executorch-mlx/cpu_kernels-*.failed"))) == 1


def test_a_compiler_refusing_a_vector_flag_builds_the_next_narrower_vectors_once(kernel, tmp_path):
    """A compiler older than the CPU (GCC 10 knows no AMX) refuses the widest
    tier's newest flag: the next tier is built, and later processes go to it
    without asking again. The stand-in compiler refuses that flag as GCC does
    and otherwise hands over the library already built (a real build is ~30 s)."""
    tiers = extension._vector_tiers()
    assert len(tiers) > 1 and tiers[-1] == []  # x86: the CPU's vectors down to the default target
    refused = tiers[0][-1]
    compiler = tmp_path / "old-c++"
    compiler.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = "{refused}" ] && echo "c++: error: unrecognized command-line option '
        f"'$a'\" >&2 && exit 1; done\n"
        'while [ "$1" != "-o" ]; do shift; done\n'
        f'cp "{kernel.__file__}" "$2"\n')
    compiler.chmod(0o755)
    code = ("from llm_executorch_mlx.runtime.cpu import extension, selection; k = selection.kernels(build=True); "
            "print(k.products.on, ' '.join(extension._plan()[4]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CXX": str(compiler)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["True", *tiers[1]]] * 2  # an AVX2-only CPU's next tier is []
    assert runs[0].stderr.count("building the CPU kernels") == 2  # the widest tier, refused, then the next
    assert "building" not in runs[1].stderr
    assert [m.read_text() for m in tmp_path.glob("llm-executorch-mlx/cpu_kernels-*.refused")] == [
        f"the compiler refused {refused}"]


def test_a_failed_marker_does_not_hide_a_built_kernel(kernel, tmp_path):
    # another process may have built it after this one failed
    code = (
        "import pathlib, shutil; from llm_executorch_mlx.runtime import cpu; "
        f"src = pathlib.Path({str(kernel.__file__)!r}); "
        f"dst = pathlib.Path({str(tmp_path)!r}) / 'llm-executorch-mlx' / src.name; dst.parent.mkdir(exist_ok=True); "
        "shutil.copy(src, dst); dst.with_name(dst.name.split('.')[0] + '.failed').write_text('old failure'); "
        "print(cpu.kernels().attention.on)"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    assert "building" not in out.stderr


@pytest.mark.parametrize("available", [True, False])
def test_update_and_attend_matches_the_reference_cache_with_and_without_it(kernels, kernel, monkeypatch,
                                                                           available):
    # the op as a model runs it (test_cache's side-by-side with ExecuTorch's
    # reference cache), routed through the kernels or, without them, MLX ops:
    # a flat layer's step is one update_and_attend, a ring's the attention
    # kernel over what the cache hands it (over a quantized cache: their
    # quantized versions)
    from test_cache import run_side_by_side

    calls = []
    for name in ("attention", "update_and_attend", "quantized_attention", "quantized_update_and_attend"):
        real = getattr(kernel, name)
        monkeypatch.setattr(kernel, name, lambda *a, real=real, name=name, **k: calls.append((name, a[0].shape[2]))
                            or real(*a, **k))
    if not available:
        kernels = dataclasses.replace(kernels, attention=cpu.Use(False, "off for this test"))

    def expected(windows, steps):
        kinds = ["attention" if w else "update_and_attend" for w in windows]
        return [(kind, T) for T in steps for kind in kinds] if available else []

    run = functools.partial(run_side_by_side, plan=Plan(True, kernels))
    run([0], [5, 1, 1, 3, 8])
    assert calls == expected([0], [5, 1, 1, 3, 8])
    # a flat layer and a ring of window 6 past its window (band masks, wraps),
    # then a ring of window 12 taking chunks of 8-10 (row by row) as it wraps
    for windows, steps, max_write in (([0, 6], [5, 1, 1, 3, 6, 1, 6, 2], 6), ([12, 0], [9, 1, 10, 8, 1, 9], 10)):
        calls.clear()
        run(windows, steps, max_write=max_write)
        assert calls == expected(windows, steps)
    # bf16 and fp16 caches under fp32 compute, read as stored
    for dtype in ("bf16", "fp16"):
        calls.clear()
        run([0, 12], [9, 1, 1, 10], dtype=dtype, max_write=10, atol=2e-3)
        assert calls == expected([0, 12], [9, 1, 1, 10])
    # a flat pool that grows by doubling under the op's writes
    calls.clear()
    run([0], [3, 1, 1, 8, 1, 2], initial=2, capacity=20)
    assert calls == expected([0], [3, 1, 1, 8, 1, 2])
    # int8 keys and int4 values: the flat layer's rows quantized in the op
    calls.clear()
    run([0, 12], [9, 1, 1, 10], dtype="int8", value_dtype="int4", max_write=10, atol=2e-5)
    assert calls == [("quantized_" + kind, T) for kind, T in expected([0, 12], [9, 1, 1, 10])]


MX_DTYPES = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}


def data_address(a: mx.array) -> int:
    view = np.asarray(a)
    return view.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("Hq, Hkv, T, D, position", [
    (9, 3, 1, 64, 37),  # a SmolLM-shaped decode step
    (4, 2, 3, 16, 20),  # a chat turn's few queries: causal, row by row
    (6, 2, 13, 32, 5),  # a short chunk: row by row, causal
    (6, 2, 64, 32, 5),  # from 64 queries: the tiled path, causal
    (2, 2, 1, 8, 0),  # the first token: attends to itself alone
    (4, 1, 2, 12, 9),  # D not a multiple of 8: the plain loops
])
def test_update_and_attend_writes_the_step_and_attends_the_history(kernel, dtype, Hq, Hkv, T, D, position):
    rng = np.random.default_rng(T * 100 + D)
    slots = position + T + 6
    history = rng.standard_normal((2, 1, Hkv, slots, D)).astype(np.float32)
    K, V = (mx.array(h).astype(MX_DTYPES[dtype]) for h in history)
    q = mx.array(rng.standard_normal((1, Hq, T, D)).astype(np.float32))
    # keys and values as a projection hands them over: a transposed view
    k, v = (mx.array(rng.standard_normal((1, T, Hkv, D)).astype(np.float32)).transpose(0, 2, 1, 3) for _ in range(2))
    out, K2, V2 = kernel.update_and_attend(q, k, v, K, V, position, D**-0.5)
    # the pools: the history, with the step written at its positions in the
    # storage dtype as MLX's astype rounds it
    want_K = np.array(K.astype(mx.float32)).copy()
    want_V = np.array(V.astype(mx.float32)).copy()
    want_K[:, :, position : position + T] = np.array(k.astype(MX_DTYPES[dtype]).astype(mx.float32))
    want_V[:, :, position : position + T] = np.array(v.astype(MX_DTYPES[dtype]).astype(mx.float32))
    assert K2.dtype == V2.dtype == MX_DTYPES[dtype]
    np.testing.assert_array_equal(np.array(K2.astype(mx.float32)), want_K)
    np.testing.assert_array_equal(np.array(V2.astype(mx.float32)), want_V)
    # the attention: over the first position + T slots, causal for several queries
    end = position + T
    reference = torch_attention(q, want_K[:, :, :end], want_V[:, :, :end], D**-0.5, T > 1)
    np.testing.assert_allclose(np.array(out), reference, atol=2e-6, rtol=1e-5)


def rope_tables(position, T, D, base=10000.0, scale=1.0):
    """RoPE's cos and sin rows for positions position .. position + T as
    the op takes them ([2, T, D/2]), and as transformers' apply_rotary_pos_emb
    takes them ([1, T, D] each, halves repeated)."""
    inv_freq = 1.0 / base ** (np.arange(0, D, 2, dtype=np.float32) / D)
    angles = np.outer(np.arange(position, position + T, dtype=np.float32), inv_freq)
    cos, sin = (np.float32(scale) * f(angles).astype(np.float32) for f in (np.cos, np.sin))
    halves = [torch.from_numpy(np.concatenate([t, t], axis=-1))[None] for t in (cos, sin)]
    return mx.array(np.stack([cos, sin])), halves


def transformers_rotated(x, halves):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t = torch.from_numpy(np.array(x))
    return apply_rotary_pos_emb(t, t, *halves)[0].numpy()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("Hq, Hkv, T, D, position", [
    (9, 3, 1, 64, 37),  # a SmolLM-shaped decode step
    (9, 3, 6, 64, 300),  # a speculative call's six rows
    (6, 2, 64, 32, 5),  # a prefill chunk: the tiled path
    (4, 1, 2, 12, 9),  # D not a multiple of 8
])
def test_update_and_attend_rotates_q_and_k_first_as_transformers_does(kernel, dtype, Hq, Hkv, T, D, position):
    rng = np.random.default_rng(T * 10 + D)
    slots = position + T + 3
    K, V = (mx.array(rng.standard_normal((1, Hkv, slots, D)).astype(np.float32)).astype(MX_DTYPES[dtype])
            for _ in range(2))
    # q, k and v as the projections hand them over: transposed views
    q, k, v = (mx.array(rng.standard_normal((1, T, H, D)).astype(np.float32)).transpose(0, 2, 1, 3)
               for H in (Hq, Hkv, Hkv))
    tables, halves = rope_tables(position, T, D, scale=1.25)
    out, K2, V2 = kernel.update_and_attend(q, k, v, K, V, position, D**-0.5, rope=tables)
    q_rot, k_rot = transformers_rotated(q, halves), transformers_rotated(k, halves)
    want_K = np.array(K.astype(mx.float32)).copy()
    want_K[:, :, position : position + T] = np.array(mx.array(k_rot).astype(MX_DTYPES[dtype]).astype(mx.float32))
    np.testing.assert_array_equal(np.array(K2.astype(mx.float32)), want_K)  # each product rounded, as torch's
    want_V = np.array(V.astype(mx.float32)).copy()
    want_V[:, :, position : position + T] = np.array(v.astype(MX_DTYPES[dtype]).astype(mx.float32))
    np.testing.assert_array_equal(np.array(V2.astype(mx.float32)), want_V)  # values are not rotated
    end = position + T
    reference = torch_attention(q_rot, want_K[:, :, :end], want_V[:, :, :end], D**-0.5, T > 1)
    np.testing.assert_allclose(np.array(out), reference, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 5])
def test_quantized_update_and_attend_rotates_q_and_k_first_as_transformers_does(kernel, T):
    rng = np.random.default_rng(T)
    Hq, Hkv, D, group, position, bits = 9, 3, 64, 32, 20, 8
    K = quantized_layer_pool(rng, Hkv, position + T + 2, D, bits, group)
    V = quantized_layer_pool(rng, Hkv, position + T + 2, D, bits, group)
    q, k, v = (mx.array(rng.standard_normal((1, T, H, D)).astype(np.float32) * 3).transpose(0, 2, 1, 3)
               for H in (Hq, Hkv, Hkv))
    tables, halves = rope_tables(position, T, D)
    y, *pools = kernel.quantized_update_and_attend(q, k, v, *K, *V, position, D**-0.5, bits, bits, group,
                                                   rotated=True, rope=tables)
    k_rot = transformers_rotated(k, halves)
    assert_same_bits(pools, written(K, position, k_rot, bits, group) + written(V, position, v, bits, group))
    assert_close_to_scale(y, history_reference(mx.array(transformers_rotated(q, halves)), pools, bits, bits, group,
                                               position + T))


def test_update_and_attend_refuses_tables_that_are_not_the_step_s(kernel):
    q, k = mx.zeros((1, 4, 2, 8)), mx.zeros((1, 2, 2, 8))
    pool = mx.zeros((1, 2, 6, 8))
    with pytest.raises(ValueError, match=r"RoPE tables must be contiguous float32 \(2,2,4\)"):
        kernel.update_and_attend(q, k, k, pool, pool, 0, 1.0, rope=mx.zeros((2, 1, 4)))
    with pytest.raises(ValueError, match="RoPE tables"):
        kernel.update_and_attend(q, k, k, pool, pool, 0, 1.0, rope=mx.zeros((2, 2, 4), dtype=mx.float16))


def test_update_and_attend_writes_in_place_unless_the_pool_is_held(kernel):
    rng = np.random.default_rng(7)
    K, V = (mx.array(rng.standard_normal((1, 2, 16, 8)).astype(np.float32)) for _ in range(2))
    mx.eval(K, V)
    address = data_address(K)
    for position in range(3):  # a decode loop: each step's pools are the next step's
        q = mx.array(rng.standard_normal((1, 4, 1, 8)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((1, 2, 1, 8)).astype(np.float32)) for _ in range(2))
        out, K, V = kernel.update_and_attend(q, k, v, K, V, position, 0.5)
        mx.eval(out, K, V)
        assert data_address(K) == address  # no copy of the pool per step
    # a pool something else still holds (a saved state's slice) is copied:
    # the holder keeps what it saw
    held = K[:, :, :3]
    before = np.array(held).copy()
    k = mx.ones((1, 2, 1, 8))
    out, K2, _ = kernel.update_and_attend(mx.ones((1, 4, 1, 8)), k, k, K, V, 2, 0.5)
    mx.eval(out, K2)
    np.testing.assert_array_equal(np.array(held), before)
    np.testing.assert_array_equal(np.array(K2)[:, :, 2], np.ones((1, 2, 8)))
    np.testing.assert_array_equal(np.array(K2)[:, :, :2], before[:, :, :2])


def test_update_and_attend_refuses_what_it_cannot_write_with_the_reason(kernel):
    q, k = mx.zeros((1, 4, 1, 8)), mx.zeros((1, 2, 1, 8))
    pool = mx.zeros((1, 2, 4, 8))
    with pytest.raises(ValueError, match="overruns a pool of 4"):
        kernel.update_and_attend(q, k, k, pool, pool, 4, 1.0)
    with pytest.raises(ValueError, match="incompatible shapes"):
        kernel.update_and_attend(mx.zeros((1, 3, 1, 8)), k, k, pool, pool, 0, 1.0)
    with pytest.raises(ValueError, match="incompatible shapes"):
        kernel.update_and_attend(q, k, k, mx.zeros((1, 2, 4, 16)), mx.zeros((1, 2, 4, 16)), 0, 1.0)
    with pytest.raises(ValueError, match="float32"):
        kernel.update_and_attend(q, k.astype(mx.bfloat16), k, pool, pool, 0, 1.0)
    with pytest.raises(ValueError, match="both float32, bfloat16 or float16"):
        kernel.update_and_attend(q, k, k, pool, pool.astype(mx.float16), 0, 1.0)


def test_a_prefill_chunk_shared_with_the_host_is_the_same_bits(kernel):
    """Where a chunk's products are the extension's, the host helps with the
    graph and takes some of the tiled attention's units too; each row stays
    one thread's work in a fixed order, so the result is bit-identical to the
    stream thread alone, and to torch's within the kernel's tolerance."""
    rng = np.random.default_rng(12)
    q = mx.array(rng.standard_normal((1, 9, 128, 64)).astype(np.float32))
    k, v = pools(rng, 1, 3, 512, 64, 520)
    w = mx.array(rng.standard_normal((576, 64)).astype(np.float32))

    def merged(o):  # heads merged, as a layer's output projection reads them
        return o.transpose(0, 2, 1, 3).reshape(1, 128, 576)

    def chunk():  # attention, then a product the host helps with (a shared op)
        return kernel.gemv(merged(kernel.attention(q, k, v, 0.125, True)), w)

    alone = chunk()
    mx.eval(alone)
    helped = chunk()
    kernel.submit_helping([helped])
    kernel.wait_helping(helped)
    np.testing.assert_array_equal(np.array(helped), np.array(alone))
    reference = np.array(merged(mx.array(torch_attention(q, k, v, 0.125, True)))) @ np.array(w)
    np.testing.assert_allclose(np.array(helped), reference, atol=1e-4, rtol=1e-4)


def sylvester(n):
    """The orthonormal Walsh-Hadamard matrix of size n, Sylvester's order:
    H_2n = [[H, H], [H, -H]], over sqrt(n)."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotate_groups(x, group):
    """Each group of `group` values along the last axis times sylvester(group)
    (its own inverse: rotating twice gives x back)."""
    x = np.asarray(x)
    grouped = x.reshape(*x.shape[:-1], -1, group).astype(np.float64)
    return (grouped @ sylvester(group)).reshape(x.shape).astype(np.float32)


def quantized_pool(rng, B, Hkv, S, D, bits, group, slots, start=0, words_strided=False, rotated=False):
    """Keys or values as a quantized cache hands them over: rows start ..
    start + S of a pool of `slots` rows, quantized along D with float16
    scales and biases. words_strided: the words a transposed view (rows not
    contiguous along D). rotated: each group rotated before quantizing, as
    the cache stores it."""
    x = rng.standard_normal((B, Hkv, slots, D)).astype(np.float32)
    data, scales, biases = mx.quantize(mx.array(rotate_groups(x, group) if rotated else x), group_size=group, bits=bits)
    if words_strided:
        data = mx.array(np.ascontiguousarray(np.array(data).swapaxes(2, 3))).swapaxes(2, 3)
    rows = slice(start, start + S)
    return QuantizedKV(data[:, :, rows], scales.astype(mx.float16)[:, :, rows], biases.astype(mx.float16)[:, :, rows],
                       bits, group, rotated)


def quantized_reference(q, K, V, scale, causal, window=0):
    """torch's attention over the dequantized cache; over rotated rows, of the
    queries rotated as the keys, the output rotated back."""
    if not K.rotated:
        return torch_attention(q, K.dequantize(), V.dequantize(), scale, causal, window)
    out = torch_attention(rotate_groups(q, K.group_size), K.dequantize(), V.dequantize(), scale, causal, window)
    return rotate_groups(out, V.group_size)


def assert_close_to_scale(out, expected):
    """Within 1e-5 of the output's scale: dequantized values (q * scale +
    bias, one rounding or two) give the products a little more rounding
    than fp32 keys and values."""
    out = np.asarray(out)
    np.testing.assert_allclose(out, expected, atol=1e-5 * np.nanmax(np.abs(expected)), rtol=1e-5)


def quantized_attention(kernel, q, K, V, causal, window=0):
    return kernel.quantized_attention(q, K.data, K.scales, K.biases, V.data, V.scales, V.biases, q.shape[-1]**-0.5,
                                      causal, K.bits, V.bits, K.group_size, window=window, rotated=K.rotated)


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("k_bits, v_bits", [(8, 8), (8, 4), (4, 8), (4, 4)])
@pytest.mark.parametrize(
    "B, Hq, Hkv, T, S, D, group, causal, window, start",
    [
        (1, 3, 1, 1, 1, 64, 64, False, 0, 0),  # the first token: one key
        (1, 9, 3, 1, 7, 64, 32, False, 0, 0),  # SmolLM-shaped decode, keys that fill no four
        (2, 9, 3, 1, 300, 128, 128, False, 0, 5),  # batch, three parts, a ring's run from row 5
        (1, 4, 4, 3, 7, 64, 64, True, 0, 0),  # no grouping, a few queries over a few keys
        (1, 6, 2, 3, 129, 128, 32, True, 16, 0),  # a window, a few queries
        (1, 6, 2, 1, 300, 64, 32, False, 40, 3),  # a ring's decode step: the last 40 keys
        (1, 6, 2, 70, 129, 128, 64, True, 0, 0),  # from 64 queries: the tiled path
        (1, 3, 3, 70, 300, 64, 32, True, 50, 0),  # tiled, a window, no grouping
        (1, 6, 2, 70, 70, 64, 64, True, 0, 0),  # tiled, as many queries as keys
    ],
)
def test_quantized_attention_matches_torch_on_the_dequantized_cache(kernel, k_bits, v_bits, B, Hq, Hkv, T, S, D,
                                                                     group, causal, window, start, rotated):
    rng = np.random.default_rng(S * T + D + k_bits * 3 + v_bits)
    q = mx.array(rng.standard_normal((B, Hq, T, D)).astype(np.float32) * 2)
    K = quantized_pool(rng, B, Hkv, S, D, k_bits, group, start + S + 9, start, rotated=rotated)
    V = quantized_pool(rng, B, Hkv, S, D, v_bits, group, start + S + 9, start, rotated=rotated)
    out = quantized_attention(kernel, q, K, V, causal, window)
    assert_close_to_scale(np.array(out), quantized_reference(q, K, V, D**-0.5, causal, window))


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("T", [3, 70])  # rows, and what would be tiles
def test_quantized_attention_reads_words_at_any_strides(kernel, T, rotated):
    rng = np.random.default_rng(T)
    q = mx.array(rng.standard_normal((1, 6, T, 64)).astype(np.float32))
    K = quantized_pool(rng, 1, 2, 129, 64, 8, 32, 140, words_strided=True, rotated=rotated)
    V = quantized_pool(rng, 1, 2, 129, 64, 4, 32, 140, words_strided=True, rotated=rotated)
    out = quantized_attention(kernel, q, K, V, True)
    assert_close_to_scale(np.array(out), quantized_reference(q, K, V, 0.125, True))


@pytest.mark.parametrize("T", [3, 70])  # rows, and tiles
def test_quantized_attention_propagates_nan_to_the_rows_that_read_it(kernel, T):
    """A NaN scale of key 5 spoils the rows that see key 5 (causal: all but
    the first, whose last key is 4), a NaN query its own row only; the other
    rows are as without the NaNs. (Torch's reference spoils every row: it
    adds the mask to the NaN score of a key the row does not see.)"""
    rng = np.random.default_rng(1)
    S = T + 4
    q = rng.standard_normal((1, 2, T, 64)).astype(np.float32)
    K = quantized_pool(rng, 1, 1, S, 64, 8, 32, S)
    V = quantized_pool(rng, 1, 1, S, 64, 4, 32, S)
    expected = torch_attention(mx.array(q), K.dequantize(), V.dequantize(), 0.125, True)
    q[0, 1, 0, 3] = np.nan
    scales = np.array(K.scales)
    scales[0, 0, 5, 1] = np.nan
    out = np.array(quantized_attention(kernel, mx.array(q), K._replace(scales=mx.array(scales)), V, True))
    expected[:, :, 1:] = np.nan
    expected[0, 1, 0] = np.nan
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert_close_to_scale(out[0, 0, 0], expected[0, 0, 0])


def test_quantized_attention_refuses_what_it_cannot_read_with_the_reason(kernel):
    rng = np.random.default_rng(2)
    q = mx.zeros((1, 4, 1, 64))
    K = quantized_pool(rng, 1, 2, 9, 64, 8, 32, 9)
    V = quantized_pool(rng, 1, 2, 9, 64, 4, 32, 9)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        quantized_attention(kernel, q, K._replace(group_size=16), V, False)
    with pytest.raises(ValueError, match=r"needs words \(1,2,9,16\).*\(v\)"):
        quantized_attention(kernel, q, K, V._replace(bits=8), False)
    with pytest.raises(ValueError, match="float16"):
        quantized_attention(kernel, q, K._replace(scales=K.scales.astype(mx.float32)), V, False)
    with pytest.raises(ValueError, match="incompatible shapes"):
        quantized_attention(kernel, mx.zeros((1, 3, 1, 64)), K, V, False)
    with pytest.raises(ValueError, match="more queries than keys"):
        quantized_attention(kernel, mx.zeros((1, 4, 10, 64)), K, V, True)


def test_quantized_attention_wrapper_hands_the_kernel_what_it_takes_and_the_rest_to_the_fallback(kernel):
    rng = np.random.default_rng(3)
    calls = []

    def fallback(Q, K, V, scale, mask):
        calls.append(mask)
        return "fallback"

    q = mx.array(rng.standard_normal((1, 4, 2, 64)).astype(np.float32))
    K = quantized_pool(rng, 1, 2, 9, 64, 8, 64, 9)
    V = quantized_pool(rng, 1, 2, 9, 64, 4, 64, 9)
    attend = extension_ops.quantized_attention(kernel, fallback)
    out = attend(q, K, V, 0.125, "causal")
    assert_close_to_scale(np.array(out), torch_attention(q, K.dequantize(), V.dequantize(), 0.125, True))
    # a rotated history (as the cache stores it) goes to the kernel too
    Kr, Vr = (kv._replace(rotated=True) for kv in (K, V))
    assert extension_ops.quantized_kernel_takes(q, Kr, Vr, True)
    assert_close_to_scale(np.array(attend(q, Kr, Vr, 0.125, "causal")), quantized_reference(q, Kr, Vr, 0.125, True))
    band = mx.ones((2, 9), dtype=mx.bool_)
    assert extension_ops.quantized_kernel_takes(q, K, V, True)
    for Q, K2, V2, mask in [
        (q, K, V, band),  # a band mask, but no window for the kernel
        (q.astype(mx.float16), K, V, "causal"),
        (q, K, V._replace(group_size=32), "causal"),  # groups of two sizes
        (q, K._replace(scales=K.scales.astype(mx.float32)), V, "causal"),
        (q, K, V._replace(bits=2), "causal"),
        (q, K, Vr, "causal"),  # one rotated, one not: the kernel takes one flag for both
        (mx.zeros((1, 4, 10, 64)), K, V, "causal"),  # more queries than keys
    ]:
        assert attend(Q, K2, V2, 0.125, mask) == "fallback"
    assert len(calls) == 7
    windowed = extension_ops.quantized_attention(kernel, fallback, window=4)
    out = windowed(q, K, V, 0.125, band)
    assert_close_to_scale(np.array(out), torch_attention(q, K.dequantize(), V.dequantize(), 0.125, True, 4))


def quantized_layer_pool(rng, Hkv, slots, D, bits, group, rotated=True):
    """One layer's keys or values as a quantized cache holds them: the words,
    scales and biases of `slots` rows, quantized from random fp16 values
    (each group rotated first, as the cache stores them)."""
    x = rng.standard_normal((1, Hkv, slots, D)).astype(np.float32)
    return list(mx.quantize(mx.array(rotate_groups(x, group) if rotated else x).astype(mx.float16), group_size=group,
                            bits=bits))


def written(pool, position, x, bits, group, rotated=True):
    """The pool as the op must leave it, as numpy arrays: rows position ..
    position + T those of mx.quantize of x's rows (numpy-rotated where asked)
    rounded to fp16, the rest as they were."""
    x = np.asarray(x)
    step = mx.quantize(mx.array(rotate_groups(x, group) if rotated else x).astype(mx.float16), group_size=group,
                       bits=bits)
    want = [np.array(a).copy() for a in pool]
    for w, s in zip(want, step):
        w[:, :, position : position + x.shape[2]] = np.array(s)
    return want


def assert_same_bits(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == mx.array(w).dtype
        np.testing.assert_array_equal(np.array(g).view(np.uint8), w.view(np.uint8))


def history_reference(q, pools, k_bits, v_bits, group, end, rotated=True):
    """torch's attention of q over the first `end` rows of written pools,
    dequantized and (where stored rotated) rotated back: causal for several
    queries, as the op attends."""
    K, V = (QuantizedKV(*(f[:, :, :end] for f in fields), bits, group).dequantize()
            for fields, bits in ((pools[:3], k_bits), (pools[3:], v_bits)))
    K, V = (rotate_groups(x, group) if rotated else np.array(x) for x in (K, V))
    return torch_attention(q, K, V, q.shape[-1]**-0.5, q.shape[2] > 1)


@pytest.mark.parametrize("k_bits, v_bits", [(8, 8), (8, 4), (4, 4)])
@pytest.mark.parametrize("Hq, Hkv, T, D, group, position, rotated", [
    (9, 3, 1, 64, 64, 37, True),  # a SmolLM-shaped decode step
    (4, 2, 3, 64, 32, 20, True),  # a chat turn's few queries: two groups a row
    (6, 2, 70, 64, 64, 5, True),  # a prefill chunk: the tiled path
    (2, 2, 1, 128, 128, 0, True),  # the first token: attends to itself alone
    (4, 2, 3, 64, 32, 9, False),  # a history stored as it is
])
def test_quantized_update_and_attend_writes_the_step_and_attends_the_history(kernel, k_bits, v_bits, Hq, Hkv, T, D,
                                                                            group, position, rotated):
    rng = np.random.default_rng(T * 100 + D + k_bits + v_bits)
    slots = position + T + 6
    K = quantized_layer_pool(rng, Hkv, slots, D, k_bits, group, rotated)
    V = quantized_layer_pool(rng, Hkv, slots, D, v_bits, group, rotated)
    q = mx.array(rng.standard_normal((1, Hq, T, D)).astype(np.float32))
    # keys and values as a projection hands them over: a transposed view
    k, v = (mx.array(rng.standard_normal((1, T, Hkv, D)).astype(np.float32) * 3).transpose(0, 2, 1, 3)
            for _ in range(2))
    y, *pools = kernel.quantized_update_and_attend(q, k, v, *K, *V, position, D**-0.5, k_bits, v_bits, group,
                                                   rotated=rotated)
    # the pools: the history, with the step's rows as mx.quantize stores them
    assert_same_bits(pools, written(K, position, k, k_bits, group, rotated)
                     + written(V, position, v, v_bits, group, rotated))
    assert_close_to_scale(y, history_reference(q, pools, k_bits, v_bits, group, position + T, rotated))


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_update_and_attend_rounds_as_mx_quantize_bit_for_bit(kernel, bits, rotated):
    """Rows that probe each step of MLX's affine quantization: zeros,
    all-equal groups (no range), a negative end of the larger magnitude,
    large and tiny (fp16-subnormal) values, an outlier, evenly spaced values
    (ties to even), and values halfway between two fp16 values."""
    rng = np.random.default_rng(bits * 2 + rotated)
    x = rng.standard_normal((1, 2, 12, 64)).astype(np.float32)
    x[0, 0, 0] = 0
    x[0, 0, 1] = 1.5
    x[0, 0, 2, :32], x[0, 0, 2, 32:] = -0.75, 3e-5
    x[0, 0, 3] = -np.abs(x[0, 0, 3])
    x[0, 0, 4] *= 1000
    x[0, 0, 5] *= 1e-6
    x[0, 0, 6, 7] = 50
    x[0, 0, 7] = np.tile(np.linspace(-1, 1, 32), 2)
    x[0, 0, 8] = 1 + 2.0**-11 * np.arange(64) % 4
    x[0, 1] = -x[0, 0]
    K = quantized_layer_pool(rng, 2, 17, 64, bits, 32, rotated)
    V = quantized_layer_pool(rng, 2, 17, 64, bits, 32, rotated)
    q, k = mx.array(rng.standard_normal((1, 4, 12, 64)).astype(np.float32)), mx.array(x)
    y, *pools = kernel.quantized_update_and_attend(q, k, -k, *K, *V, 3, 0.125, bits, bits, 32, rotated=rotated)
    assert_same_bits(pools, written(K, 3, x, bits, 32, rotated) + written(V, 3, -x, bits, 32, rotated))


def test_quantized_update_and_attend_writes_in_place_unless_the_pool_is_held(kernel):
    rng = np.random.default_rng(8)
    K, V = quantized_layer_pool(rng, 2, 16, 64, 8, 64), quantized_layer_pool(rng, 2, 16, 64, 4, 64)
    mx.eval(K, V)
    addresses = [data_address(a) for a in K + V]

    def step(K, V, position):
        q = mx.array(rng.standard_normal((1, 4, 1, 64)).astype(np.float32))
        k, v = (mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)) for _ in range(2))
        y, *pools = kernel.quantized_update_and_attend(q, k, v, *K, *V, position, 0.125, 8, 4, 64, rotated=True)
        return y, pools, k, v

    for position in range(3):  # a decode loop: each step's pools are the next step's
        y, pools, _, _ = step(K, V, position)
        K, V = pools[:3], pools[3:]
        del pools
        mx.eval(y, K, V)
        assert [data_address(a) for a in K + V] == addresses  # no copy of the pools per step
    # pools something else still holds (a saved state's slices, here the
    # caller's names) are copied: the holders keep what they saw
    held = [np.array(a).copy() for a in K + V]
    y, pools, k, v = step(K, V, 2)
    mx.eval(y, pools)
    for a, before in zip(K + V, held):
        np.testing.assert_array_equal(np.array(a), before)
    assert_same_bits(pools, written(K, 2, k, 8, 64) + written(V, 2, v, 4, 64))


def test_quantized_update_and_attend_refuses_what_it_cannot_write_with_the_reason(kernel):
    rng = np.random.default_rng(9)
    K, V = quantized_layer_pool(rng, 2, 4, 64, 8, 32), quantized_layer_pool(rng, 2, 4, 64, 4, 32)
    q, k = mx.zeros((1, 4, 1, 64)), mx.zeros((1, 2, 1, 64))

    def write(K=K, V=V, q=q, k=k, position=0, bits=(8, 4), group=32):
        return kernel.quantized_update_and_attend(q, k, k, *K, *V, position, 1.0, *bits, group)

    with pytest.raises(ValueError, match="overruns a pool of 4"):
        write(position=4)
    with pytest.raises(ValueError, match=r"needs words \(1,2,4,16\).*\(v pool\)"):
        write(bits=(8, 8))
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        write(group=16)
    with pytest.raises(ValueError, match="float16"):
        write(K=[K[0], K[1].astype(mx.float32), K[2]])
    with pytest.raises(ValueError, match="incompatible shapes"):
        write(q=mx.zeros((1, 3, 1, 64)))
    with pytest.raises(ValueError, match="float32"):
        write(k=k.astype(mx.bfloat16))


def test_the_plan_writes_and_attends_in_one_op_where_a_flat_layer_stores_keys_and_values_alike(kernels):
    plan = Plan(True, kernels)

    def op(window, keys, values):
        in_op = plan.update_and_attend(0.5, window, (storage(keys), storage(values)))
        return in_op and in_op.run.__qualname__.split(".")[0]

    assert op(0, "int8", "int4") == "quantized_update_and_attend"
    assert op(0, "bf16", "bf16") == "update_and_attend"
    for window, keys, values in [(8, "int8", "int8"), (8, "fp32", "fp32"), (0, "fp16", "int4"), (0, "fp16", "bf16")]:
        assert op(window, keys, values) is None
    assert Plan(True, dataclasses.replace(kernels, attention=cpu.Use(False, "off"))).update_and_attend(
        0.5, 0, (storage("int8"), storage("int8"))) is None
