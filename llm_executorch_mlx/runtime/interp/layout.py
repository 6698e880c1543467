"""Which way round a linear layer's weight is stored for the CPU's BLAS.

An exported linear layer is a constant ``W [out, in]`` that a ``TransposeNode``
turns into the right operand of an ``AddmmNode``. On the CPU, MLX hands that
product to BLAS as one SGEMM; at decode it has one row, so BLAS runs a
matrix-vector product, which streams the weight once and is as fast as its
longest contiguous run. Storing ``W`` row-major makes the ``in`` dimension
contiguous; storing it column-major (``W^T`` contiguous) makes ``out``
contiguous. For MKL's one-row SGEMM and OpenBLAS's SGEMV (which
``cpu/sgemm_route.c`` sends one-row products to) alike, a weight with
``out >= in`` streams faster column-major and the others row-major, so
``for_blas`` stores each that way. This applies only where one-row products do reach
BLAS (the plan's ``stores_for_blas``): with the extension's products in use,
a decode step's products are its ``gemv``, whose dot loops read each output's weights
as one contiguous row, so weights stay row-major as exported
(``program.py``). Many-row products (prefill) run at the same speed either way. Only
the strides change: every reader sees the same logical tensor, so nothing
else in the program needs to know.

Quantized linear weights are the exception: where the extension has integer
dot products, a weight that only quantized matmuls read is stored with its
rows interleaved (``cpu/quantized_interleaved.h``), a different logical
tensor of the same size, which those matmuls' builders know to read
(``interleavable_quantized`` finds them; ``program.py`` converts them). So
is a tied quantized embedding's table, which the LM head multiplies with
and the embedding looks rows up in (``quantized_gather_at``): the lookup
then reads the interleaved rows itself.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

from ..pte._schema import mlx_delegate as md
from ..pte.graph import node_name, tensor_fields


def matmul_weights(graph: md.MLXGraphT) -> set[int]:
    """Constant slots read only as ``W^T`` by a matmul (the linear layers).

    A constant qualifies when a ``TransposeNode`` swaps its two axes and the
    next instruction touching the transpose's output reads it as ``mat2`` of an
    ``AddmmNode``.
    """
    found = set()
    for chain in graph.instructionChains or []:
        instructions = chain.instructions or []
        for i, instr in enumerate(instructions):
            if node_name(instr) != "TransposeNode":
                continue
            n = instr.op
            if n.x.idx >= graph.numConstantTensors or [int(p) for p in n.perm] != [1, 0]:
                continue
            if _next_use_is_mat2(instructions[i + 1 :], n.out.idx):
                found.add(n.x.idx)
    return found


def weights_read_only_by_matmuls_and_gathers(graph: md.MLXGraphT) -> set[int]:
    """The ``matmul_weights`` that nothing else reads but a ``TakeNode``
    gathering rows of it (a tied embedding's table): they may be stored in
    another dtype than the program computes in, for the readers that know
    (the matmul builders; ``TakeNode`` widens what it gathers)."""
    linear = matmul_weights(graph)
    other_reads = set()
    for chain in graph.instructionChains or []:
        for instr in chain.instructions or []:
            name = node_name(instr)
            if name == "TransposeNode":
                continue
            reads, _ = tensor_fields(instr.op)
            if name == "TakeNode":
                reads = reads - {instr.op.x.idx}
            other_reads.update(reads)
    return linear - other_reads


GATHER = ("TakeNode", "TakeNode", "TakeNode", "DequantizeNode")


@dataclass(frozen=True)
class QuantizedGather:
    """Rows of a quantized table looked up by one index and dequantized (an
    embedding): ``GATHER``, the takes' outputs read by nothing else."""

    w: int
    scales: int
    biases: int
    index: int
    group: int
    bits: int
    out: int


def quantized_gather_at(graph: md.MLXGraphT, instructions: list, i: int) -> QuantizedGather | None:
    """The lookup starting at ``instructions[i]`` (of the main chain), or None:
    three ``TakeNode`` s on axis 0 by one index tensor, of the weight, scales
    and biases of one affine dequantization that follows them, their rows read
    by that ``DequantizeNode`` alone."""
    if tuple(node_name(instr) for instr in instructions[i : i + len(GATHER)]) != GATHER:
        return None
    try:
        takes, dq = [instr.op for instr in instructions[i : i + 3]], instructions[i + 3].op
        if any(t.axis != 0 or t.index is None or t.index.kind != 2 for t in takes):
            return None
        index = takes[0].index.tid.idx
        source = {t.out.idx: t.x.idx for t in takes}
        if (any(t.index.tid.idx != index for t in takes) or len(source) != 3 or index in source
                or dq.biases is None or dq.globalScale is not None or _text(dq.mode) != "affine"):
            return None
        w, scales, biases = (source.get(t.idx) for t in (dq.w, dq.scales, dq.biases))
    except (AttributeError, TypeError):
        return None  # malformed: each node's own builder reports it
    if None in (w, scales, biases):
        return None
    maps = (graph.outputMap or []) + (graph.mutableBufferMap or [])
    internal = set(source) - {dq.out.idx}
    if internal & {s.idx for s in maps if s.slotType == md.SlotType.TensorSlot}:
        return None
    if read_before_written(instructions[i + len(GATHER) :], internal):
        return None
    return QuantizedGather(w, scales, biases, index, dq.groupSize, dq.bits, dq.out.idx)


def read_before_written(rest: list, slots: set[int]) -> bool:
    """Whether a later node reads one of ``slots`` before overwriting it."""
    pending = set(slots)
    for instr in rest:
        if not pending:
            return False
        if node_name(instr) in ("IfNode", "ScanNode"):
            return True  # sub-chains may read anything
        reads, writes = tensor_fields(instr.op)
        if pending & reads:
            return True
        pending -= writes
    return False


def interleavable_quantized(graph: md.MLXGraphT, takes) -> dict[int, tuple[int, int, int, int]]:
    """``{w: (scales, biases, group_size, bits)}`` for the constant quantized
    weights that only ``QuantizedMatmulNode`` s the extension's products run
    read (transposed, affine, with biases, of a width and group size
    ``takes(bits, group_size)``),
    always with the same scales, biases and parameters, which nothing else
    reads or writes but the init chain (which may compute the biases from
    the scales, as torchao's exports do, before they are interleaved), and
    lookups of the main chain (``quantized_gather_at``) with those same
    parameters: they may be stored interleaved."""
    readers: dict[int, set] = {}
    plain_reads, written, init_touched = set(), set(), set()
    gathered: dict[int, set] = {}  # w -> the parameters its lookups dequantize with
    for c, chain in enumerate(graph.instructionChains or []):
        lookups = set()  # the takes of this chain's lookups
        instructions = chain.instructions or []
        for i, instr in enumerate(instructions):
            reads, writes = tensor_fields(instr.op)
            if c == graph.initChainIdx:
                init_touched |= reads | writes
                continue
            written |= writes
            gather = quantized_gather_at(graph, instructions, i) if c == graph.mainChainIdx else None
            if gather is not None:
                gathered.setdefault(gather.w, set()).add((gather.scales, gather.biases, gather.group, gather.bits))
                lookups |= {i, i + 1, i + 2}
            if i in lookups:
                continue  # a take of a lookup: its table's reads are the lookup's
            op = instr.op
            if node_name(instr) != "QuantizedMatmulNode" or not (
                op.transpose and op.biases is not None and _text(op.mode) == "affine"
                and takes(op.bits, op.groupSize)
            ):
                plain_reads |= reads
                continue
            triple = (op.scales.idx, op.biases.idx, op.groupSize, op.bits)
            readers.setdefault(op.w.idx, set()).add(triple)
            plain_reads |= reads - {op.w.idx, op.scales.idx, op.biases.idx}
    owners = Counter(slot for triples in readers.values() for t in triples for slot in t[:2])
    found = {}
    for w, triples in readers.items():
        if len(triples) != 1:
            continue
        (t,) = triples
        slots = {w, t[0], t[1]}
        if (len(slots) == 3 and max(slots) < graph.numConstantTensors and not slots & (plain_reads | written)
                and w not in owners and w not in init_touched and owners[t[0]] == owners[t[1]] == 1
                and gathered.get(w, {t}) == {t}):
            found[w] = t
    return found


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def _next_use_is_mat2(rest: list, slot: int) -> bool:
    for instr in rest:
        reads, writes = tensor_fields(instr.op)
        if slot in reads:
            op = instr.op
            return node_name(instr) == "AddmmNode" and op.mat2.idx == slot and op.mat1.idx != slot
        if slot in writes:
            return False
    return False


def for_blas(weight: mx.array) -> mx.array:
    """``weight`` stored the way one-row SGEMM reads it fastest (see above)."""
    if weight.ndim != 2 or weight.dtype != mx.float32:
        return weight  # only float32 matmuls reach BLAS
    rows, cols = weight.shape
    if rows < cols:
        return weight
    return mx.contiguous(weight.T).T
