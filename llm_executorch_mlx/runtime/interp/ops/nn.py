"""Neural-network nodes: addmm, norms, RoPE, attention, convolutions."""

from __future__ import annotations

import mlx.core as mx

from ...errors import PteError
from .table import op


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
    # extension's, run with the host thread's help (runtime/steps.py)
    extension = ctx.plan.products
    gemv = extension.gemv if extension else None
    most = dense_rows(ctx.plan)
    rounds = ctx.plan.rounds_to_bf16  # a bf16 weight's products take x rounded to bf16
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
        """The extension's product, or None where BLAS's is better."""
        bf16_x = rounds and w.dtype == mx.bfloat16
        if few_rows(x_in, w, most):
            return gemv(x, w, bf16_x=bf16_x)
        if w.dtype == mx.bfloat16 and few_rows(x, w, most) and x.size == x.shape[-1]:
            # a long chunk's bf16 LM head row: read as stored (widening would
            # cost more), by the stream thread alone (the host would take a
            # core from BLAS's threads for the rest of the chunk)
            return gemv(x, w, helped=False, bf16_x=bf16_x)
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


def dense_rows(plan) -> dict:
    """``{weight dtype: most rows of x}`` the plan's products take against
    a dense weight (``few_rows``' ``most``)."""
    return {dtype: plan.dense_rows(dtype) for dtype in (mx.float32, mx.bfloat16)}


def few_rows(x, w, most: dict) -> bool:
    """At most ``most[w.dtype]`` fp32 rows against a 2-D fp32 weight of as
    many rows as ``x`` has columns, or a bf16 one kept as stored (program.py);
    anything else (a corrupt program's shapes) is left to MLX's checks.
    ``x`` is taken before any last-row slice, so a long prefill chunk's LM
    head stays a BLAS product: no host thread helps a long chunk. A bf16
    weight meets more rows only when the products are in use, and is then
    widened per call for BLAS."""
    rows = most.get(w.dtype, 0)
    return (x.dtype == mx.float32 and w.ndim == 2 and 0 < x.shape[-1] == w.shape[0]
            and x.size <= rows * x.shape[-1] and x.size == x.shape[-1] * (x.shape[-2] if x.ndim > 1 else 1))


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
    rms_norm = ctx.plan.rms_norm(eps)

    def run(f):
        f[out] = rms_norm(f[x], None if w is None else f[w], eps)

    return run


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
    sdpa = ctx.plan.sdpa()
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
