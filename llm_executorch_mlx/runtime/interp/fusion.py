"""Load-time rewrites of exported patterns into fewer MLX kernels.

**RoPE.** Hugging Face's rotate-half RoPE becomes ``mx.fast.rope``.

Models exported from transformers (``export_llm_hf``) spell rotary embeddings
out as seven nodes per query or key tensor::

    a = x * cos;  x1 = x[..., :h];  x2 = x[..., h:];  r = concat(-x2, x1)
    y = a + r * sin

with ``cos``/``sin`` computed once per call from the position input:
``cos(concat(m, m)) * scale``, ``m = positions * inv_freq``. That is five
kernels per tensor where MLX (and mlx-lm) use one, which matters wherever
decoding is bound by kernel launches (GPUs) or by per-op overhead. A group is
rewritten only when the whole chain is proven: the slices halve the head
dimension, the tables trace back to ``inv_freq`` (a constant) times a
program input (the positions, read on the host like the cache's), both
scales are the same constant, and no later node reads the group's
intermediates. Then ``y = fast.rope(x, offset=positions[0], freqs=1/inv_freq)
* scale``; positions must be consecutive, which the off-graph cache already
requires of every forward call. On the CPU, where ``mx.fast.rope`` is a
dozen small ops, the group is ``_rotate_half`` with tables made on the host,
and for a decode step's single position one product with a rotation matrix;
where the extension's op writes the cache and attends (``plan.py``), a
layer's q and k groups are that op's own first step instead (its tables made
on the host as each call starts: ``ops/attention.py``), two MLX ops a group
fewer.

**SwiGLU.** ``silu(gate)`` then, a few nodes later, ``silu_out * up``: two
kernels for the silu (sigmoid, multiply) and one for the product. When the
multiply is the only reader of the silu's output, the multiply computes
``gate * sigmoid(gate) * up`` in one compiled kernel from the gate stashed at
the silu node (whose own lazy output is then never evaluated), as mlx-lm
does, in the plan's version for this device (``plan.swiglu``).

**Residual adds.** A layer's attention output and MLP output each go
through a linear layer and are added to the residual stream: on the CPU,
where the extension runs that product (a decode step's, a short chunk's),
the product's own op adds the residual once its dot products are done
(``add_to_product``), one MLX node fewer per add (two a layer). The sum is
rounded once, as the add rounds it. Only when the add is the product's one
reader: another would run the product a second time.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from ..errors import PteError
from ..pte._schema import mlx_delegate as md
from ..pte.graph import node_name, tensor_fields
from .layout import read_before_written

GROUP = ("MultiplyNode", "SliceNode", "SliceNode", "NegNode", "ConcatenateNode", "MultiplyNode", "AddNode")
_VIEWS = ("ExpandDimsNode", "AsTypeNode", "ReshapeNode")  # keep values, change layout or dtype
_UNBOUNDED = 1 << 62  # a slice "to the end" is exported as INT64_MAX
_OPAQUE = ("IfNode", "ScanNode")  # sub-chains may read anything


class Rope(NamedTuple):
    """A proven RoPE group: ``out`` = ``x`` rotated over its last ``dims``
    values at the step's positions (``positions``, an input's slot traced
    to its source), by ``run``. On a GPU ``freqs`` are ``mx.fast.rope``'s
    (``1 / inv_freq``) and ``scale`` the tables' own factor; ``tables``
    are the cos and sin slots the group was proven from."""

    run: object
    x: int
    out: int
    dims: int
    positions: int
    freqs: mx.array | None
    scale: float
    tables: tuple[int, int]
    # CPU: the slot of a host array holding each call's cos and sin rows
    # ([2, T, dims / 2], scaled), registered on the first ask
    host_tables: Callable[[], int] | None = None


def try_fuse(ctx, instructions: list, i: int):
    """The fused ``(name, run)`` for a group starting at ``instructions[i]``, or
    None. Called by ``build_chain`` when it reaches ``i``, so the build
    context's write record holds exactly the nodes before the group."""
    rope = plan_rope(ctx, instructions, i)
    return None if rope is None else ("RopeFused", rope.run)


def plan_rope(ctx, instructions: list, i: int) -> Rope | None:
    """The group starting at ``instructions[i]`` as a ``Rope``, or None.
    Traced as of the nodes built so far: a caller ahead of ``i`` must
    check that nothing in between writes its ``tables``."""
    names = tuple(node_name(instr) for instr in instructions[i : i + len(GROUP)])
    if names != GROUP:
        return None
    try:
        return _fuse(ctx, instructions, i)
    except (AttributeError, TypeError, IndexError):
        return None  # a malformed node: its own builder will say what is wrong


