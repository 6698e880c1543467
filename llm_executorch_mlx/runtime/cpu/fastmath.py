"""MLX-op versions of exp, softmax attention, SwiGLU and RMSNorm that the CPU runs fast.

These are the CPU's routes where the extension is not loaded (no compiler,
``LLM_PTE_CPU_KERNELS=0``) and the fallbacks of its ops for what they do
not take. The rest of this docstring is about ``exp``, which they share.

MLX's CPU ``exp`` is Cephes' polynomial, but the x86-64 wheel evaluates it one
element at a time with out-of-line ``fmaf`` and ``floor`` calls (libmlx
imports ``fmaf`` from glibc): about twenty times an add's cost, which
``sigmoid`` and ``softmax`` inherit, so a prefill chunk spent much of its
time in softmax and SiLU.

``exp`` below is the same kind of polynomial (Cephes ``expf``, within 2e-7
relative of float64's, ``tests/test_fastmath.py``) written as plain adds
and multiplies under ``mx.compile``, which MLX's CPU backend turns into
generated SSE loops. Such a loop vectorises only while every input is a
contiguous array of the output's shape and the chain has no max/min/select;
MLX also cuts a fused chain after ~11 dependent ops, and a cut turns scalar
constants into broadcast inputs, so the pieces below are kept shallow.

``2**k`` is built from bits: adding 1.5 * 2**23 rounds ``x * log2(e)`` to
the integer ``k``, held in the low mantissa bits, so no ``floor`` is needed;
those bits, shifted into the exponent field, are ``2**k``.

Inputs are clamped to [-87, 88], so ``exp(-inf)`` is 1.6e-38 rather than 0.
That is harmless where it is used: a masked score, after the row max is
subtracted, adds less than 1e-38 of the row's sum, and ``silu`` divides by
``1 + exp(-x)``. It is not a general-purpose ``exp``.
"""

from __future__ import annotations

import functools

import mlx.core as mx

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06  # ln 2 = HI + LO
_ROUNDER = 12582912.0  # 1.5 * 2**23
_ROUNDER_BITS = 0x4B400000
_CEPHES = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _reduce(x):
    """``(t, r)``: ``t``'s low mantissa bits hold ``k = round(x / ln 2)``, and
    ``r = x - k ln 2``, so ``exp(x) = 2**k * exp(r)`` with ``|r| <= ln 2 / 2``.
    ``x`` must be clamped to [-87, 88] already."""
    t = x * _LOG2E + _ROUNDER
    k = t - _ROUNDER
    return t, x - k * _LN2_HI - k * _LN2_LO


def _exp_small(r):
    """Cephes' ``expf`` polynomial for ``|r| <= ln 2 / 2``, evaluated in
    Estrin's order: MLX fuses at most ~11 dependent ops into one kernel, and
    Horner's order would split it into a strided kernel that does not
    vectorise."""
    c0, c1, c2, c3, c4, c5 = _CEPHES
    r2 = r * r
    p = ((c0 * r + c1) * r2 + (c2 * r + c3)) * r2 + (c4 * r + c5)
    return p * r2 + (r + 1.0)


def _two_to_the(t_bits):
    return mx.view((t_bits - _ROUNDER_BITS + 127) << 23, mx.float32)


# The clamps are not inside a compiled kernel: MLX's generated max/min/select
# loops branch on NaN and run scalar, several times slower than its own clip
# and maximum.
def _clamped(x):
    return mx.clip(x, -87.0, 88.0)


def _clamped_below(x):
    return mx.maximum(x, -87.0)


# Compiled for fixed shapes: MLX's shapeless CPU kernels ran these twice as
# slowly, and cannot contain a view. ``exp`` pads its input to one of a few
# sizes so that a new shape (a trace of milliseconds) is rare. Each compiled function
# below becomes one or two generated SSE loops (the view splits them).
_reduce_c = mx.compile(_reduce)
_exp_c = mx.compile(lambda t_bits, r: _two_to_the(t_bits) * _exp_small(r))
_swiglu_c = mx.compile(lambda exp_neg_gate, gate, up: (gate * up) / (1.0 + exp_neg_gate))


