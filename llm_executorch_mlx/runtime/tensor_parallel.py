"""Tensor parallel: every rank runs every layer on its share of the heads and of the MLP's width.

Megatron-LM's split, as mlx-lm's ``shard_linear`` makes it: in each layer
the products that read the residual stream (q, k, v; the MLP's gate and up)
keep rank r's r-th part of their output features ("column-parallel"), so
attention runs on the rank's heads and its cache holds their keys and
values; the products that write back to the stream (the attention's output
projection, the MLP's down projection) keep the matching part of their input
features ("row-parallel"), and their outputs, partial sums, are added over
the group with one ``all_sum`` each. Everything else (the embedding, the
norms, the LM head) is whole on every rank, so every rank computes the same
logits and runs the same text pipeline.

    group = mx.distributed.init(backend="ring", strict=True)
    rank = TensorParallel(load_program("model.pte"), group)
    cache = rank.new_cache(capacity=1024)          # this rank's KV heads
    forward = rank.load_method("forward", cache=cache)
    logits = forward.execute([input_ids, cache_position])[0]  # the same on every rank

Which product is which comes from the forward's data flow, not from names:
q, k and v are the products whose results reach a layer's attention (one
each); the output projection is the product that reads the attention's
result; the down projection is the product after it that reads only
products after it (gate and up). A layer that does not read so (fused qkv,
a bias added after a row-parallel product, KV heads the ranks cannot share
evenly) is refused in one line. Head counts need not be rewritten: the
exported reshapes infer them (``-1``), and a program that spells them out
fails its first call loudly rather than computing on the wrong heads.

A row-parallel product writes a fresh slot, and an ``IdCopyNode`` inserted
after it copies that slot to the one the product wrote: the executor runs
that copy as the ``all_sum`` (``collectives``). So no load-time rewrite
fuses across the sum (a residual add into the product's op, say).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx

from .cut import _START, DataFlow, node_slots
from .errors import PteError
from .pte._schema import mlx_delegate as md

_PRODUCTS = ("AddmmNode", "QuantizedMatmulNode")
_ATTENTION = "UpdateAndAttendNode"


@dataclass(frozen=True)
class Shards:
    """How a forward splits over ``ranks`` ranks."""

    ranks: int
    parts: dict[int, int]  # constant slot -> the axis cut into ``ranks`` equal parts
    sums: tuple[int, ...]  # main-chain indices of the row-parallel products


class TensorParallel:
    """Rank ``group.rank()``'s share of ``program``: every layer, its part of
    each layer's heads and MLP width. Reads as the program does (``metadata``,
    ``compute_dtype``...); its caches and methods are the rank's."""

    def __init__(self, program, group):
        self.program = program
        self.group = group
        self.shards = plan_shards(program.graph("forward"), group.size(),
                                  [g.n_kv_heads for g in program.cache_geometry()])

    def __getattr__(self, name):
        return getattr(self.program, name)

    def __repr__(self) -> str:
        return f"TensorParallel(rank {self.group.rank()} of {self.group.size()})"

    def new_cache(self, *args, **kwargs):
        """``Program.new_cache``, each layer's pool holding this rank's KV heads."""
        return self.program.new_cache(*args, tensor_ranks=self.group.size(), **kwargs)

    def load_method(self, name: str, cache=None):
        if name != "forward":
            return self.program.load_method(name, cache)
        return self.program.load_method(name, cache, stage=_Share(self))


class _Share:
    """What ``Program.load_method`` asks of a rank's share: its graph and
    the parts of the constants it holds, the collectives its executor runs,
    and its run (the forward's own: every rank returns the whole logits)."""

    def __init__(self, rank: TensorParallel):
        self.rank = rank
        self.tensor_ranks = rank.group.size()
        self.collectives: dict[int, object] = {}

    def __str__(self) -> str:
        return f"heads {self.rank.group.rank()} of {self.tensor_ranks}"

    def graph(self, graph):
        graph, self.collectives = shard_graph(graph, self.rank.shards, self.rank.group)
        r, n = self.rank.group.rank(), self.tensor_ranks
        held = {}
        for tid in range(graph.numConstantTensors):
            axis = self.rank.shards.parts.get(tid)
            held[tid] = () if axis is None else _part(graph, tid, axis, r, n)
        return graph, held

    def wrap(self, execute, call, dtype_map):
        return execute


def _part(graph, tid: int, axis: int, r: int, n: int) -> tuple[slice, ...]:
    size = graph.tensorMeta[tid].shape[axis].value // n
    return (slice(None),) * axis + (slice(r * size, (r + 1) * size),)