def _fuse(ctx, instructions: list, i: int) -> Rope | None:
    ops = [instructions[i + k].op for k in range(len(GROUP))]
    mul_cos, lo, hi, neg, cat, mul_sin, add = ops
    x = lo.x.idx
    axis = _literal(lo.axis)
    if not (
        hi.x.idx == x and axis is not None and _literal(hi.axis) == axis
        and neg.x.idx == hi.out.idx and [t.idx for t in cat.tensors] == [neg.out.idx, lo.out.idx]
        and mul_sin.a.idx == cat.out.idx and {add.a.idx, add.b.idx} == {mul_cos.out.idx, mul_sin.out.idx}
        and x in (mul_cos.a.idx, mul_cos.b.idx)
    ):
        return None
    half = _slice_bounds(lo, hi)
    if half is None:
        return None
    dims = 2 * half
    cos = mul_cos.b.idx if mul_cos.a.idx == x else mul_cos.a.idx
    sin = mul_sin.b.idx
    step = ctx.writes_so_far
    cos_table = _table(ctx, cos, step, "CosNode")
    sin_table = _table(ctx, sin, step, "SinNode")
    if cos_table is None or sin_table is None or cos_table[:2] != sin_table[:2]:
        return None
    positions, inv_freq, cos_scale = cos_table
    if cos_scale != sin_table[2] or inv_freq.size != half:
        return None
    internal = {mul_cos.out.idx, lo.out.idx, hi.out.idx, neg.out.idx, cat.out.idx, mul_sin.out.idx} - {add.out.idx}
    if internal & kept_slots(ctx) or read_before_written(instructions[i + len(GROUP):], internal):
        return None
    position = ctx.host_int_of(positions)
    out, scale = add.out.idx, cos_scale

    def check(X):
        # A valid program can only broadcast x * cos this way with x's last
        # axis the rotated one, of 2 * half entries; say so if it is not.
        if X.shape[-1] != dims or axis not in (-1, X.ndim - 1):
            raise PteError(f"rotary embedding over shape {X.shape} does not rotate {dims} dims of the last axis")

    if ctx.plan.cpu:
        tables = _RopeTables(inv_freq, scale)
        # Layers whose tables are the same values share one per call.
        key = (positions, tables.inv_freq.tobytes(), scale)
        tables.slot = ctx.shared_scratch_slot(("rope",) + key)
        tables.rotation_slot = ctx.shared_scratch_slot(("rope rotation",) + key)

        checked = set()  # (shape, dtype) pairs seen: check once, and whether one position
        # a decode step's rotation, made as the call starts where the position is an input's
        rotation = ctx.host_array(("rope rotation",) + key, lambda f: tables.rotation_at(position(f))) \
            if positions in ctx.input_tids else None

        def run(f):
            X = f[x]
            seen = (X.shape, X.dtype)
            if seen not in checked:
                check(X)
                checked.add(seen)
            if seen[0][-2] == 1 and seen[1] == mx.float32:  # a decode step
                if rotation is None:
                    f[out] = X @ tables.rotation(f, position(f), seen[0])
                else:
                    m = f[rotation]
                    f[out] = X @ mx.broadcast_to(m, (*seen[0][:-2], *m.shape))
                return
            cos_t, sin_t = tables.get(f, position(f), seen[0][-2])
            f[out] = _rotate_half(X, cos_t, sin_t)

        def host_tables() -> int:
            return ctx.host_array(("rope tables",) + key, lambda f: tables.stacked(position(f), f[positions].size))

        return Rope(run, x, out, dims, positions, None, scale, (cos, sin), host_tables if rotation is not None else None)

    freqs = (1.0 / inv_freq.astype(mx.float32)).reshape(-1)
    mx.eval(freqs)
    rope = mx.fast.rope
    offset = ctx.position_array_of(positions)

    def run(f):
        X = f[x]
        check(X)
        at = position(f) if offset is None else f[offset]
        y = rope(X, dims, traditional=False, base=None, scale=1.0, offset=at, freqs=freqs)
        f[out] = y if scale == 1.0 else y * scale

    return Rope(run, x, out, dims, positions, freqs, scale, (cos, sin))


