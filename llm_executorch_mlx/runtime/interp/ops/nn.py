"""Neural-network nodes: addmm, norms, RoPE, attention, convolutions."""

from __future__ import annotations

import functools

import mlx.core as mx

from ...cpu.fastmath import attention
from ...dtypes import on_cpu
from ...errors import PteError
from .table import op

# Most rows of x the extension's dense GEMV takes (cpu/gemv.cpp's kDenseRows):
# a decode step's one, a chat turn's short chunk, a prefill chunk of the
# exports' default size. BLAS's sgemm repacks the whole weight for every
# call, which costs a few-row product as much as a 128-row one, and needs a
# bf16 weight widened first; the GEMV reads it once as stored (fp32 or bf16),
# shared with the host thread (benchmarks/bench_rows.py: bf16 BLAS / ours
# 1.2-2 at 128 rows). Against an fp32 weight it depends on the machine:
# fp32_gemv_rows.
DENSE_GEMV_ROWS = 128


def fp32_gemv_rows(kernels) -> int:
    """Most rows of x the dense GEMV takes against an fp32 weight in a program
    run with ``kernels`` (whose GEMV is on): up to where BLAS's sgemm is
    faster on this machine (``cpu/crossover.py``), all it can take until
    that is measured."""
    return min(kernels.fp32_gemv_rows or DENSE_GEMV_ROWS, DENSE_GEMV_ROWS)


@op("AddmmNode")
def build_addmm(n, ctx):
    return _addmm(n, ctx, lambda x: x)


def build_addmm_last_row(n, ctx):
    """``AddmmNode`` on the last row of ``mat1`` only (see
    ``GraphExecutor``'s ``last_position_only``)."""
    # A decode step has one row already: no slice node in its graph.
    return _addmm(n, ctx, lambda x: x if x.shape[-2] == 1 else x[..., -1:, :])


def _addmm(n, ctx, rows):
    a, b, out = ctx.t(n.mat1), ctx.t(n.mat2), ctx.out(n.out)
    bias = ctx.t_opt(n.bias)
    # on the CPU, a decode step's or a short chunk's products may be the
    # extension's GEMV, run with the host thread's help (runtime/steps.py)
    kernels = ctx.kernels
    extension = kernels.extension if kernels is not None and kernels.gemv.on else None
    gemv = extension.gemv if extension else None
    fp32_rows = fp32_gemv_rows(kernels) if extension else DENSE_GEMV_ROWS
    alpha, beta = float(n.alpha), float(n.beta)

    def as_x(w, x):
        """``w`` in ``x``'s dtype for BLAS: a bf16 weight kept as stored is
        widened by the extension, rows as stored (``w`` is their transpose)."""
        if w.dtype == x.dtype:
            return w
        if extension and w.dtype == mx.bfloat16 and x.dtype == mx.float32 and w.ndim == 2:
            return extension.widen_bf16(w.T).T
        return w.astype(x.dtype)

    def product(x_in, x, w):
        """The GEMV's product, or None where BLAS's is better."""
        if few_rows(x_in, w, fp32_rows):
            return gemv(x, w)
        if w.dtype == mx.bfloat16 and few_rows(x, w) and x.size == x.shape[-1]:
            # a long chunk's bf16 LM head row: read as stored (widening would
            # cost more), by the stream thread alone (the host would take a
            # core from BLAS's threads for the rest of the chunk)
            return gemv(x, w, helped=False)
        return None

    if bias is None:  # alpha is ignored without a bias, as in ExecuTorch
        batched = _BatchedWeight()

        def run(f):
            x, w = rows(f[a]), f[b]
            y = product(f[a], x, w) if gemv else None
            f[out] = batched.matmul(x, as_x(w, x)) if y is None else y

        return run

    def run(f):
        x, w = rows(f[a]), f[b]
        y = product(f[a], x, w) if gemv and alpha == beta == 1.0 else None
        f[out] = mx.addmm(f[bias], x, as_x(w, x), alpha, beta) if y is None else y + f[bias]

    return run


