"""Creation nodes (ARange, Full, FullLike, Tri, Tril, Triu, RandomBits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
from opgraph import OpGraph

from llm_executorch_mlx.runtime.pte._schema import mlx_delegate as md
from llm_executorch_mlx.runtime.errors import PteError

FP32, INT32 = 6, 3


def close(got, want):
    want = want.numpy()
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def sized(g, n):
    """A Vid holding ``n``, computed at run time by SymSize of an input."""
    v = g.value()
    g.node(md.SymSizeNodeT, a=g.input(np.zeros((1, n), np.float32)), dim=1, out=v)
    return v


def run_creation(cls, **fields):
    g = OpGraph()
    out = g.temp()
    g.node(cls, out=out, **{k: v(g) if callable(v) else v for k, v in fields.items()})
    g.output(out)
    return g.run()[0]


# Fields given as callables are built on the graph (Vids need one).
def iov(x, dynamic=False):
    return lambda g: g.iov(sized(g, x) if dynamic else x)


@pytest.mark.parametrize(
    "start, stop, step, dynamic",
    [(0, 10, 1, False), (2, 11, 3, False), (10, -3, -4, False), (-5, 6, 2, True)],
)
@pytest.mark.parametrize("scalar_type, dtype", [(None, torch.int32), (FP32, torch.float32)])
def test_arange(start, stop, step, dynamic, scalar_type, dtype):
    got = run_creation(
        md.ARangeNodeT, start=iov(start), stop=iov(stop, dynamic), step=iov(step),
        scalarType=scalar_type,
    )
    close(got, torch.arange(start, stop, step, dtype=dtype))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"step": 0}, "ARangeNode: step must not be zero"),
        ({"stop": 0}, "ARangeNode: invalid dimension 0"),  # the C++ guard: no empty range
        ({"step": -1}, "ARangeNode: invalid dimension 0"),
    ],
)
def test_arange_rejected_at_load(fields, message):
    values = {"start": 0, "stop": 5, "step": 1, **fields}
    with pytest.raises(PteError, match=message):
        run_creation(md.ARangeNodeT, **{k: iov(v) for k, v in values.items()})


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("scalar_type, dtype", [(FP32, torch.float32), (INT32, torch.int32)])
def test_full(dynamic, scalar_type, dtype):
    got = run_creation(
        md.FullNodeT, shape=lambda g: [g.iov(2), g.iov(sized(g, 3) if dynamic else 3)],
        v=lambda g: g.fov(-1.5), scalarType=scalar_type,
    )
    close(got, torch.full((2, 3), -1.5).to(dtype))


def test_full_dynamic_value():
    got = run_creation(
        md.FullNodeT, shape=lambda g: [g.iov(2)], v=lambda g: g.fov(sized(g, 7)), scalarType=FP32
    )
    close(got, torch.full((2,), 7.0))


def test_full_rejects_empty_dim():
    with pytest.raises(PteError, match="FullNode: invalid dimension 0"):
        run_creation(md.FullNodeT, shape=lambda g: [g.iov(0)], v=lambda g: g.fov(1), scalarType=FP32)


@pytest.mark.parametrize(
    "scalar_type, dtype", [(None, torch.float32), (INT32, torch.int32), (11, torch.bool)]
)
@pytest.mark.parametrize("dynamic", [False, True])
def test_full_like(scalar_type, dtype, dynamic):
    x = np.ones((2, 3), np.float32)
    got = run_creation(
        md.FullLikeNodeT, x=lambda g: g.input(x), v=lambda g: g.fov(sized(g, 4) if dynamic else 2.5),
        scalarType=scalar_type,
    )
    close(got, torch.full_like(torch.from_numpy(x), 4 if dynamic else 2.5, dtype=dtype))


@pytest.mark.parametrize("k", [-1, 0, 2])
@pytest.mark.parametrize("dynamic", [False, True])
def test_tri(k, dynamic):
    got = run_creation(md.TriNodeT, n=iov(4, dynamic), m=iov(5), k=k, scalarType=FP32)
    close(got, torch.ones(4, 5).tril(k))


@pytest.mark.parametrize("k", [-1, 0, 2])
@pytest.mark.parametrize("cls, fn", [(md.TrilNodeT, torch.tril), (md.TriuNodeT, torch.triu)])
def test_tril_triu(cls, fn, k):
    x = np.random.default_rng(0).standard_normal((2, 4, 5)).astype(np.float32)
    got = run_creation(cls, x=lambda g: g.input(x), k=k)
    close(got, fn(torch.from_numpy(x), k))


# -- RandomBits: no torch counterpart; checked against MLX's own generator ----


def random_bits(shape, width=4, seed=None, dynamic=False):
    def seed_vid(g):
        return sized(g, seed)

    return run_creation(
        md.RandomBitsNodeT,
        shape=lambda g: [g.iov(sized(g, d) if dynamic else d) for d in shape],
        width=width,
        **({"seed": seed_vid} if seed is not None else {}),
    )


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("shape", [(4, 6), (1,), (3, 5)], ids=str)
def test_random_bits_match_mlx(shape, dynamic):
    got = random_bits(shape, seed=11, dynamic=dynamic)
    assert got.dtype == np.uint32 and got.shape == shape
    # MLX's uniform is its random bits / (2**32 - 1), so both draw on the same words.
    u = np.array(mx.random.uniform(shape=shape, key=mx.random.key(11)))
    np.testing.assert_allclose(got / (2**32 - 1), u, rtol=1e-6)
    if np.prod(shape) % 2 == 0:  # split(key, n) is the bits of shape (n, 2)
        words = np.array(mx.random.split(mx.random.key(11), np.prod(shape) // 2))
        np.testing.assert_array_equal(got.reshape(-1), words.reshape(-1))


@pytest.mark.parametrize("width, dtype", [(1, np.uint8), (2, np.uint16)])
def test_random_bits_narrow_widths_are_bytes_of_words(width, dtype):
    words = random_bits((3,), seed=5)  # 3 words hold the 12 bytes below
    got = random_bits((12 // width,), width=width, seed=5)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, words.view(dtype))


def test_random_bits_unseeded_follow_the_global_key():
    mx.random.seed(3)
    first, second = random_bits((64,)), random_bits((64,))
    assert not np.array_equal(first, second)
    mx.random.seed(3)
    np.testing.assert_array_equal(random_bits((64,)), first)


def test_random_bits_bad_width():
    with pytest.raises(PteError, match="RandomBitsNode: width must be 1, 2 or 4"):
        random_bits((4,), width=3)


# -- bad slots ----------------------------------------------------------------


def bad_tid():
    t = md.TidT()
    t.idx = 99  # never registered with the graph, so it stays out of range
    return t


@pytest.mark.parametrize(
    "cls, fields",
    [
        (md.ARangeNodeT, {"start": 0, "stop": 4, "step": 1}),
        (md.FullNodeT, {"shape": [], "v": 1.0, "scalarType": FP32}),
        (md.TriNodeT, {"n": 2, "m": 2, "scalarType": FP32}),
        (md.RandomBitsNodeT, {"shape": []}),
    ],
    ids=lambda p: getattr(p, "__name__", ""),
)
def test_bad_out_slot(cls, fields):
    g = OpGraph()
    conv = {"v": g.fov, "shape": lambda s: [g.iov(d) for d in s]}
    fields = {k: conv.get(k, g.iov)(v) if k != "scalarType" else v for k, v in fields.items()}
    g.node(cls, out=bad_tid(), **fields)
    with pytest.raises(PteError, match=f"{cls.__name__[:-1]}: tensor slot 99 out of range"):
        g.executor()


@pytest.mark.parametrize("cls", [md.FullLikeNodeT, md.TrilNodeT, md.TriuNodeT])
def test_bad_input_slot(cls):
    g = OpGraph()
    fields = {"v": g.fov(0.0)} if cls is md.FullLikeNodeT else {}
    g.node(cls, x=bad_tid(), out=g.temp(), **fields)
    with pytest.raises(PteError, match=f"{cls.__name__[:-1]}: tensor slot 99 out of range"):
        g.executor()
