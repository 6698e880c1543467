"""Linear layers that read the same input run as one matrix product.

An attention block's q, k and v projections all read the normed hidden
state, and so do an MLP's gate and up. Exported, each is
``TransposeNode(W) -> AddmmNode(x, W^T)``: a kernel launch per projection on
a GPU, where decoding is bound by launches, and a BLAS call per projection on
the CPU, where the narrow k/v products stream at MKL's worst rate. When the
program proves it safe, the weights are concatenated at load
(``[Wq; Wk; Wv]``, held in the first weight's constant slot; the others are
dropped) and the group's first ``AddmmNode`` computes every output at once;
each member then takes its own columns of that product, at its own place in
the program. This is done on the CPU only: on an H200 (1B bf16) it
measured no faster (0.97x of ungrouped decode, within the noise).

Proven for a group: each weight is a 2-D constant that nothing but its
``TransposeNode`` reads; each transpose's output is read by its matmul alone;
the matmuls take the same input slot and no bias; the weights share their
input width and dtype; and nothing writes the input slot (nor runs a
sub-chain) between the first matmul and the last.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ._schema import mlx_delegate as md
from .graph import node_name, tensor_fields

_SUBCHAINS = ("IfNode", "ScanNode")


@dataclass(frozen=True)
class Member:
    transpose: int  # instruction index of TransposeNode(W)
    matmul: int  # instruction index of AddmmNode(x, W^T)
    weight: int  # constant slot of W


@dataclass(frozen=True)
class LinearGroup:
    chain: int
    members: tuple[Member, ...]

    @property
    def weights(self) -> list[int]:
        return [m.weight for m in self.members]


def find_groups(graph: md.MLXGraphT) -> list[LinearGroup]:
    """Every provable group of two or more linear layers sharing an input."""
    readers = _reader_counts(graph)
    shapes = {
        tid: ([d.value for d in meta.shape or []], meta.scalarType)
        for tid, meta in enumerate((graph.tensorMeta or [])[: graph.numConstantTensors])
        if meta is not None
    }
    groups = []
    for c, chain in enumerate(graph.instructionChains or []):
        instructions = chain.instructions or []
        open_groups: dict[int, list[Member]] = {}  # input slot -> members so far

        def close(slot):
            members = open_groups.pop(slot, [])
            if len(members) > 1:
                groups.append(LinearGroup(c, tuple(members)))

        for i, instr in enumerate(instructions):
            if node_name(instr) in _SUBCHAINS:
                for slot in list(open_groups):
                    close(slot)
                continue
            member = _linear_member(graph, instructions, i, readers, shapes)
            if member is not None:
                members = open_groups.setdefault(instr.op.mat1.idx, [])
                first = members[0].weight if members else member.weight
                same_width = shapes[first][0][1] == shapes[member.weight][0][1]
                if same_width and shapes[first][1] == shapes[member.weight][1]:
                    members.append(member)
            for slot in tensor_fields(instr.op)[1]:
                close(slot)
        for slot in list(open_groups):
            close(slot)
    return groups


def _linear_member(graph, instructions, i, readers, shapes) -> Member | None:
    """``instructions[i]`` as a group member, when it is a bias-free matmul by
    a transposed constant that nothing else reads."""
    instr = instructions[i]
    if node_name(instr) != "AddmmNode" or instr.op.bias is not None:
        return None
    w_t = instr.op.mat2.idx
    if instr.op.mat1.idx == w_t:
        return None
    for j in range(i - 1, -1, -1):  # the transpose that wrote mat2
        reads, writes = tensor_fields(instructions[j].op)
        if w_t in reads or node_name(instructions[j]) in _SUBCHAINS:
            return None
        if w_t in writes:
            break
    else:
        return None
    t = instructions[j]
    if node_name(t) != "TransposeNode" or [int(p) for p in t.op.perm] != [1, 0]:
        return None
    weight = t.op.x.idx
    if weight >= graph.numConstantTensors or readers.get(weight) != 1:
        return None
    if weight not in shapes or len(shapes[weight][0]) != 2 or _read_later(instructions[i + 1 :], w_t):
        return None
    return Member(j, i, weight)


def _read_later(rest: list, slot: int) -> bool:
    for instr in rest:
        if node_name(instr) in _SUBCHAINS:
            return True
        reads, writes = tensor_fields(instr.op)
        if slot in reads:
            return True
        if slot in writes:
            return False
    return False


def _reader_counts(graph: md.MLXGraphT) -> dict[int, int]:
    counts: dict[int, int] = {}
    for chain in graph.instructionChains or []:
        for instr in chain.instructions or []:
            for slot in tensor_fields(instr.op)[0]:
                counts[slot] = counts.get(slot, 0) + 1
    kept = (graph.outputMap or []) + (graph.mutableBufferMap or [])
    for s in kept:
        if s.slotType == md.SlotType.TensorSlot:
            counts[s.idx] = counts.get(s.idx, 0) + 1
    return counts


def concatenate(weights: list[mx.array]) -> mx.array:
    """The group's weight: the members' rows, in order."""
    return mx.concatenate(weights, axis=0)


def plan_runs(ctx, groups: list[LinearGroup], chain: int) -> dict[int, tuple[str, object]]:
    """Instruction index -> ``(name, run)`` replacing it (None to skip it),
    for the groups of ``chain``."""
    runs: dict[int, tuple[str, object]] = {}
    for group in groups:
        if group.chain != chain:
            continue
        instructions = ctx.graph.instructionChains[chain].instructions
        x = instructions[group.members[0].matmul].op.mat1.idx
        joined = ctx.constants[group.members[0].weight]
        product = ctx.scratch_slot()
        start = 0
        for m in group.members:
            rows = ctx.graph.tensorMeta[m.weight].shape[0].value
            w_t = joined[start : start + rows].T  # this member's W^T, a view
            cols = (start, start + rows)
            start += rows
            runs[m.transpose] = None
            out = instructions[m.matmul].op.out.idx
            if m is group.members[0]:
                runs[m.matmul] = ("LinearGroup", _first_run(x, joined, w_t, product, out, cols))
            else:
                runs[m.matmul] = ("LinearColumns", _member_run(x, w_t, product, out, cols))
    return runs


# One input row (a decode step) runs the joined product; more rows (prefill)
# run each member's own product on its slice of the joined weight, since
# column slices of a wide product made the ops after them slower than the
# saved calls (135M on the CPU: prefill 0.92x, decode 1.06x when joined).


def _first_run(x: int, joined, w_t, product: int, out: int, cols):
    lo, hi = cols
    joined_t = joined.T

    def run(f):
        X = f[x]
        if X.size == X.shape[-1]:
            y = f[product] = mx.matmul(X, joined_t)
            f[out] = y[..., lo:hi]
        else:
            f[product] = None
            f[out] = mx.matmul(X, w_t)

    return run


def _member_run(x: int, w_t, product: int, out: int, cols):
    lo, hi = cols

    def run(f):
        y = f[product]
        f[out] = mx.matmul(f[x], w_t) if y is None else y[..., lo:hi]

    return run
