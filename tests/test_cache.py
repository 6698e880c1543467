"""The off-graph cache, through UpdateAndAttendNode, against ExecuTorch's
eager reference cache (``executorch.extension.llm.cache.reference_cache``).
A quantized cache is checked against the reference fed the same history
rounded by MLX's own ``mx.quantize``/``mx.dequantize``, and its rounding
against numpy's unpacking of the stored words."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from executorch.extension.llm.cache.reference_cache import (
    CacheConfig,
    ContiguousReferenceCache,
    LayerPolicy,
    attend,
)
from opgraph import OpGraph, md

from llm_executorch_mlx.runtime import CacheFullError, LayerGeometry, PteError, SequenceCache, cpu
from llm_executorch_mlx.runtime.dtypes import on_cpu

H_Q, H_KV, D = 4, 2, 32  # D a multiple of 16: chunks of 8+ queries take the kernel's tiled path;
# of 32: a quantized cache takes it (groups of 32)
QUANTIZED_BITS = {"int8": 8, "int4": 4}
FLOAT_DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}
SCALE = D**-0.5
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Attention:
    """One UpdateAndAttendNode per layer, run through our interpreter."""

    def __init__(self, cache: SequenceCache, plan=None):
        self.cache = cache
        self.executors = []
        for layer in range(len(cache.layers)):
            g = OpGraph()
            q = g.input(np.zeros((1, H_Q, 1, D), np.float32), dynamic_dims=(2,))
            k = g.input(np.zeros((1, H_KV, 1, D), np.float32), dynamic_dims=(2,))
            v = g.input(np.zeros((1, H_KV, 1, D), np.float32), dynamic_dims=(2,))
            pos = g.input(np.zeros((1,), np.int64), dynamic_dims=(0,))
            out = g.temp()
            g.node(md.UpdateAndAttendNodeT, q=q, k=k, v=v, position=pos, out=out,
                   layerId=layer, scale=SCALE, outDtype=None)
            g.output(out)
            self.executors.append(g.executor(cache=cache, plan=plan))

    def step(self, layer, q, k, v, position):
        positions = np.arange(position, position + q.shape[2], dtype=np.int64)
        (out,) = self.executors[layer].execute([q, k, v, positions])
        return np.array(out)


class Reference:
    def __init__(self, windows, capacity, dtype):
        self.cache = ContiguousReferenceCache(CacheConfig(
            n_layers=len(windows), n_kv_heads=H_KV, head_dim=D, capacity=capacity,
            dtype=TORCH_DTYPES[dtype],
            layers=[LayerPolicy.ring(w) if w else LayerPolicy.flat() for w in windows],
        ))

    def step(self, layer, q, k, v, position):
        pos = torch.arange(position, position + q.shape[2]).unsqueeze(-1)
        K, V, spec = self.cache.update_and_fetch(layer, torch.from_numpy(k), torch.from_numpy(v), pos)
        return attend(torch.from_numpy(q), K, V, spec, SCALE, torch.float32).numpy()


def hadamard(n):
    """The orthonormal Walsh-Hadamard matrix of size n, Sylvester's order."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotated(x):
    """Each group of 32 values of the last axis times hadamard(32)."""
    return (x.reshape(*x.shape[:-1], -1, 32) @ hadamard(32)).reshape(x.shape)


def rounded(x, dtype):
    """What a ``dtype`` cache holds of the fp32 history ``x``, in fp32: the
    reference cache rounds to a float dtype itself; a quantized one rotates
    each group of 32 by the Hadamard matrix, quantizes the fp16 values with
    MLX's affine quantization and rotates back (the rotation is its own
    inverse)."""
    if x.size == 0:
        return x
    if dtype not in QUANTIZED_BITS:
        return np.array(mx.array(x).astype(FLOAT_DTYPES[dtype]).astype(mx.float32))
    bits = QUANTIZED_BITS[dtype]
    data, scales, biases = mx.quantize(mx.array(rotated(x)).astype(mx.float16), group_size=32, bits=bits)
    return rotated(np.array(mx.dequantize(data, scales.astype(mx.float32), biases.astype(mx.float32),
                                          group_size=32, bits=bits)))


