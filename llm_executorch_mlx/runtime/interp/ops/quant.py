"""Quantized and gathered matmuls, and dequantization."""

from __future__ import annotations

import mlx.core as mx

from .table import op
from .shape import text


def _opt(f, slot):
    return None if slot is None else f[slot]


def _sorted_flag(n, ctx):
    """``f -> bool``: the runtime ``sorted_indices_flag`` when present (nonzero
    = sorted), else the static ``sorted_indices``."""
    flag = n.sortedIndicesFlag
    if flag is None or not flag.isVid:
        value = bool(n.sortedIndices if flag is None else ctx.static_int(flag))
        return lambda f: value
    slot = ctx.int_(flag)
    return lambda f: f[slot] != 0


@op("QuantizedMatmulNode")
def build_quantized_matmul(n, ctx):
    x, w, scales, out = ctx.t(n.x), ctx.t(n.w), ctx.t(n.scales), ctx.out(n.out)
    biases = ctx.t_opt(n.biases)
    transpose, group_size, bits, mode = bool(n.transpose), n.groupSize, n.bits, text(n.mode)
    qmm = mx.quantized_matmul

    def run(f):  # the decode hot path: no helper calls
        f[out] = qmm(
            f[x], f[w], f[scales], None if biases is None else f[biases],
            transpose, group_size, bits, mode,
        )

    return run


@op("DequantizeNode")
def build_dequantize(n, ctx):
    w, scales, out = ctx.t(n.w), ctx.t(n.scales), ctx.out(n.out)
    biases, global_scale = ctx.t_opt(n.biases), ctx.t_opt(n.globalScale)
    group_size, bits, mode = n.groupSize, n.bits, text(n.mode)
    dtype = None if n.dtype is None else ctx.dtype(n.dtype)

    def run(f):
        f[out] = mx.dequantize(
            f[w], f[scales], _opt(f, biases), group_size, bits, mode,
            _opt(f, global_scale), dtype,
        )

    return run


@op("GatherMmNode")
def build_gather_mm(n, ctx):
    a, b, out = ctx.t(n.a), ctx.t(n.b), ctx.out(n.out)
    lhs, rhs = ctx.t_opt(n.lhsIndices), ctx.t_opt(n.rhsIndices)
    is_sorted = _sorted_flag(n, ctx)

    def run(f):
        f[out] = mx.gather_mm(
            f[a], f[b], _opt(f, lhs), _opt(f, rhs), sorted_indices=is_sorted(f)
        )

    return run


@op("GatherQmmNode")
def build_gather_qmm(n, ctx):
    x, w, scales, out = ctx.t(n.x), ctx.t(n.w), ctx.t(n.scales), ctx.out(n.out)
    biases = ctx.t_opt(n.biases)
    lhs, rhs = ctx.t_opt(n.lhsIndices), ctx.t_opt(n.rhsIndices)
    transpose, group_size, bits, mode = bool(n.transpose), n.groupSize, n.bits, text(n.mode)
    is_sorted = _sorted_flag(n, ctx)

    def run(f):
        f[out] = mx.gather_qmm(
            f[x], f[w], f[scales], _opt(f, biases), _opt(f, lhs), _opt(f, rhs),
            transpose, group_size, bits, mode, sorted_indices=is_sorted(f),
        )

    return run