class _RopeTables:
    """cos/sin rows for one call's positions, made once per call and shared
    by every layer that reads the same tables (kept in a frame slot).

    On the CPU, ``mx.fast.rope`` falls back to a dozen small ops with MLX's
    slow ``cos``/``sin`` for every q and k of every layer (a large part
    of a small model's decode step); the angles are the same for all of them. They are computed
    like transformers does (fp32 ``positions * inv_freq``), with numpy's
    ``cos``/``sin`` on the host, where the positions already are.
    """

    def __init__(self, inv_freq: mx.array, scale: float):
        self.inv_freq = np.array(inv_freq.astype(mx.float32)).reshape(-1)
        self.scale = scale
        self.slot = None  # the frame slot holding this call's tables
        self.rotation_slot = None  # and the one holding its rotation matrices

    def _cos_sin(self, start: int, length: int):
        positions = np.arange(start, start + length, dtype=np.float32)
        angles = np.outer(positions, self.inv_freq).astype(np.float64)
        return (
            (np.cos(angles) * self.scale).astype(np.float32),
            (np.sin(angles) * self.scale).astype(np.float32),
        )

    def stacked(self, start: int, length: int) -> mx.array:
        """cos and sin rows for ``length`` positions from ``start``, as one
        float32 array [2, length, half]."""
        return mx.array(np.stack(self._cos_sin(start, length)))

    def get(self, f, start: int, length: int):
        cached = f[self.slot]
        if cached is None or cached[0] != (start, length):
            cos, sin = self._cos_sin(start, length)
            cached = f[self.slot] = ((start, length), mx.array(cos), mx.array(sin))
        return cached[1], cached[2]

    def rotation_at(self, start: int) -> mx.array:
        """``M`` with ``x @ M`` the rotary embedding of a row ``x`` at
        position ``start`` (as ``rotation`` makes it, not broadcast)."""
        (cos,), (sin,) = self._cos_sin(start, 1)
        h = cos.size
        m = np.zeros((2 * h, 2 * h), np.float32)
        k = np.arange(h)
        m[k, k] = m[k + h, k + h] = cos  # y = x * cos + rotate_half(x) * sin,
        m[k + h, k], m[k, k + h] = -sin, sin  # rotate_half(x) = [-x2, x1]
        return mx.array(m)

    def rotation(self, f, start: int, shape) -> mx.array:
        """``M`` with ``x @ M`` the rotary embedding of ``x`` (``shape``, one
        position, ``start``), broadcast over the leading axes so the product
        is a single node: three times faster on the CPU than the five nodes
        of ``_rotate_half``. Each output is one of ``x``'s entries times cos
        plus one times sin, the other products being exact zeros (unless an
        entry is inf or NaN: then its head's outputs are all NaN, where the
        five nodes spoil two of them; attention's scores are lost either
        way)."""
        made = f[self.rotation_slot]  # this call's matrices (one position), by shape
        if made is None:
            made = f[self.rotation_slot] = {}
        key = shape[:-2]
        if key not in made:
            m = self.rotation_at(start)
            made[key] = mx.broadcast_to(m, (*shape[:-2], *m.shape))
        return made[key]