def random_step(rng, T):
    return (rng.standard_normal((1, H_Q, T, D)).astype(np.float32),
            rng.standard_normal((1, H_KV, T, D)).astype(np.float32),
            rng.standard_normal((1, H_KV, T, D)).astype(np.float32))


def run_side_by_side(windows, steps, dtype="fp32", capacity=128, initial=None, max_write=8, atol=1e-5,
                     plan=None, value_dtype=None):
    value_dtype = value_dtype or dtype
    cache = SequenceCache([LayerGeometry(H_KV, D, w) for w in windows], capacity, dtype, value_dtype,
                          initial_capacity=initial, max_write=max_write)
    reference_dtype = dtype if dtype == value_dtype and dtype in TORCH_DTYPES else "fp32"
    ours, ref = Attention(cache, plan), Reference(windows, capacity, reference_dtype)
    rng = np.random.default_rng(0)
    position = 0
    for T in steps:
        for layer in range(len(windows)):
            q, k, v = random_step(rng, T)
            np.testing.assert_allclose(ours.step(layer, q, k, v, position),
                                       ref.step(layer, q, rounded(k, dtype), rounded(v, value_dtype), position),
                                       atol=atol, rtol=atol)
        position += T
        assert cache.length == position
    return cache


def test_flat_multi_token_steps_match_reference():
    run_side_by_side([0], [5, 3, 1, 1, 8, 2, 1])


def test_ring_wraps_and_matches_reference_past_its_window():
    # window 8, steps of up to max_write 4 into an 11-slot ring: 80 positions wrap often
    run_side_by_side([8], [4, 3, 1, 4, 2] * 5 + [1] * 10, max_write=4)


def test_mixed_flat_and_ring_layers_share_one_length():
    cache = run_side_by_side([6, 0, 6], [6, 6, 1, 1, 5, 6, 1], max_write=6)
    assert cache.length == 26


def test_flat_pool_grows_by_doubling_from_small_initial_capacity():
    cache = run_side_by_side([0], [3, 1, 1, 8, 1], initial=2, capacity=20)
    assert cache.state[0].shape[2] == 16  # 2 -> 4 -> 8 -> 16 slots, for 14 tokens
    run_side_by_side([0], [7, 8, 5], initial=0, capacity=20)  # 0 -> 1 -> ... clamped at 20


def test_no_pool_is_a_multiple_of_256_slots_and_all_capacity_is_usable():
    # MLX CUDA would send one-query attention over such a pool to cuDNN's
    # nondeterministic decode kernel (cache.py). Flat pools that would be 256
    # -> 512 -> 1024 (now 257 -> 514 -> 1025) and a 256-slot ring (window 200
    # + max_write 57 - 1), filled to the capacity, still match the reference.
    steps = [57] * 5 + [1, 1] + [57] * 12 + [1] * (1024 - 57 * 17 - 2)
    cache = run_side_by_side([0, 200], steps, capacity=1024, initial=256, max_write=57, atol=1e-4)
    assert cache.length == 1024
    slots = [pool.shape[2] for pool in cache.state]
    assert slots == [1025, 257, 1025, 257]
    with pytest.raises(CacheFullError):
        Attention(cache).step(0, *random_step(np.random.default_rng(1), 1), 1024)


def test_wrapped_one_query_read_of_256_rows_matches_reference():
    # a 256-row window read across the ring's end is joined with a spare row
    # and sliced back (cache.py, _joined): the values must not change
    run_side_by_side([256], [64] * 5 + [1] * 40, capacity=512, max_write=64)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_storage_matches_reference(dtype):
    cache = run_side_by_side([0, 8], [5, 1, 1, 4, 1], dtype=dtype, max_write=5, atol=2e-2)
    assert cache.state[0].dtype == {"fp16": mx.float16, "bf16": mx.bfloat16}[dtype]


def one_op_steps(monkeypatch, name):
    """The T of each call of the CPU extension's op ``name`` from now on, or
    None where the plan has no extension here (no compiler, or a GPU)."""
    kernels = cpu.kernels(build=True)
    if not (on_cpu() and kernels.attention.on):
        return None
    calls, real = [], getattr(kernels.extension, name)
    monkeypatch.setattr(kernels.extension, name, lambda q, *a, **k: calls.append(q.shape[2]) or real(q, *a, **k))
    return calls


