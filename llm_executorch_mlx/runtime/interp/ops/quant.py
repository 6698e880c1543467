"""Quantized and gathered matmuls, and dequantization."""

from __future__ import annotations

import mlx.core as mx

from ...errors import PteError
from ...gpu.decode import Block, MadeAtFirstCall, Weight
from ...plan import MLX_QMM_ROWS, Layout
from ..layout import quantized_gather_at
from .shape import text
from .table import op

# What MLX's quantized kernels run, by mode: (group sizes, bits). They check
# none of it, and divide by the bits and the group size: a corrupt file's 0
# killed the process (SIGFPE), so anything else is refused at load.
MLX_QUANTIZATION = {
    "affine": ((32, 64, 128), (1, 2, 3, 4, 5, 6, 8)),
    "mxfp4": ((32,), (4,)),
    "mxfp8": ((32,), (8,)),
    "nvfp4": ((16,), (4,)),
}


def _quantization(n, ctx) -> tuple[int, int, str]:
    """A node's ``(group_size, bits, mode)``, refused unless MLX runs it."""
    group_size, bits, mode = n.groupSize, n.bits, text(n.mode)
    groups, widths = MLX_QUANTIZATION.get(mode or "affine", ((), ()))
    if group_size not in groups or bits not in widths:
        raise PteError(
            f"{ctx.current_node}: {bits}-bit {mode!r} quantization in groups of {group_size} "
            "is not one MLX runs: corrupt file?"
        )
    return group_size, bits, mode