@mx.compile
def _rotate_half(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` for half-width cos/sin tables."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    y = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return y.astype(x.dtype)


def _literal(iov) -> int | None:
    """The value of a static ``IntOrVid`` (or a plain int), None when dynamic."""
    if isinstance(iov, int):
        return iov
    return None if iov is None or iov.isVid else iov.literal


def _slice_bounds(lo, hi) -> int | None:
    """``h`` when ``lo`` is ``[:h]`` and ``hi`` is ``[h:]`` with static bounds."""
    fields = (lo.start, lo.stop, hi.start, hi.stop)
    if any(v is None or v.isVid for v in fields) or lo.step != 1 or hi.step != 1:
        return None
    if lo.start.literal != 0 or hi.stop.literal < _UNBOUNDED or lo.stop.literal != hi.start.literal:
        return None
    return lo.stop.literal


def _through_views(ctx, tid: int, step: int):
    """Follow ``tid`` back through layout/dtype nodes to the node that made it."""
    while True:
        step, (name, node) = ctx.writer_before(tid, step)
        if step is None or name not in _VIEWS:
            return tid, step, name, node
        tid = node.x.idx


def _constant(ctx, tid: int):
    return ctx.constants[tid] if tid < ctx.num_constants else None


def _table(ctx, tid: int, step: int, trig: str):
    """``(positions_tid, inv_freq, scale)`` when ``tid`` is ``trig(concat(m, m)) * scale``
    with ``m = positions * inv_freq``, else None."""
    tid, step, name, node = _through_views(ctx, tid, step)
    scale = 1.0
    if name == "MultiplyNode":
        factor = _constant(ctx, node.b.idx)
        if factor is None or factor.size != 1:
            return None
        scale = float(factor.reshape(-1)[0].item())
        tid, step, name, node = _through_views(ctx, node.a.idx, step)
    if name != trig:
        return None
    tid, step, name, node = _through_views(ctx, node.x.idx, step)
    if name != "ConcatenateNode" or len(node.tensors) != 2 or node.tensors[0].idx != node.tensors[1].idx:
        return None
    tid, step, name, node = _through_views(ctx, node.tensors[0].idx, step)
    if name != "MultiplyNode":
        return None
    for const, other in ((node.b.idx, node.a.idx), (node.a.idx, node.b.idx)):
        inv_freq = _constant(ctx, const)
        if inv_freq is not None:
            source = ctx.host_source_at(other, step)
            if source in ctx.input_tids:
                return source, inv_freq, scale
    return None


def readers_after(instructions: list, start: int, slot: int, kept: set[int]) -> list[int] | None:
    """The nodes after ``start`` that read ``slot`` before it is written
    again; None if a sub-chain may read it or the caller does (``kept``)."""
    found = []
    for j in range(start + 1, len(instructions)):
        if node_name(instructions[j]) in _OPAQUE:
            return None
        reads, writes = tensor_fields(instructions[j].op)
        if slot in reads:
            found.append(j)
        if slot in writes:
            return found
    return None if slot in kept else found


def kept_slots(ctx) -> set[int]:
    """Tensor slots read after a call: the outputs and the mutable buffers."""
    maps = (ctx.graph.outputMap or []) + (ctx.graph.mutableBufferMap or [])
    return {s.idx for s in maps if s.slotType == md.SlotType.TensorSlot}


def plan_swiglu(ctx, instructions: list, i: int):
    """For a ``SiluNode`` at ``i`` whose output only a later ``MultiplyNode``
    reads: ``(silu_run, j, multiply_run)``, the multiply being ``instructions[j]``;
    else None."""
    if node_name(instructions[i]) != "SiluNode":
        return None
    silu = instructions[i].op
    try:
        gate_in, silu_out = silu.x.idx, silu.out.idx
    except AttributeError:
        return None  # malformed: the builder reports it
    for j in range(i + 1, len(instructions)):
        if node_name(instructions[j]) in ("IfNode", "ScanNode"):
            return None
        reads, writes = tensor_fields(instructions[j].op)
        if silu_out in reads:
            break
        if silu_out in writes:
            return None
    else:
        return None
    mul = instructions[j].op
    if node_name(instructions[j]) != "MultiplyNode" or {mul.a.idx, mul.b.idx} == {silu_out}:
        return None
    up = mul.b.idx if mul.a.idx == silu_out else mul.a.idx
    rest = instructions[j + 1 :]
    if mul.out.idx != silu_out and (silu_out in kept_slots(ctx) or read_before_written(rest, {silu_out})):
        return None
    stash, out = ctx.scratch_slot(), mul.out.idx
    swiglu = ctx.plan.swiglu()

    def silu_run(f):
        f[stash] = f[gate_in]  # silu_out is never read: the multiply computes both

    def multiply_run(f):
        f[out] = swiglu(f[stash], f[up])

    return silu_run, j, multiply_run


_PRODUCT_NODES = ("AddmmNode", "QuantizedMatmulNode")  # those the extension's products may run


def plan_residual_add(ctx, instructions: list, i: int):
    """For an ``AddNode`` at ``i`` with an operand that a linear layer's
    product wrote and only this add reads, on the CPU with the extension's
    products: the add's run, which has the product's op add the other operand
    where the extension ran that product (``add_to_product``), else adds as the
    node would (a prefill chunk's BLAS product). None otherwise."""
    extension = ctx.plan.products
    if extension is None or node_name(instructions[i]) != "AddNode":
        return None
    add = instructions[i].op
    try:
        a, b, out = add.a.idx, add.b.idx, add.out.idx
    except AttributeError:
        return None  # malformed: the builder reports it
    if not all(0 <= s < ctx.num_tensors for s in (a, b, out)) or out < ctx.num_constants:
        return None  # out of range, or writing a constant: the builder reports it
    product = next((slot for slot in (a, b) if _product_read_only_here(ctx, instructions, i, slot, out)), None)
    if product is None or a == b:
        return None
    other = b if product == a else a
    add_to_product = extension.add_to_product

    def run(f):
        fused = add_to_product(f[product], f[other])
        f[out] = mx.add(f[a], f[b]) if fused is None else fused

    return run


def _product_read_only_here(ctx, instructions: list, i: int, slot: int, out: int) -> bool:
    """Whether ``slot``'s value is a product node's output that only the
    node at ``i`` reads: none between that writer (in this chain) and ``i``,
    none after ``i`` before it is written again, nor the caller."""
    for j in range(i - 1, -1, -1):
        name = node_name(instructions[j])
        reads, writes = tensor_fields(instructions[j].op)
        if slot in writes:
            if name not in _PRODUCT_NODES:
                return False
            break
        if name in ("IfNode", "ScanNode") or slot in reads:
            return False
    else:
        return False  # an input or a constant: not a product of this step
    if out == slot:
        return True
    return slot not in kept_slots(ctx) and not read_before_written(instructions[i + 1 :], {slot})
