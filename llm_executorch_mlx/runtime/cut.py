"""A forward program cut between its layers into stages, one per rank.

A forward program is one chain of nodes over frame slots, and each layer's
attention is an ``UpdateAndAttendNode`` with its ``layerId``. Right after a
layer's last residual add, one value that depends on the activations is
live: the residual stream. The other values live there (attention
positions, RoPE's tables, the step length) derive from the program's inputs
and a few small constants (RoPE's ``inv_freq``), so a stage that starts at
that cut reruns the nodes that made them instead of receiving them. Slots
are reused, so a value is a *definition* (a slot and the node that wrote it)
and liveness is computed over reaching definitions, never over slot ids.

``stage_graph`` makes a rank's program: its nodes (the rerun ones first,
writing fresh slots so they overwrite nothing the stage reads), the residual
read from a fresh input slot and left in a fresh output slot, and the init
chain's nodes its constants need. The constants its nodes read are the only
weights the rank loads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from .errors import PteError
from .pte._schema import mlx_delegate as md
from .pte.graph import node_name

_CONTROL = ("IfNode", "ScanNode")
_WRITTEN = ("out", "outs", "outputs")
_START = -1  # the "writer" of what a call starts with: inputs, constants, literals

Definition = tuple[int, int]  # (frame slot, index of the node that wrote it, or _START)


def tensor_count(graph: md.MLXGraphT) -> int:
    return (graph.numConstantTensors + graph.numInputTensors + graph.numOutputTensors
            + graph.numMutableBufferTensors + graph.numTempTensors)


def _walk(op, n_tensors: int, visit) -> None:
    """Call ``visit(slot_object, frame_slot, written)`` for every slot a node
    names: a tensor at its Tid, a value at ``n_tensors`` + its Vid, as the
    interpreter's frame holds them."""

    def walk(value, written: bool) -> None:
        kind = type(value).__name__
        if kind == "TidT":
            visit(value, value.idx, written)
        elif kind == "VidT":
            visit(value, n_tensors + value.idx, written)
        elif kind in ("IntOrVidT", "FloatOrVidT"):
            if value.isVid and value.vid is not None:
                walk(value.vid, written)
        elif kind == "IntOrVidOrTidT":
            chosen = {1: value.vid, 2: value.tid}.get(value.kind)
            if chosen is not None:
                walk(chosen, written)
        elif isinstance(value, list):
            for item in value:
                walk(item, written)
        elif hasattr(value, "__dict__"):
            for item in vars(value).values():
                walk(item, written)

    for field, value in vars(op).items():
        walk(value, field in _WRITTEN)


def node_slots(op, n_tensors: int) -> tuple[set[int], set[int]]:
    """The frame slots a node reads and the ones it writes."""
    reads, writes = set(), set()
    _walk(op, n_tensors, lambda _, slot, written: (writes if written else reads).add(slot))
    return reads, writes


@dataclass(frozen=True)
class Stage:
    """One rank's share of a forward program: layers ``[first, end)`` of ``layers``."""

    first: int
    end: int
    layers: int
    nodes: tuple[int, ...]  # main-chain indices, in the order they run (rerun ones first)
    rerun: frozenset[int]  # those that ran before the stage in the whole program
    entry: Definition | None  # the residual it receives (None: the first stage)
    exit: Definition | None  # the residual it sends (None: the last stage, which ends in the outputs)

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.end == self.layers