def plan_shards(graph: md.MLXGraphT, ranks: int, kv_heads: list[int]) -> Shards:
    """Which constants split along which axis, and which products' outputs
    are summed over the group, for ``ranks`` ranks."""
    flow = DataFlow(graph)
    uneven = sorted({h for h in kv_heads if h % ranks})
    if uneven:
        raise PteError(f"the model's layers have {', '.join(map(str, uneven))} KV heads, which {ranks} ranks cannot "
                       f"share evenly: launch a number of ranks that divides them, or split by layers "
                       f"(LLM_PTE_PARALLEL=pipeline)")
    products = [i for i, name in enumerate(flow.names) if name in _PRODUCTS]
    columns, rows = [], []
    heads = [_qkv(flow, a, layer) for layer, a in enumerate(flow.attention)]
    ends = [min(qkv) for qkv in heads[1:]] + [len(flow.names)]  # a layer's MLP ends where the next one's q/k/v start
    for layer, (a, end) in enumerate(zip(flow.attention, ends)):
        columns += heads[layer]
        readers = [p for p in products if a < p < end and a in _upstream(flow, p)]
        if len(readers) != 1 or _upstream(flow, readers[0]) != {a}:
            raise PteError(f"layer {layer}'s attention output is not read by exactly one product (its output "
                           "projection): tensor parallel cannot split it; split by layers (LLM_PTE_PARALLEL=pipeline)")
        output = readers[0]
        after = [p for p in products if output < p < end]
        down = next((p for p in after if _upstream(flow, p) and _upstream(flow, p) <= set(after[: after.index(p)])),
                    None)
        if down is None or set(after[: after.index(down)]) != _upstream(flow, down):
            raise PteError(f"layer {layer}'s MLP is not products of the residual stream read by one down "
                           "projection: tensor parallel cannot split it; split by layers (LLM_PTE_PARALLEL=pipeline)")
        columns += sorted(_upstream(flow, down))
        rows += [output, down]
    _check_split_values(flow, set(columns), set(rows))
    # Constants the init chain computes at load (biases from scales) come
    # out split from split constants.
    computed = set()
    if graph.initChainIdx >= 0:
        for instr in graph.instructionChains[graph.initChainIdx].instructions or []:
            computed |= node_slots(instr.op, flow.n_tensors)[1]
    parts: dict[int, int] = {}
    for i in columns:
        parts.update(_weights(flow, i, "column", ranks, computed))
    for i in rows:
        parts.update(_weights(flow, i, "row", ranks, computed))
    for s in parts:
        read_by = [i for i, uses in enumerate(flow.uses) if s in uses]
        if len(read_by) != 1 or read_by[0] not in columns + rows and not _transpose_for(flow, read_by[0], columns + rows):
            raise PteError(f"a weight split between the ranks (constant {s}) is also read whole: tensor parallel "
                           "cannot split this forward; split by layers (LLM_PTE_PARALLEL=pipeline)")
    return Shards(ranks, parts, tuple(sorted(rows)))


def _check_split_values(flow: DataFlow, columns: set[int], rows: set[int]) -> None:
    """Refuse a forward where a value computed from part of the features (a
    column-parallel product's, attention's, and what derives from them)
    reaches anything but a row-parallel product or attention: a product
    kept whole, the residual stream, an output."""
    split = [False] * len(flow.names)
    for i, name in enumerate(flow.names):
        reads_split = any(w != _START and split[w] for w in flow.uses[i].values())
        if reads_split and name in _PRODUCTS and i not in rows:
            raise PteError(f"a product (node {i}) reads values split between the ranks but is not one that sums "
                           "them: tensor parallel cannot split this forward; split by layers (LLM_PTE_PARALLEL=pipeline)")
        split[i] = i in columns or name == _ATTENTION or (reads_split and i not in rows)
    for s in flow.graph.outputMap or []:
        slot = s.idx if s.slotType == md.SlotType.TensorSlot else flow.n_tensors + s.idx
        writer = max((i for i, w in enumerate(flow.writes) if slot in w), default=_START)
        if writer != _START and split[writer]:
            raise PteError("the forward returns values split between the ranks: tensor parallel cannot split it")


def _qkv(flow: DataFlow, a: int, layer: int) -> list[int]:
    """The products whose results reach attention node ``a``'s q, k and v, one each."""
    op = flow.instructions[a].op
    found = [_upstream(flow, a, {getattr(op, field).idx}) for field in ("q", "k", "v")]
    if any(len(f) != 1 or flow.names[next(iter(f))] not in _PRODUCTS for f in found) or len(set.union(*found)) != 3:
        raise PteError(f"layer {layer}'s q, k and v are not three products of their own (a fused qkv?): tensor "
                       "parallel cannot split it; split by layers (LLM_PTE_PARALLEL=pipeline)")
    return [next(iter(f)) for f in found]