def _bucket(n: int) -> int:
    """The smallest of 1024 * {8..15}/8 * 2**j that holds ``n`` (<= 12.5% padding)."""
    size = 1024
    while size * 2 <= n:
        size *= 2
    step = size // 8
    return size + -(-(n - size) // step) * step if n > size else size


def exp(x: mx.array) -> mx.array:
    """float32 ``exp(x)`` for softmax-like inputs (see the module docstring)."""
    return _exp(x, _clamped)


def _exp_of_nonpositive(x: mx.array) -> mx.array:
    """``exp`` of scores minus their row max (<= 0, -inf or NaN), which
    need clamping from below only."""
    return _exp(x, _clamped_below)


def _exp(x, clamp):
    flat = x.astype(mx.float32).reshape(-1)
    n = flat.size
    size = _bucket(n)
    if size > n:  # a prefill chunk's scores often fill a bucket: no copy then
        flat = mx.pad(flat, (0, size - n))
    t, r = _reduce_c(clamp(flat))
    e = _exp_c(mx.view(t, mx.int32), r)
    return (e[:n] if size > n else e).reshape(x.shape)


# Up to this many elements (a decode step's MLP row), one kernel with MLX's
# own sigmoid (slow per element) beats the ~10 small kernels below (a few
# microseconds of scheduling each, on the host and on the CPU stream).
_FEW = 4096


@mx.compile
def _swiglu_mlx(gate, up):
    g = gate.astype(mx.float32)
    return (g * mx.sigmoid(g) * up.astype(mx.float32)).astype(gate.dtype)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` in ``gate``'s dtype, computed in float32 (a step's
    activations take few shapes, so no padding)."""
    if gate.size <= _FEW:
        return _swiglu_mlx(gate, up)
    g, u = gate.astype(mx.float32), up.astype(mx.float32)
    t, r = _reduce_c(_clamped(-g))
    # Two kernels, not one: fused, the chain is too deep for one generated
    # loop and MLX splits it into a strided, scalar one.
    exp_neg_gate = _exp_c(mx.view(t, mx.int32), r)
    return _swiglu_c(exp_neg_gate, g, u).astype(gate.dtype)


# Up to this many scores (a decode step's, up to ~900 cached positions of a
# 9-head model), MLX's one softmax kernel takes no longer than the ~15 small
# kernels of the exp route, and a quarter of their host time.
_FEW_SCORES = 8192


def attention(q, k, v, scale: float, mask=None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` with this module's ``exp``.

    Args:
        q: ``[B, Hq, T, D]`` queries; ``k``, ``v``: ``[B, Hkv, S, D]``, with
            ``Hq`` a multiple of ``Hkv`` (grouped-query heads share a kv head).
        mask: None, ``"causal"`` (the T queries are the last T of the S
            positions), a boolean array broadcastable to ``[B, Hq, T, S]``
            (True where a query may attend), or an additive one.

    Scores are computed in the inputs' dtype and normalised in float32, as
    MLX's own fallback does.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    # The query heads sharing a kv head are rows of one product with it
    # ([B, Hkv, rep*T, D] by [B, Hkv, D, S]): no broadcast copy of K or V,
    # and one BLAS call per kv head.
    q = (_scaled(scale)(q) if q.size <= _FEW else q * scale).reshape(B, Hkv, rep * T, D)
    scores = (q @ k.swapaxes(-1, -2)).astype(mx.float32)
    if isinstance(mask, str):  # one query row (a decode step) sees every key
        mask = None if T == 1 else mx.arange(S)[None, :] <= mx.arange(S - T, S)[:, None]
    if mask is not None:
        mask = _grouped(mask, Hkv, rep)
        if mask.dtype == mx.bool_:
            # Added as 0/-inf rather than selected with where: an add that
            # broadcasts the mask runs ~3x faster than MLX's where.
            mask = mx.where(mask, 0.0, -mx.inf)
        scores = scores.reshape(B, Hkv, rep, T, S) + mask.astype(mx.float32)
        scores = scores.reshape(B, Hkv, rep * T, S)
    if scores.size <= _FEW_SCORES:
        weights = mx.softmax(scores, axis=-1)
        return (weights.astype(v.dtype) @ v).reshape(B, Hq, T, D)
    weights = _exp_of_nonpositive(scores - scores.max(axis=-1, keepdims=True))
    out = (weights.astype(v.dtype) @ v).astype(mx.float32)
    out = out / weights.sum(axis=-1, keepdims=True)
    return out.astype(v.dtype).reshape(B, Hq, T, D)


@functools.cache
def _scaled(scale: float):
    """``q * scale`` as one node (MLX spells a product with a Python float as
    a broadcast of the scalar, then the multiply); traced once per shape, so
    used for a decode step's few queries."""
    return mx.compile(lambda q: q * scale)


def _grouped(mask: mx.array, Hkv: int, rep: int) -> mx.array:
    """A mask broadcastable to ``[B, Hq, T, S]``, laid out like the grouped
    scores ``[B, Hkv, rep, T, S]``."""
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if mask.shape[1] == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(mask.shape[0], Hkv, rep, *mask.shape[2:])


# A decode step's RMSNorm input has one row; a compiled function is traced
# once per input shape, so prefill chunks of every length keep MLX's op.
_FEW_ROWS = 4


@functools.cache
def rms_norm(eps: float):
    """``mx.fast.rms_norm`` (same signature) for the CPU, where MLX runs its
    fallback as ten nodes, a broadcast before every product. For a few fp32
    rows (decode) a compiled version is three: the ops after the reduction
    fuse into one. Other dtypes keep MLX's own promotion rules and checks."""

    def normalise(x):
        return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)

    plain = mx.compile(normalise)
    weighted = mx.compile(lambda x, weight: normalise(x) * weight)

    def compiled_rms_norm(x, weight, eps):
        short = x.ndim > 0 and 0 < x.size <= _FEW_ROWS * x.shape[-1]
        fits = weight is None or (weight.dtype == mx.float32 and weight.shape == x.shape[-1:])
        if x.dtype != mx.float32 or not fits or not short:
            return mx.fast.rms_norm(x, weight, eps)
        return plain(x) if weight is None else weighted(x, weight)

    return compiled_rms_norm