def few_rows(x, w, fp32_rows: int | None = None) -> bool:
    """At most ``DENSE_GEMV_ROWS`` fp32 rows (``fp32_rows`` against an fp32
    weight, where given) against a 2-D fp32 weight of as
    many rows as ``x`` has columns, or a bf16 one kept as stored (program.py);
    anything else (a corrupt program's shapes) is left to MLX's checks.
    ``x`` is taken before any last-row slice, so a long prefill chunk's LM
    head stays a BLAS product: no host thread helps a long chunk. A bf16 weight meets more rows only when this
    GEMV is in use, and is then widened per call for BLAS."""
    rows = DENSE_GEMV_ROWS if fp32_rows is None or w.dtype != mx.float32 else min(fp32_rows, DENSE_GEMV_ROWS)
    return (x.dtype == mx.float32 and w.dtype in _GEMV_WEIGHTS and w.ndim == 2 and 0 < x.shape[-1] == w.shape[0]
            and x.size <= rows * x.shape[-1] and x.size == x.shape[-1] * (x.shape[-2] if x.ndim > 1 else 1))


_GEMV_WEIGHTS = (mx.float32, mx.bfloat16)


class _BatchedWeight:
    """``x @ w`` for ``x`` of shape ``[1, T, K]`` and a 2-D ``w``, as one node
    (on any device).

    MLX spells a 3-D by 2-D product as flatten, matmul, unflatten: three
    nodes, each with a few microseconds of scheduling in every CPU decode
    step. Against ``w`` viewed as ``[1, K, N]`` it is a single batched matmul
    with the same one BLAS call. The view of the last ``w`` seen (a linear
    layer's weight is the same array in every call) is kept, so it is made
    once; another ``w`` just gets its own view.
    """

    def __init__(self):
        self._seen = None  # (w, w viewed as [1, K, N])

    def matmul(self, x, w):
        if x.ndim != 3 or w.ndim != 2 or x.shape[0] != 1:
            return mx.matmul(x, w)
        seen = self._seen
        if seen is None or seen[0] is not w:
            seen = self._seen = (w, mx.expand_dims(w, 0))
        return mx.matmul(x, seen[1])


@op("RMSNormNode")
def build_rms_norm(n, ctx):
    x, w, out, eps = ctx.t(n.x), ctx.t_opt(n.weight), ctx.out(n.out), float(n.eps)
    rms_norm = mx.fast.rms_norm
    if on_cpu():
        extension = ctx.kernels.extension if ctx.kernels is not None else None
        rms_norm = _cpu_rms_norm(eps) if extension is None else _extension_rms_norm(extension, eps)

    def run(f):
        f[out] = rms_norm(f[x], None if w is None else f[w], eps)

    return run


_FEW_ROWS = 4  # a decode step's RMSNorm input has one


@functools.cache
def _cpu_rms_norm(eps: float):
    """``mx.fast.rms_norm`` (same signature) for the CPU, where MLX runs its
    fallback as ten nodes, a broadcast before every product. For a few fp32
    rows (decode) a compiled version is three: the ops after the reduction
    fuse into one. Only there: other dtypes keep MLX's own promotion rules
    and checks, and a compiled function is traced once per input shape, so
    prefill chunks of every length keep the fallback."""

    def normalise(x):
        return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)

    plain = mx.compile(normalise)
    weighted = mx.compile(lambda x, weight: normalise(x) * weight)

    def rms_norm(x, weight, eps):
        short = x.ndim > 0 and 0 < x.size <= _FEW_ROWS * x.shape[-1]
        fits = weight is None or (weight.dtype == mx.float32 and weight.shape == x.shape[-1:])
        if x.dtype != mx.float32 or not fits or not short:
            return mx.fast.rms_norm(x, weight, eps)
        return plain(x) if weight is None else weighted(x, weight)

    return rms_norm


