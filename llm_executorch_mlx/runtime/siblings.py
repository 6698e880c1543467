"""Sibling projections as one product on a GPU: q|k|v, gate|up.

Linear layers that read the same input (a block's q, k and v projections, its
MLP's gate and up) are separate products in an exported program: five GEMV
kernels a decode step where two would do. On a GPU, where decoding is bound
by kernel launches, a Llama-3.2-1B-shaped bf16 step ran ~35% faster with each
group as one product against the concatenated weights (H200, design.md). On
the CPU OpenBLAS was slower on the joined prefill shapes, so only GPUs join.

At load the group's weights ``W [out, in]`` are concatenated along ``out``
once and each member's constant becomes a view of its rows: the weights are
held once, and any other reader of a member's constant sees the same values.
At run time the group's first product computes ``x @ joined^T`` and every
member takes its columns.

A group is the bias-free ``AddmmNode``s of the main chain whose ``mat1`` is
the same slot, unchanged between them, and whose ``mat2`` is a
``TransposeNode`` (perm ``[1, 0]``) of a 2-D constant no chain writes, all
with the same ``in`` size and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .graph import node_name, tensor_fields


@dataclass(frozen=True)
class Member:
    index: int  # the AddmmNode's instruction index in the main chain
    weight: int  # the constant slot of its W [out, in]


@dataclass
class Joined:
    """A group after ``join_weights``: the joined ``[sum(out), in]`` weight
    and each member's rows in it."""

    weight: mx.array
    rows: dict[int, tuple[int, int]]  # instruction index -> (first row, count)


def find_groups(graph) -> list[list[Member]]:
    """Sibling groups of the main chain, each in instruction order."""
    instructions = graph.instructionChains[graph.mainChainIdx].instructions or []
    fixed = _unwritten_constants(graph)
    metas = graph.tensorMeta or []
    writer: dict[int, tuple[str, object]] = {}
    version: dict[int, int] = {}  # slot -> how many times it was written so far
    epoch = 0  # bumped by sub-chain calls, which may write any slot
    candidates: dict[tuple, list[Member]] = {}
    for i, instr in enumerate(instructions):
        name, node = node_name(instr), instr.op
        if name in ("IfNode", "ScanNode"):
            epoch += 1
        elif name == "AddmmNode" and node.bias is None:
            weight = _transposed_constant(writer.get(node.mat2.idx), fixed, metas)
            if weight is not None:
                a = node.mat1.idx
                candidates.setdefault((a, version.get(a, 0), epoch), []).append(Member(i, weight))
        for slot in tensor_fields(node)[1]:
            writer[slot] = (name, node)
            version[slot] = version.get(slot, 0) + 1
    groups = []
    for members in candidates.values():
        kinds = {(tuple(d.value for d in metas[m.weight].shape)[1], metas[m.weight].scalarType) for m in members}
        if len(members) >= 2 and len(kinds) == 1 and len({m.weight for m in members}) == len(members):
            groups.append(members)
    return groups


def join_weights(graph, constants: list[mx.array]) -> dict[int, Joined]:
    """Join each group's weights (``constants`` is updated in place: members
    become views of the joined array); keyed by every member's index."""
    joined: dict[int, Joined] = {}
    for members in find_groups(graph):
        weights = [constants[m.weight] for m in members]
        weight = mx.concatenate(weights, axis=0)
        mx.eval(weight)
        rows, start = {}, 0
        for m, w in zip(members, weights):
            rows[m.index] = (start, w.shape[0])
            constants[m.weight] = weight[start : start + w.shape[0]]
            start += w.shape[0]
        mx.eval([constants[m.weight] for m in members])  # views: no new bytes
        group = Joined(weight, rows)
        for m in members:
            joined[m.index] = group
    return joined


def _unwritten_constants(graph) -> set[int]:
    written = {
        slot
        for chain in graph.instructionChains or []
        for instr in chain.instructions or []
        for slot in tensor_fields(instr.op)[1]
    }
    return set(range(graph.numConstantTensors)) - written


def _transposed_constant(write, fixed: set[int], metas) -> int | None:
    """The constant ``W`` when ``write`` is ``TransposeNode(W, [1, 0])`` of a
    2-D constant no chain writes."""
    if write is None or write[0] != "TransposeNode":
        return None
    node = write[1]
    w = node.x.idx
    perm = [int(p) for p in node.perm] if node.perm is not None else []
    if w not in fixed or perm != [1, 0] or w >= len(metas) or metas[w] is None:
        return None
    return w if len(metas[w].shape or []) == 2 else None