def _check_weight(ctx, w, scales, biases, group_size: int, bits: int) -> None:
    """A constant quantized weight's scales (and biases) must cover it, one per
    group of each row: MLX's kernels divide by their shapes unchecked."""
    ws, ss = ctx.fixed_constant(w), ctx.fixed_constant(scales)
    bs = None if biases is None else ctx.fixed_constant(biases)
    if ws is None or ss is None:
        return  # computed at run time: MLX's own checks only
    k = ws.shape[-1] * 32 // bits if ws.ndim else 0
    want = (*ws.shape[:-1], k // group_size) if ws.ndim else None
    if (want is None or k == 0 or k % group_size or tuple(ss.shape) != want
            or (bs is not None and bs.shape != ss.shape)):
        raise PteError(
            f"{ctx.current_node}: a {bits}-bit weight of shape {tuple(ws.shape)} in groups of {group_size} "
            f"needs scales{'' if bs is None else ' and biases'} of shape {want}, not {tuple(ss.shape)}"
            f"{'' if bs is None else f' and {tuple(bs.shape)}'}: corrupt file?"
        )


class GemvOperands:
    """Whether the extension's quantized GEMV reads a weight (cpu/gemv.cpp's
    ``check_quantized``): what it would refuse (a corrupt program's shapes)
    goes to MLX's ops instead, whose checks name the problem. A product's
    weight, scales and biases are the same arrays every step, so they are
    checked once for each triple seen. A weight held in another ``layout``
    than MLX's was checked when it was converted at load (``program.py``):
    its ``K`` is read from its shape (its scales may be fp16 there)."""

    def __init__(self, group_size: int, bits: int, layout: Layout = Layout.MLX):
        self.group_size, self.bits, self.layout = group_size, bits, layout
        self._seen = (None, None, None, 0)

    def k(self, w, scales, biases) -> int:
        """The ``K`` (x's last axis) the GEMV takes with this weight; 0 where
        it cannot read it."""
        seen = self._seen
        if seen[0] is w and seen[1] is scales and seen[2] is biases:
            return seen[3]
        k = self._k(w, scales, biases)
        self._seen = (w, scales, biases, k)
        return k

    def _k(self, w, scales, biases) -> int:
        group_size, bits = self.group_size, self.bits
        if self.layout is not Layout.MLX:
            return w.shape[1] * 32 // bits
        if (w.dtype != mx.uint32 or w.ndim != 2 or scales.dtype != mx.float32
                or biases is None or biases.dtype != mx.float32):
            return 0
        k = w.shape[1] * 32 // bits
        if (k == 0 or k % group_size or k % (256 // bits) or scales.shape != (w.shape[0], k // group_size)
                or biases.shape != scales.shape):
            return 0
        return k


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
    return _quantized_matmul(n, ctx, last_row=False)


def build_quantized_matmul_last_row(n, ctx):
    """``QuantizedMatmulNode`` on the last row of ``x`` only (a quantized LM
    head; see ``GraphExecutor``'s ``last_position_only``)."""
    return _quantized_matmul(n, ctx, last_row=True)


def _quantized_matmul(n, ctx, last_row: bool):
    """On the CPU, MLX's ``quantized_matmul`` is scalar code: a few rows
    (decode, a chat turn's short chunk) run as the extension's products,
    reading the weights as stored; more rows dequantize the weight and use
    BLAS, whose cost the rows share. How many is the plan's."""
    x, w, scales, out = ctx.t(n.x), ctx.t(n.w), ctx.t(n.scales), ctx.out(n.out)
    biases = ctx.t_opt(n.biases)
    transpose = bool(n.transpose)
    group_size, bits, mode = _quantization(n, ctx)
    _check_weight(ctx, w, scales, biases, group_size, bits)
    qmm = mx.quantized_matmul
    plan = ctx.plan
    if not (plan.cpu and transpose and mode == "affine" and biases is not None):
        kernel = _product_kernel(n, ctx)

        def run(f):  # the decode hot path: no helper calls
            xs = f[x]
            if last_row and xs.shape[-2] > 1:
                xs = xs[..., -1:, :]
            if kernel is not None:
                block, launch = kernel.get(f)
                if block is not None and block.takes(xs):
                    f[out] = launch(xs)[0]
                    return
            f[out] = qmm(
                xs, f[w], f[scales], None if biases is None else f[biases],
                transpose, group_size, bits, mode,
            )

        return run
    if n.w.idx in ctx.layouts:
        return _interleaved_matmul(plan, x, w, scales, biases, out, group_size, bits, last_row,
                                   ctx.current_node, ctx.layouts[n.w.idx])
    extension = plan.products if plan.takes_quantized(bits, group_size) else None
    gemv, dequantize = (extension.quantized_gemv, extension.dequantize) if extension else (None, None)
    most = plan.quantized_rows(Layout.MLX)
    operands = GemvOperands(group_size, bits)

    def run(f):
        xs, ws, s, b = f[x], f[w], f[scales], f[biases]
        k = xs.shape[-1]
        ours = gemv is not None and xs.dtype == mx.float32 and operands.k(ws, s, b) == k
        m = xs.size // k
        if last_row and m > 1:
            # a chunk's LM head, its last row only; a long chunk's without the
            # host's help, which would take a core from BLAS (steps.py)
            last = xs[..., -1:, :]
            if ours and m <= most and last.size == k:
                f[out] = gemv(last, ws, s, b, group_size, bits)
            else:
                f[out] = qmm(last, ws, s, b, True, group_size, bits, mode)
        elif ours:
            # the GEMV takes rows in the last two axes only
            f[out] = (gemv(xs, ws, s, b, group_size, bits)
                      if m <= most and (xs.ndim <= 2 or m == xs.shape[-2])
                      else xs @ dequantize(ws, s, b, group_size, bits).T)
        else:
            f[out] = (qmm(xs, ws, s, b, True, group_size, bits, mode) if m <= MLX_QMM_ROWS
                      else xs @ mx.dequantize(ws, s, b, group_size, bits, mode).T)

    return run


def _product_kernel(n, ctx) -> MadeAtFirstCall | None:
    """The plan's decode kernel (``plan.decode_blocks``) for the one
    product no decode block takes (a quantized LM head), in the calls the
    blocks take (a step's row, a verifying call's few): MLX's
    ``quantized_matmul`` reads the weights at a fraction of the bandwidth
    for one row, and once a row for several. None off that route or for
    operands that are not constant."""
    runner, read = ctx.plan.decode_blocks, constant_weight(ctx, n)
    if runner is None or read is None:
        return None
    return MadeAtFirstCall(runner, lambda f: Block((read(f),)))


def constant_weight(ctx, n):
    """``read(f) -> Weight`` for a transposed affine product whose operands
    are constant slots (at most filled by the init chain), else None."""
    if not n.transpose or n.biases is None or text(n.mode) not in ("", "affine"):
        return None
    if ctx.fixed_constant(n.w.idx) is None or any(s.idx >= ctx.num_constants for s in (n.scales, n.biases)):
        return None
    w, s, b, bits, group = n.w.idx, n.scales.idx, n.biases.idx, n.bits, n.groupSize
    return lambda f: Weight(f[w], f[s], f[b], bits, group)


def _interleaved_matmul(plan, x, w, scales, biases, out, group_size, bits, last_row, where, layout):
    """A weight held in another ``layout`` than MLX's (``program.py``) is
    read by the extension alone: its products up to the plan's rows for the
    layout, and for more rows its dequantized transpose (``[K, N]``) with
    BLAS. Another x dtype computes in fp32. ``where`` names the node in the
    error an x of the wrong width gets."""
    extension = plan.products
    gemv, dequantize = extension.quantized_gemv, extension.dequantize
    most, int8 = plan.quantized_rows(layout), layout is Layout.INT8
    operands = GemvOperands(group_size, bits, layout)

    def run(f):
        xs, ws, s, b = f[x], f[w], f[scales], f[biases]
        k = operands.k(ws, s, b)
        if xs.ndim == 0 or xs.shape[-1] != k:
            raise PteError(f"{where}: x of shape {tuple(xs.shape)} against a {bits}-bit weight of {k} columns: "
                           "corrupt file?")
        dtype = xs.dtype
        if dtype != mx.float32:
            xs = xs.astype(mx.float32)
        m = xs.size // xs.shape[-1]
        if last_row and m > 1:
            xs = xs[..., -1:, :]
            m = xs.size // xs.shape[-1]
        if m > most:
            y = xs @ dequantize(ws, s, b, group_size, bits, interleaved=True)
        elif xs.ndim > 2 and m != xs.shape[-2]:  # rows in more axes than the last two: the GEMV's view
            y = gemv(xs.reshape(m, xs.shape[-1]), ws, s, b, group_size, bits, interleaved=True, int8=int8)
            y = y.reshape(*xs.shape[:-1], y.shape[-1])
        else:
            y = gemv(xs, ws, s, b, group_size, bits, interleaved=True, int8=int8)
        f[out] = y if dtype == mx.float32 else y.astype(dtype)

    return run


@op("DequantizeNode")
def build_dequantize(n, ctx):
    w, scales, out = ctx.t(n.w), ctx.t(n.scales), ctx.out(n.out)
    biases, global_scale = ctx.t_opt(n.biases), ctx.t_opt(n.globalScale)
    group_size, bits, mode = _quantization(n, ctx)
    _check_weight(ctx, w, scales, biases, group_size, bits)
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
    # MLX's CPU GatherMM runs float32 only: half operands are widened for
    # it (products summed in fp32, as a GPU does) and the result rounded back.
    widen = ctx.plan.cpu

    def run(f):
        x, y = f[a], f[b]
        dtype = x.dtype
        if widen and dtype in (mx.float16, mx.bfloat16):
            x, y = x.astype(mx.float32), y.astype(mx.float32)
        product = mx.gather_mm(x, y, _opt(f, lhs), _opt(f, rhs), sorted_indices=is_sorted(f))
        f[out] = product if product.dtype == dtype else product.astype(dtype)

    return run


@op("GatherQmmNode")
def build_gather_qmm(n, ctx):
    x, w, scales, out = ctx.t(n.x), ctx.t(n.w), ctx.t(n.scales), ctx.out(n.out)
    biases = ctx.t_opt(n.biases)
    lhs, rhs = ctx.t_opt(n.lhsIndices), ctx.t_opt(n.rhsIndices)
    transpose = bool(n.transpose)
    group_size, bits, mode = _quantization(n, ctx)
    _check_weight(ctx, w, scales, biases, group_size, bits)
    is_sorted = _sorted_flag(n, ctx)

    def run(f):
        f[out] = mx.gather_qmm(
            f[x], f[w], f[scales], _opt(f, biases), _opt(f, lhs), _opt(f, rhs),
            transpose, group_size, bits, mode, sorted_indices=is_sorted(f),
        )

    return run


def plan_quantized_gather(ctx, instructions: list, i: int):
    """``("QuantizedGather", run)`` for an embedding's lookup at ``i``
    (``layout.quantized_gather_at``) in a table stored interleaved because the
    LM head multiplies with it (``program.py``): the extension reads the rows
    from that layout (``take_interleaved``) in place of the three takes and
    the dequantize, which would read it as MLX's. Else None."""
    if not ctx.layouts:
        return None
    gather = quantized_gather_at(ctx.graph, instructions, i)
    if gather is None or gather.w not in ctx.layouts:
        return None
    take = ctx.plan.products.take_interleaved
    w, scales, biases, group, bits = gather.w, gather.scales, gather.biases, gather.group, gather.bits
    int8 = ctx.layouts[w] is Layout.INT8
    index, dq = ctx.t(instructions[i].op.index.tid), instructions[i + 3].op
    out = ctx.out(dq.out)
    dtype = None if dq.dtype is None else ctx.dtype(dq.dtype)
    cast = dtype is not None and dtype != mx.float32

    def run(f):
        y = take(f[w], f[scales], f[biases], f[index], group, bits, int8=int8, stream=mx.cpu)
        f[out] = y.astype(dtype) if cast else y

    return "QuantizedGather", run