def _upstream(flow: DataFlow, node: int, slots: set[int] | None = None) -> set[int]:
    """The products and attention nodes whose results reach ``node`` (its
    reads of ``slots``; of its activations input by default) through other nodes."""
    if slots is None:
        op = flow.instructions[node].op
        slots = {(op.mat1 if flow.names[node] == "AddmmNode" else op.x).idx}
    todo = [w for s, w in flow.uses[node].items() if s in slots and w != _START]
    seen, found = set(), set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        if flow.names[i] in _PRODUCTS or flow.names[i] == _ATTENTION:
            found.add(i)
        else:
            todo.extend(w for w in flow.uses[i].values() if w != _START)
    return found


def _transpose_for(flow: DataFlow, i: int, products: list[int]) -> bool:
    """Whether node ``i`` is the transpose of a weight that only a split product reads."""
    if flow.names[i] != "TransposeNode":
        return False
    out = flow.instructions[i].op.out.idx
    return all(uses.get(out) != i or j in products for j, uses in enumerate(flow.uses))


def _weights(flow: DataFlow, i: int, kind: str, ranks: int, computed: set[int]) -> dict[int, int]:
    """``{constant slot: axis}`` of product ``i``'s weights, split ``kind``
    (column: its output features; row: its input features), but those
    ``computed`` at load."""
    op, graph = flow.instructions[i].op, flow.graph
    n_constants = graph.numConstantTensors

    def shape(tid):
        return [d.value for d in graph.tensorMeta[tid].shape]

    if flow.names[i] == "QuantizedMatmulNode":
        if not op.transpose or op.w.idx >= n_constants:
            raise PteError(f"a quantized product (node {i}) does not hold its weight as [out, in]: "
                           "tensor parallel cannot split it")
        slots = [t.idx for t in (op.w, op.scales, op.biases) if t is not None]
        axis = 0 if kind == "column" else 1
        if kind == "row" and shape(op.scales.idx)[1] % ranks:
            raise PteError(f"a quantized product's {shape(op.scales.idx)[1]} groups of inputs do not divide among "
                           f"{ranks} ranks: launch a number of ranks that divides them")
    else:
        weight, transposed = op.mat2.idx, False
        writer = flow.uses[i].get(weight, _START)
        if weight >= n_constants and writer != _START and flow.names[writer] == "TransposeNode":
            weight, transposed = flow.instructions[writer].op.x.idx, True
        if weight >= n_constants:
            raise PteError(f"a product (node {i}) does not read a weight of the file: tensor parallel cannot split it")
        axis = (0 if kind == "column" else 1) if transposed else (1 if kind == "column" else 0)
        slots = [weight]
        if op.bias is not None:
            if kind == "row":
                raise PteError(f"a row-parallel product (node {i}) adds a bias: tensor parallel cannot split it; "
                               "split by layers (LLM_PTE_PARALLEL=pipeline)")
            slots.append(op.bias.idx)
    parts = {}
    for s in set(slots) - computed:
        along = 0 if len(shape(s)) == 1 else axis
        if shape(s)[along] % ranks:
            raise PteError(f"a weight of shape {shape(s)} does not divide among {ranks} ranks along axis {along}: "
                           "launch a number of ranks that divides it")
        parts[s] = along
    return parts


def shard_graph(graph: md.MLXGraphT, shards: Shards, group) -> tuple[md.MLXGraphT, dict]:
    """``graph`` with each row-parallel product writing a fresh slot and an
    ``IdCopyNode`` after it copying that slot back, and ``{index of that copy
    in the main chain: the all_sum it runs}``."""
    out = copy.copy(graph)
    metas = list(graph.tensorMeta or [])
    n_tensors = (graph.numConstantTensors + graph.numInputTensors + graph.numOutputTensors
                 + graph.numMutableBufferTensors + graph.numTempTensors)
    metas += [None] * (n_tensors - len(metas))
    main = graph.instructionChains[graph.mainChainIdx].instructions
    instructions, collectives = [], {}
    for i, instr in enumerate(main):
        if i not in shards.sums:
            instructions.append(instr)
            continue
        product = copy.copy(instr)
        product.op = copy.copy(instr.op)
        partial = md.TidT()
        partial.idx = len(metas)
        metas.append(metas[instr.op.out.idx])
        product.op.out = partial
        total = md.IdCopyNodeT()
        total.x, total.out = partial, instr.op.out
        sum_node = md.InstructionT()
        sum_node.opType, sum_node.op = md.OpNode.IdCopyNode, total
        instructions += [product, sum_node]
        collectives[len(instructions) - 1] = lambda x: mx.distributed.all_sum(x, group=group)
    chain = md.InstructionChainT()
    chain.instructions = instructions
    chains = list(graph.instructionChains)
    chains[graph.mainChainIdx] = chain
    out.instructionChains = chains
    out.tensorMeta = metas
    out.numTempTensors = graph.numTempTensors + len(metas) - n_tensors
    return out, collectives