@pytest.mark.parametrize("dtype, value_dtype", [("int8", "int8"), ("int8", "int4"), ("int4", "int4"),
                                                 ("fp16", "int4")])
def test_quantized_storage_attends_as_the_reference_over_the_rounded_history(dtype, value_dtype, monkeypatch):
    # flat and ring layers, prefill chunks (the tiled path from 8 queries) and
    # single tokens, the 8 + 8 - 1-slot rings wrapping several times
    steps = [8, 3, 1, 1, 8, 5] + [1] * 6 + [8] * 3
    in_op = one_op_steps(monkeypatch, "quantized_update_and_attend")
    cache = run_side_by_side([8, 0], steps, dtype=dtype, value_dtype=value_dtype, atol=2e-5)
    assert (cache.dtype, cache.value_dtype) == (dtype, value_dtype)
    # with the CPU kernels, the flat layer's steps are each one op where
    # keys and values are both quantized (writing them as mx.quantize does)
    if in_op is not None:
        assert in_op == (steps if dtype != "fp16" else [])


def test_keys_and_values_in_two_float_dtypes_take_the_mlx_writes(monkeypatch):
    # the one-op write takes pools of one dtype: fp16 keys beside bf16 values go through update_and_fetch
    in_op = one_op_steps(monkeypatch, "update_and_attend")
    run_side_by_side([0, 8], [5, 1, 1, 4, 1], dtype="fp16", value_dtype="bf16", max_write=5, atol=2e-2)
    assert not in_op


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_history_is_packed_as_mlx_lays_it_out_and_within_a_step(dtype):
    """numpy unpacks the stored words (little end first), applies each group's
    scale and bias, and finds every value within one quantization step of
    the fp16 value written, rotated by the Hadamard matrix of its group."""
    bits, T = QUANTIZED_BITS[dtype], 5
    cache = SequenceCache([LayerGeometry(H_KV, D)], 16, dtype)
    x = np.random.default_rng(7).standard_normal((1, H_KV, T, D)).astype(np.float32) * 3
    K, _, _ = cache.update_and_fetch(0, 0, mx.array(x), mx.array(x))
    words, scales, biases = (np.array(a) for a in (K.data, K.scales, K.biases))
    per_word = 32 // bits
    q = (words[..., :, None] >> (bits * np.arange(per_word, dtype=np.uint32))) & ((1 << bits) - 1)
    q = q.reshape(1, H_KV, T, D).astype(np.float32)
    step = np.repeat(scales.astype(np.float32), D // scales.shape[-1], axis=-1)
    values = q * step + np.repeat(biases.astype(np.float32), D // biases.shape[-1], axis=-1)
    np.testing.assert_allclose(values, np.array(K.dequantize(mx.float32)), rtol=0, atol=1e-6)
    assert K.rotated and np.all(np.abs(values - rotated(x).astype(np.float16)) <= np.abs(step) * 1.0001)
    # each group's 32 values use the whole range: its ends are stored within half a step
    assert (q.reshape(-1, 32).min(-1) == 0).any() and (q.reshape(-1, 32).max(-1) == (1 << bits) - 1).any()


def test_quantized_storage_takes_the_bytes_it_promises():
    layers = [LayerGeometry(H_KV, 64), LayerGeometry(H_KV, 64, 8)]
    per_token = {kv: SequenceCache(layers, 16, *kv).bytes_per_token()
                 for kv in [("fp16", "fp16"), ("int8", "int8"), ("int8", "int4"), ("int4", "int4")]}
    fp16 = per_token["fp16", "fp16"]
    assert per_token["int8", "int8"] / fp16 <= 0.55 and per_token["int8", "int4"] / fp16 <= 0.42
    cache = SequenceCache(layers, 16, "int8", "int4")
    cache.update_and_fetch(0, 0, mx.zeros((1, H_KV, 3, 64)), mx.zeros((1, H_KV, 3, 64)))
    cache.update_and_fetch(1, 0, mx.zeros((1, H_KV, 3, 64)), mx.zeros((1, H_KV, 3, 64)))
    mx.eval(cache.state)
    assert cache.bytes_in_use() == 3 * per_token["int8", "int4"]
    assert cache.nbytes == sum(a.nbytes for a in cache.state)


def test_refuses_a_step_past_capacity_and_keeps_its_length():
    cache = SequenceCache([LayerGeometry(H_KV, D)], capacity=6, dtype="fp32")
    att = Attention(cache)
    rng = np.random.default_rng(1)
    att.step(0, *random_step(rng, 5), 0)
    assert cache.can_extend(1) and not cache.can_extend(2)
    with pytest.raises(CacheFullError, match="capacity 6"):
        att.step(0, *random_step(rng, 2), 5)
    assert cache.length == 5


def test_refuses_a_position_that_leaves_a_gap():
    cache = SequenceCache([LayerGeometry(H_KV, D)], capacity=16, dtype="fp32")
    with pytest.raises(PteError, match="past the cache length"):
        Attention(cache).step(0, *random_step(np.random.default_rng(2), 1), 3)


@pytest.mark.parametrize("windows, dtype", [([0], "fp32"), ([8, 0], "fp32"), ([8, 0], "int4")])
def test_rewind_then_continue_equals_a_fresh_run(windows, dtype):
    rng = np.random.default_rng(3)
    history = [random_step(rng, 4) for _ in range(5)]  # 20 tokens
    branch = [random_step(rng, 3), random_step(rng, 1)]

    cache = SequenceCache([LayerGeometry(H_KV, D, w) for w in windows], 64, dtype, max_write=4)
    ours = Attention(cache)
    for i, (q, k, v) in enumerate(history):
        for layer in range(len(windows)):
            ours.step(layer, q, k, v, 4 * i)
    assert cache.rewind(17)
    assert cache.length == 17
    assert not cache.rewind(18)  # cannot grow

    ref = Reference(windows, 64, "fp32")
    for i, (q, k, v) in enumerate(history):
        T = min(4, 17 - 4 * i)
        if T <= 0:
            break
        for layer in range(len(windows)):
            ref.step(layer, q[:, :, :T], rounded(k[:, :, :T], dtype), rounded(v[:, :, :T], dtype), 4 * i)
    position = 17
    for q, k, v in branch:
        for layer in range(len(windows)):
            np.testing.assert_allclose(ours.step(layer, q, k, v, position),
                                       ref.step(layer, q, rounded(k, dtype), rounded(v, dtype), position),
                                       atol=2e-5)
        position += q.shape[2]


def test_ring_refuses_rewind_past_what_it_still_holds():
    # window 4, max_write 2 -> 5 slots; after 20 tokens the ring holds 15..19.
    cache = SequenceCache([LayerGeometry(H_KV, D, 4)], 64, "fp32", max_write=2)
    att = Attention(cache)
    rng = np.random.default_rng(4)
    for p in range(0, 20, 2):
        att.step(0, *random_step(rng, 2), p)
    # A query at p reads p-3..p: p >= 18 keeps that inside 15..19.
    assert cache.rewind_floor() == 18
    assert not cache.rewind(17)
    assert cache.length == 20
    assert cache.rewind(18)


def test_clear_then_rerun_equals_a_fresh_cache():
    rng = np.random.default_rng(5)
    steps = [random_step(rng, 3), random_step(rng, 1)]
    cache = SequenceCache([LayerGeometry(H_KV, D, 4)], 32, "fp32", max_write=3)
    att = Attention(cache)
    first = [att.step(0, q, k, v, p) for (q, k, v), p in zip(steps, [0, 3])]
    att.step(0, *random_step(rng, 3), 4)
    cache.clear()
    assert cache.length == 0
    again = [att.step(0, q, k, v, p) for (q, k, v), p in zip(steps, [0, 3])]
    for a, b in zip(first, again):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_program_free_validation_errors():
    with pytest.raises(PteError, match="capacity"):
        SequenceCache([LayerGeometry(H_KV, D)], capacity=0)
    with pytest.raises(PteError, match="storage dtype 'int3'"):
        SequenceCache([LayerGeometry(H_KV, D)], capacity=8, dtype="int3")
    with pytest.raises(PteError, match="head size is 48: store keys and values in bf16, fp16 or fp32"):
        SequenceCache([LayerGeometry(H_KV, 48)], capacity=8, value_dtype="int4")


def test_a_step_too_large_for_a_ring_is_refused_before_any_layer_writes():
    cache = SequenceCache([LayerGeometry(H_KV, D, 0), LayerGeometry(H_KV, D, 4)], 64, "fp32", max_write=4)
    att = Attention(cache)
    with pytest.raises(PteError, match="max write of 4"):
        att.step(0, *random_step(np.random.default_rng(6), 6), 0)  # layer 0 is flat
    assert cache.length == 0 and cache.rewind(0)


def test_an_aborted_step_restores_the_length_and_guards_overwritten_ring_cells():
    # window 4, max_write 2 -> 5 ring slots
    cache = SequenceCache([LayerGeometry(H_KV, D, 0), LayerGeometry(H_KV, D, 4)], 64, "fp32", max_write=2)
    att = Attention(cache)
    rng = np.random.default_rng(7)
    for p in range(0, 10, 2):
        for layer in (0, 1):
            att.step(layer, *random_step(rng, 2), p)
    assert cache.length == 10 and cache.rewind_floor() == 8
    cache.begin_step()  # what a forward call does; here both layers write 10, 11 and the call fails
    for layer in (0, 1):
        _, k, v = random_step(rng, 2)
        cache.update_and_fetch(layer, 10, mx.array(k), mx.array(v))
    cache.abort_step()
    assert cache.length == 10
    # the ring now holds 7..11, so a step at 8 would miss position 5..7 of its window
    assert cache.rewind_floor() == 10
    assert not cache.rewind(9)
    cache.clear()
    assert cache.rewind_floor() == 0


@pytest.mark.parametrize("back, dtype", [(0, "fp32"), (4, "fp32"), (4, "int8")],
                         ids=["at-its-length", "at-its-floor", "quantized"])
def test_a_restored_snapshot_continues_as_the_reference(back, dtype):
    """A snapshot (flat and ring layers, the ring wrapped) restored into a
    fresh cache, at its length or a shorter one down to its floor, then
    continued: each step attends as ExecuTorch's reference cache fed the
    same history."""
    windows = [6, 0]
    rng = np.random.default_rng(6)
    history = [random_step(rng, 4) for _ in range(7)]  # 28 tokens: the 9-slot ring has wrapped
    branch = [random_step(rng, 3), random_step(rng, 1), random_step(rng, 4)]
    layers = [LayerGeometry(H_KV, D, w) for w in windows]
    original = SequenceCache(layers, 64, dtype, max_write=4)
    att = Attention(original)
    for i, (q, k, v) in enumerate(history):
        for layer in range(len(windows)):
            att.step(layer, q, k, v, 4 * i)
    floor, saved = original.snapshot()
    # the floor is a step's worth back (28 - max_write); the ring keeps the
    # cells a query at the floor reads on: all its 6 + 4 - 1 slots
    assert floor == 24 and [s[1].shape[2] for s in saved] == [9, 28]
    length = 28 - back

    restored = SequenceCache(layers, 64, dtype, initial_capacity=8, max_write=4)
    restored.restore(length, floor, saved)
    assert restored.length == length and restored.rewind_floor() == floor
    ours, ref = Attention(restored), Reference(windows, 64, "fp32")
    for i, (q, k, v) in enumerate(history):
        T = min(4, length - 4 * i)
        for layer in range(len(windows)):
            ref.step(layer, q[:, :, :T], rounded(k[:, :, :T], dtype), rounded(v[:, :, :T], dtype), 4 * i)
    position = length
    for q, k, v in branch:
        for layer in range(len(windows)):
            np.testing.assert_allclose(ours.step(layer, q, k, v, position),
                                       ref.step(layer, q, rounded(k, dtype), rounded(v, dtype), position),
                                       atol=2e-5)
        position += q.shape[2]


def test_restore_refuses_cells_that_do_not_fit():
    layers = [LayerGeometry(H_KV, D, 0)]
    cache = SequenceCache(layers, 32, "fp32")
    k = mx.zeros((1, H_KV, 10, D))
    with pytest.raises(PteError, match="does not fit"):
        cache.restore(10, 0, [(0, k.astype(mx.float16), k.astype(mx.float16))])  # another dtype
    with pytest.raises(PteError, match="does not fit"):
        cache.restore(12, 0, [(0, k, k)])  # fewer cells than the length
    with pytest.raises(PteError, match="cannot restore"):
        cache.restore(40, 0, [(0, k, k)])  # past the capacity