def _extension_rms_norm(extension, eps: float):
    """``mx.fast.rms_norm`` (same signature) as the extension's one op for
    fp32 rows and weight, of any count; MLX's own op otherwise, so other
    dtypes keep its promotion rules and checks."""
    fallback = _cpu_rms_norm(eps)

    def rms_norm(x, weight, eps):
        if x.dtype == mx.float32 and x.ndim > 0 and x.size and (
                weight is None or (weight.dtype == mx.float32 and weight.shape == x.shape[-1:])):
            return extension.rms_norm(x, weight, eps)
        return fallback(x, weight, eps)

    return rms_norm


@op("LayerNormNode")
def build_layer_norm(n, ctx):
    x, out, eps = ctx.t(n.x), ctx.out(n.out), float(n.eps)
    w, b = ctx.t_opt(n.weight), ctx.t_opt(n.bias)
    layer_norm = mx.fast.layer_norm

    def run(f):
        f[out] = layer_norm(f[x], None if w is None else f[w], None if b is None else f[b], eps)

    return run


@op("RopeNode")
def build_rope(n, ctx):
    if n.offset is None:
        raise PteError(f"{ctx.current_node}: offset is missing")
    x, out, freqs = ctx.t(n.x), ctx.out(n.out), ctx.t_opt(n.freqs)
    # A Vid slot holds an int and a Tid slot an array: mx.fast.rope takes
    # either, like the two C++ overloads.
    offset = ctx.v(n.offset.vid) if n.offset.isVid else ctx.t(n.offset.tid)
    dims, traditional, scale = n.dims, bool(n.traditional), float(n.scale)
    base = None if freqs is not None else float(n.base)  # MLX takes one of the two
    rope = mx.fast.rope

    def run(f):
        f[out] = rope(
            f[x], dims, traditional=traditional, base=base, scale=scale,
            offset=f[offset], freqs=None if freqs is None else f[freqs],
        )

    return run


@op("SdpaNode")
def build_sdpa(n, ctx):
    q, k, v, out = ctx.t(n.q), ctx.t(n.k), ctx.t(n.v), ctx.out(n.out)
    mask, scale = ctx.t_opt(n.mask), float(n.scale)
    sdpa = attention if on_cpu() else mx.fast.scaled_dot_product_attention
    if mask is None:
        mode = "causal" if n.causal else None

        def run(f):
            f[out] = sdpa(f[q], f[k], f[v], scale=scale, mask=mode)

        return run
    if n.causal:
        raise PteError(f"{ctx.current_node}: causal and an explicit mask together (MLX takes one)")

    def run(f):
        Q, M = f[q], f[mask]
        if M.dtype != mx.bool_ and M.dtype != Q.dtype:  # additive masks follow Q
            M = M.astype(Q.dtype)
        f[out] = sdpa(Q, f[k], f[v], scale=scale, mask=M)

    return run


def _conv(fn, axes: str, transposed: bool):
    """A builder for one convolution node; ``axes`` names the field suffixes
    (``""`` for 1D's plain ``stride``, ``"HW"`` for ``strideH, strideW``)."""
    fields = ("stride", "padding", "dilation") + (("outputPadding",) if transposed else ())

    def param(n, field):
        if not axes:
            return getattr(n, field)
        return tuple(getattr(n, field + a) for a in axes)

    def build(n, ctx):
        x, w, out = ctx.t(n.x), ctx.t(n.w), ctx.out(n.out)
        args = [param(n, p) for p in fields] + [n.groups]

        def run(f):
            f[out] = fn(f[x], f[w], *args)

        return run

    return build


op("Conv1DNode")(_conv(mx.conv1d, "", transposed=False))
op("Conv2DNode")(_conv(mx.conv2d, "HW", transposed=False))
op("Conv3DNode")(_conv(mx.conv3d, "DHW", transposed=False))
op("ConvTranspose1DNode")(_conv(mx.conv_transpose1d, "", transposed=True))
op("ConvTranspose2DNode")(_conv(mx.conv_transpose2d, "HW", transposed=True))
op("ConvTranspose3DNode")(_conv(mx.conv_transpose3d, "DHW", transposed=True))