class DataFlow:
    """Reaching definitions and liveness over a program's main chain."""

    def __init__(self, graph: md.MLXGraphT):
        self.graph = graph
        self.n_tensors = tensor_count(graph)
        self.instructions = graph.instructionChains[graph.mainChainIdx].instructions or []
        self.names = [node_name(i) for i in self.instructions]
        control = sorted({name for name in self.names if name in _CONTROL})
        if control:
            raise PteError(f"the forward program runs sub-chains ({', '.join(control)}): "
                           "it cannot be split between ranks")
        self.uses: list[dict[int, int]] = []  # per node: {slot it reads: the node that wrote it}
        self.writes: list[set[int]] = []
        writer: dict[int, int] = {}
        for instr in self.instructions:
            reads, writes = node_slots(instr.op, self.n_tensors)
            self.uses.append({s: writer.get(s, _START) for s in reads})
            self.writes.append(writes)
            for s in writes:
                writer[s] = len(self.writes) - 1
        # The last node that reads each definition (len(chain): the caller does).
        self.last_use: dict[Definition, int] = {}
        for i, uses in enumerate(self.uses):
            for s, w in uses.items():
                self.last_use[(s, w)] = i
        for s in graph.outputMap or []:
            slot = s.idx if s.slotType == md.SlotType.TensorSlot else self.n_tensors + s.idx
            self.last_use[(slot, writer.get(slot, _START))] = len(self.instructions)
        # Whether a node's result depends on a layer's attention (the
        # activations), rather than on the inputs and constants alone.
        self.activation: list[bool] = []
        for i, uses in enumerate(self.uses):
            self.activation.append(self.names[i] == "UpdateAndAttendNode"
                                   or any(w != _START and self.activation[w] for w in uses.values()))
        self.attention = self._attention_nodes()

    def _attention_nodes(self) -> list[int]:
        """Each layer's attention node, in layer order."""
        found = [(i, instr.op.layerId) for i, instr in enumerate(self.instructions)
                 if self.names[i] == "UpdateAndAttendNode"]
        if not found or [layer for _, layer in found] != list(range(len(found))):
            raise PteError("the forward program's layers do not each attend once, in order: "
                           "it cannot be split between ranks")
        return [i for i, _ in found]

    def live(self, at: int) -> list[Definition]:
        """The definitions written before node ``at`` that it or a later node reads."""
        return [d for d, last in self.last_use.items() if d[1] < at <= last]

    def _activations(self, at: int) -> list[Definition]:
        return [d for d in self.live(at) if d[1] != _START and self.activation[d[1]]]

    def cut(self, layer: int) -> tuple[int, Definition]:
        """``(at, residual)``: where ``layer`` (> 0) begins, right after the
        last node of the layer before it that depends on the activations (its
        residual add), and the one such value live there."""
        lo = self.attention[layer - 1]
        at = self.attention[layer]
        while at > lo and len(self._activations(at)) != 1:
            at -= 1  # back from the layer's attention, past its norm and projections
        while at - 1 > lo and not self.activation[at - 1]:
            at -= 1  # nodes of the inputs alone between the add and the layer go with the layer
        carried = self._activations(at)
        if at <= lo or len(carried) != 1:
            raise PteError(f"no single value crosses from layer {layer - 1} to layer {layer}: "
                           "the forward program cannot be split there")
        return at, carried[0]

    def rerun(self, at: int, carried: Definition) -> frozenset[int]:
        """The nodes before ``at`` that a stage starting there reruns: those
        writing what is live there but the residual, and what they read, in turn."""
        todo = [w for s, w in self.live(at) if (s, w) != carried and w != _START]
        nodes: set[int] = set()
        while todo:
            i = todo.pop()
            if i not in nodes:
                nodes.add(i)
                todo.extend(w for w in self.uses[i].values() if w != _START)
        return frozenset(nodes)


def even_split(n_layers: int, ranks: int) -> list[int]:
    """Layers per rank, as even as can be, the first ranks taking one more."""
    return [n_layers // ranks + (r < n_layers % ranks) for r in range(ranks)]


def plan_stages(graph: md.MLXGraphT, ranks: int, layers: list[int] | None = None) -> list[Stage]:
    """The stages of ``graph``'s forward over ``ranks`` ranks, ``layers[r]``
    layers to rank ``r`` (default: as even as can be)."""
    flow = DataFlow(graph)
    n = len(flow.attention)
    if ranks > n:
        raise PteError(f"the model has {n} layers, fewer than the {ranks} ranks: launch at most {n} ranks")
    layers = even_split(n, ranks) if layers is None else list(layers)
    if len(layers) != ranks or sum(layers) != n or min(layers) < 1:
        raise PteError(f"layers per rank {layers} must be {ranks} counts of at least 1 summing to the "
                       f"model's {n} layers, e.g. {','.join(map(str, even_split(n, ranks)))}")
    bounds = [0]
    for count in layers:
        bounds.append(bounds[-1] + count)
    cuts = {layer: flow.cut(layer) for layer in bounds[1:-1]}
    stages = []
    for first, end in zip(bounds, bounds[1:]):
        start, entry = cuts[first] if first else (0, None)
        stop, exit_ = cuts[end] if end < n else (len(flow.instructions), None)
        rerun = flow.rerun(start, entry) if entry else frozenset()
        stages.append(Stage(first, end, n, tuple(sorted(rerun)) + tuple(range(start, stop)), rerun, entry, exit_))
    return stages


def stage_graph(graph: md.MLXGraphT, stage: Stage) -> tuple[md.MLXGraphT, set[int]]:
    """The program rank ``stage`` runs, and the constant slots it reads.

    Its inputs are the forward's, then (but on the first stage) the residual;
    its one output is the residual it leaves (but on the last stage, which
    keeps the forward's outputs). The nodes it reruns, and the residual in
    and out, get fresh slots: rerun alone, a node would otherwise overwrite
    a slot that holds, by then, another value the stage reads.
    """
    flow = DataFlow(graph)
    n_tensors, n_values = flow.n_tensors, graph.numValues
    metas = list(graph.tensorMeta or []) + [None] * (n_tensors - len(graph.tensorMeta or []))
    fresh: dict[Definition, tuple[str, int]] = {}  # definition -> ("t", tid) | ("v", vid)

    def renamed(d: Definition, meta=None) -> None:
        slot = d[0]
        if slot < n_tensors:
            fresh[d] = ("t", len(metas))  # after every tensor slot: a new temp
            metas.append(meta if meta is not None else metas[slot])
        else:
            fresh[d] = ("v", n_values + sum(kind == "v" for kind, _ in fresh.values()))

    for i in sorted(stage.rerun):
        for s in sorted(flow.writes[i]):
            renamed((s, i))
    # A meta without a shape declares nothing: the residual goes in and out as it is.
    for d in (stage.entry, stage.exit):
        if d is not None:
            renamed(d, md.TensorMetaT())

    instructions = []
    for i in stage.nodes:
        instr = copy.copy(flow.instructions[i])
        instr.op = copy.deepcopy(instr.op)
        uses, node = flow.uses[i], i

        def rename(obj, slot, written, uses=uses, node=node):
            d = (slot, node) if written else (slot, uses.get(slot, _START))
            if d in fresh:
                obj.idx = fresh[d][1]

        _walk(instr.op, n_tensors, rename)
        instructions.append(instr)

    out = copy.copy(graph)
    main = md.InstructionChainT()
    main.instructions = instructions
    chains = list(graph.instructionChains)
    chains[graph.mainChainIdx] = main
    out.instructionChains = chains
    out.numTempTensors = graph.numTempTensors + len(metas) - n_tensors
    out.numValues = n_values + sum(kind == "v" for kind, _ in fresh.values())
    out.tensorMeta = metas

    def tensor_slot(d: Definition) -> md.SlotVariantT:
        slot = md.SlotVariantT()
        slot.idx, slot.slotType = fresh[d][1], md.SlotType.TensorSlot
        return slot

    if stage.entry is not None:
        out.inputMap = list(graph.inputMap or []) + [tensor_slot(stage.entry)]
    if stage.exit is not None:
        out.outputMap = [tensor_slot(stage.exit)]
    constants = {s for i in stage.nodes for s in flow.uses[i] if s < graph.numConstantTensors}
    if graph.initChainIdx >= 0:
        init = md.InstructionChainT()
        init.instructions, needed = _init_nodes(graph, constants, n_tensors)
        chains[graph.initChainIdx] = init
        constants |= {s for s in needed if s < graph.numConstantTensors}
    return out, constants


def _init_nodes(graph: md.MLXGraphT, slots: set[int], n_tensors: int) -> tuple[list, set[int]]:
    """The init chain's nodes that write ``slots`` (biases computed from
    scales at load), and those they read from, in turn; and all the slots
    those nodes read."""
    kept, needed = [], set(slots)
    for instr in reversed(graph.instructionChains[graph.initChainIdx].instructions or []):
        reads, writes = node_slots(instr.op, n_tensors)
        if writes & needed:
            kept.append(instr)
            needed |= reads
    return kept[::-1], needed
